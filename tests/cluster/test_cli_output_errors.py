"""The CLI when its output cannot be written (found by review, 2026-12-04): stdout on a full
disk (``/dev/full``: every write fails with ENOSPC) is one line on stderr and status 1, not a
traceback; and ``submit --file`` still tells the ids of the jobs it created (on stderr), since
they exist and submitting the file again would make a second copy of each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.procs import NodeProc

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full"),
]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProc]:
    path = tmp_path_factory.mktemp("out")
    proc = NodeProc(path / "data", path / "node.log")
    try:
        yield proc
    finally:
        proc.kill()


def to_full_disk(node: NodeProc, *args: str) -> subprocess.CompletedProcess[str]:
    with open("/dev/full", "w") as full:
        return subprocess.run(
            [sys.executable, "-m", "cluster.cli", *args, "--connect", f"127.0.0.1:{node.port}"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONIOENCODING": "utf-8"},
        )


def test_submit_file_to_a_full_disk_tells_the_created_ids_on_stderr(
    node: NodeProc, tmp_path: Path
) -> None:
    specs = tmp_path / "two.jsonl"
    specs.write_text(
        "".join(
            json.dumps({"schedule": {"every": "1h"}, "task": {"shell": f"echo {i}"}}) + "\n"
            for i in range(2)
        )
    )
    done = to_full_disk(node, "submit", "--file", str(specs), "--json")
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "tickwheel: cannot write the output: No space left on device" in done.stderr
    ids_line = next(line for line in done.stderr.splitlines() if line.startswith("["))
    ids = json.loads(ids_line)
    assert len(ids) == 2 and all(isinstance(i, str) for i in ids)
    listed = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "jobs",
            "--json",
            "--connect",
            f"127.0.0.1:{node.port}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert set(ids) <= {j["job_id"] for j in json.loads(listed.stdout)}


@pytest.mark.parametrize(
    "args",
    [("jobs",), ("jobs", "--json"), ("job", "get", "full1"), ("job", "get", "full1", "--json")],
)
def test_other_commands_to_a_full_disk_are_one_line_and_status_1(
    node: NodeProc, args: tuple[str, ...]
) -> None:
    cmd = ["submit", "--id", "full1", "--every", "1h", "--shell", "true"]
    made = subprocess.run(
        [sys.executable, "-m", "cluster.cli", *cmd, "--connect", f"127.0.0.1:{node.port}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    done = to_full_disk(node, *args)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == "tickwheel: cannot write the output: No space left on device"
