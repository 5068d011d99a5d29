"""Compile the pure core and the simulation with mypyc, in place (``make native``).

What it owns: the list of modules that are compiled and how. The compiled modules are the
same source files, type-checked by mypy and translated to C; an extension module
(``engine/shard.cpython-311-*.so``) sits beside its ``.py`` and Python imports it first.
Nothing here may change what a module does: the simulation's trace hash is the same compiled
or interpreted (``tests/test_native.py`` checks it).

Why these modules: the engine (every create, fire and acknowledgement goes through it), the
simulation's drivers (a seed is half engine, half driver), and the store's routing
(``wal/route.py``: every batch is encoded there once). The Trio drivers (``cluster/``) stay
interpreted: Trio inspects coroutine objects, and their cost is in Trio and the kernel, not in
their own lines. The rest of the store (``wal/``) too: its tests subclass it and patch its
methods, which compiled classes do not allow; what is pure CPU per batch moved to ``route``.

Never run by importing: ``python build_native.py`` only, from the repository root.
``python build_native.py --can-build`` only says whether this interpreter can build (exit 0), or
names what is missing on stderr (exit 1): ``make native`` skips the build without it.
"""

from __future__ import annotations

import glob
import importlib.machinery
import os
import sys

#: Packages whose modules are compiled; each package's ``__init__.py`` stays interpreted, as it
#: holds the check that its compiled modules are not older than their sources.
PACKAGES = ("engine", "sim", "wal")
#: Packages of which only these modules are compiled (the others' every module but those
#: in INTERPRETED).
ONLY = {"wal": {"wal/route.py"}}
#: Modules left interpreted: command-line glue run once per process; the simulation's options
#: (a frozen dataclass sent to pool processes: compiled, it does not unpickle); and its seed
#: runner, which hands seeds out through a lazy generator so that a caught mutant stops the run
#: (mypyc warns that it compiles such a generator argument as a list: every seed would run
#: first).
INTERPRETED = {"sim/cli.py", "sim/config.py", "sim/report.py", "sim/runner.py"}
#: The group's shared library (every compiled module's code; each module's own extension is a
#: small shim that loads it) lives inside the ``engine`` package, as
#: ``engine/_native__mypyc.*.so``: at the top level it was found only when the repository root
#: happened to be on ``sys.path``, so the installed ``tickwheel`` script failed to import it.
GROUP = "engine._native"


def compiled_sources() -> list[str]:
    sources = []
    for package in PACKAGES:
        for path in sorted(glob.glob(f"{package}/*.py")):
            if path.endswith("__init__.py") or path in INTERPRETED:
                continue
            if package in ONLY and path not in ONLY[package]:
                continue
            sources.append(path)
    return sources


def _extension_modules() -> list[tuple[str, str]]:
    """Every extension module in :data:`PACKAGES`: (its path, its source's path)."""
    found = []
    for package in PACKAGES:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            for compiled in glob.glob(f"{package}/*{suffix}"):
                found.append((compiled, compiled[: -len(suffix)] + ".py"))
    return found


def _is_group_library(path: str) -> bool:
    package, name = GROUP.rsplit(".", 1)
    return os.path.dirname(path) == package and os.path.basename(path).startswith(f"{name}__mypyc.")


def missing_for_build() -> list[str]:
    """What this interpreter lacks to compile C extensions: the C compiler that setuptools
    would call (``$CC``, else the one Python was built with) and Python's headers."""
    import shlex
    import shutil
    import sysconfig

    missing = []
    compiler = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    words = shlex.split(compiler)
    if not words or shutil.which(words[0]) is None:
        missing.append(f"a C compiler ({words[0] if words else compiler!r} not found)")
    headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if not os.path.exists(headers):
        missing.append(f"Python's headers ({headers} not found)")
    return missing


def main() -> int:
    if sys.argv[1:] == ["--can-build"]:
        missing = missing_for_build()
        if missing:
            print(f"{sys.executable} lacks {' and '.join(missing)}", file=sys.stderr)
        return 1 if missing else 0
    # (imported here: the tests import this module for its list alone)
    from mypyc.build import mypycify
    from setuptools import setup

    os.chdir(os.path.dirname(os.path.abspath(__file__)))
    # A module taken off the list (or deleted) must not keep its old extension module, which
    # Python would still import first, against a group library that no longer holds it.
    wanted = set(compiled_sources())
    for compiled, source in _extension_modules():
        if source not in wanted and not _is_group_library(compiled):
            os.remove(compiled)
    extensions = mypycify(
        compiled_sources(),
        opt_level="3",
        # One C file for the group: mypyc's one-file-per-module mode (a build about a third
        # faster) writes the modules' C files outside the package directory that holds the
        # group's header when the group sits in a package, and gcc does not find it.
        multi_file=False,
        group_name=GROUP,
        target_dir="build/native",
    )
    setup(
        name="tickwheel-native",
        ext_modules=extensions,
        script_args=["-q", "build_ext", "--inplace", "-j", str(os.cpu_count() or 1)],
    )
    # An extension whose C did not change (an edit to a comment) is not copied again, so it
    # keeps an older time than its edited source, and the package's import check would call
    # it stale: every compiled module was just built from the sources as they are.
    for compiled, _source in _extension_modules():
        os.utime(compiled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
