"""The compiled build (``make native``, mypyc): that it is what runs, that it decides exactly as
the interpreted sources do, and that a compiled module older than its source is refused."""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine import GROUP_LIBRARY_PREFIX, StaleCompiledModule

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from build_native import GROUP, compiled_sources  # noqa: E402

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _is_compiled(module_name: str) -> bool:
    module = importlib.import_module(module_name)
    return any(str(module.__file__).endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES)


@pytest.mark.skipif(
    os.environ.get("TICKWHEEL_EXPECT_NATIVE") != "1",
    reason="set by `make test`, which builds the compiled modules first",
)
def test_every_listed_module_runs_compiled() -> None:
    names = [s[: -len(".py")].replace("/", ".") for s in compiled_sources()]
    assert "engine.shard" in names and "sim.node" in names
    assert [n for n in names if not _is_compiled(n)] == []
    # the packages' own __init__ stays interpreted: it holds the staleness check
    assert not _is_compiled("engine")


def test_the_group_library_sits_where_the_engine_package_skips_it() -> None:
    package, name = GROUP.rsplit(".", 1)
    assert package == "engine" and GROUP_LIBRARY_PREFIX == f"{name}__mypyc."


@pytest.mark.skipif(
    os.environ.get("TICKWHEEL_EXPECT_NATIVE") != "1",
    reason="set by `make test`, which builds the compiled modules first",
)
def test_the_installed_script_runs_compiled_from_any_directory(tmp_path: Path) -> None:
    """The console script's ``sys.path`` holds no repository root (a build that left its
    shared library at the top level failed here with ModuleNotFoundError, `make sim` too)."""
    script = Path(sys.executable).parent / "tickwheel"
    if not script.exists():
        pytest.skip("the package is not installed in this interpreter's environment")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(argv: list[str], timeout: float) -> str:
        done = subprocess.run(
            argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    sim = ["sim", "--seed", "3", "--jobs", "30", "--hours", "0.2", "--json"]
    assert json.loads(run([str(script), *sim], 120))["violations"] == []
    where = run([sys.executable, "-c", "import engine.shard; print(engine.shard.__file__)"], 60)
    assert where.strip().endswith(SUFFIX), where


def test_the_group_library_needs_no_source_of_its_own(tmp_path: Path) -> None:
    package = _package(tmp_path)
    (package / f"{GROUP_LIBRARY_PREFIX}{SUFFIX.lstrip('.')}").write_bytes(b"")
    _import_fresh(tmp_path)  # not refused: no ``_native__mypyc.py`` is expected


def _sim_trace(cwd: Path, env_path: Path) -> dict[str, object]:
    options = ["--seed", "7", "--jobs", "300", "--hours", "1", "--faults", "all", "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "sim", *options, "--procs", "1"],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(env_path)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout)
    return result


@pytest.mark.slow
def test_compiled_and_interpreted_make_the_same_trace(tmp_path: Path) -> None:
    """The same seed through the tree as it is (compiled where built) and through a copy of its
    sources alone: the same trace hash, decision for decision."""
    copy = tmp_path / "src"
    for package in ("engine", "sim", "wal", "cluster"):
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("*.so"))
    assert not list(copy.rglob("*.so"))
    here = _sim_trace(ROOT, ROOT)
    there = _sim_trace(copy, copy)
    assert here["violations"] == [] and there["violations"] == []
    assert here["trace_hash"] == there["trace_hash"]
    assert here["runs"] == there["runs"]


def _package(tmp_path: Path) -> Path:
    package = tmp_path / "pkg_stale"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent(
            """
            from engine import refuse_stale_compiled

            refuse_stale_compiled(__file__)
            """
        )
    )
    (package / "mod.py").write_text("X = 1\n")
    return package


def _import_fresh(tmp_path: Path) -> None:
    sys.modules.pop("pkg_stale", None)
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.import_module("pkg_stale")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("pkg_stale", None)


def test_a_compiled_module_older_than_its_source_is_refused(tmp_path: Path) -> None:
    package = _package(tmp_path)
    compiled = package / f"mod{SUFFIX}"
    compiled.write_bytes(b"")  # only its time is read
    source_time = os.stat(package / "mod.py").st_mtime_ns
    os.utime(compiled, ns=(source_time + 10**9, source_time + 10**9))
    _import_fresh(tmp_path)  # newer than its source: fine

    os.utime(compiled, ns=(source_time - 10**9, source_time - 10**9))
    with pytest.raises(StaleCompiledModule) as caught:
        _import_fresh(tmp_path)
    assert "make native" in str(caught.value) and "mod.py" in str(caught.value)
    assert isinstance(caught.value, ImportError)


def test_a_compiled_module_whose_source_is_gone_is_refused(tmp_path: Path) -> None:
    package = _package(tmp_path)
    (package / "mod.py").unlink()
    (package / f"mod{SUFFIX}").write_bytes(b"")
    with pytest.raises(StaleCompiledModule):
        _import_fresh(tmp_path)
