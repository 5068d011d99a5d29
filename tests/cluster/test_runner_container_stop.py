"""A stopped container task is over only once its container is gone.

A fake runtime (a real process the runner drives, as in test_runner.py): ``run`` starts the
"container" outside the client's process group (a daemon runs it, not the client) and both
ignore SIGTERM, so the stop sequence SIGKILLs the client and the container runs on until
``rm -f`` removes it. ``rm`` fails its first ``FAKE_RM_FAILS`` calls (a busy or restarting
daemon); ``container inspect`` says "true" (running) while the container runs and fails with
"No such container" once it is dead.

Found by review: a removal that failed (or took longer than its bound) was ignored and the run
reported ``timed_out``, which the node takes as a confirmed stop, so an at-most-once
``on_timeout: retry`` started its next attempt beside a container that still ran; and the
guard was told the task was done before the removal, so a worker that died meanwhile left
the container running for good.
"""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

import pytest
import trio

import cluster.runner as runner
from cluster.runner import container_name, run_task
from engine.effects import RunTicket
from tests.cluster.test_runner import wait_dead

pytestmark = pytest.mark.timeout(60)

FAKE = r"""#!/bin/sh
state="$FAKE_STATE"
case "$1" in
run)
  shift
  while [ $# -gt 0 ]; do case "$1" in --name) name=$2; shift 2;; *) shift;; esac; done
  setsid sh -c 'trap "" TERM; exec sleep 300' </dev/null >/dev/null 2>&1 &
  echo $! > "$state/$name.pid"
  trap '' TERM
  echo ready
  while :; do sleep 0.2; done
  ;;
rm)
  name=$3
  n=$(cat "$state/$name.rm" 2>/dev/null || echo 0); n=$((n + 1)); echo $n > "$state/$name.rm"
  if [ "$n" -le "${FAKE_RM_FAILS:-0}" ]; then
    echo "Cannot connect to the daemon" >&2; exit 1
  fi
  kill -9 "$(cat "$state/$name.pid")" 2>/dev/null
  ;;
container)
  for name; do :; done
  if [ "${FAKE_INSPECT:-}" = fails ]; then
    echo "Cannot connect to the daemon" >&2; exit 1
  fi
  if kill -0 "$(cat "$state/$name.pid")" 2>/dev/null; then echo true; exit 0; fi
  echo "Error: No such container: $name" >&2; exit 1
  ;;
esac
"""


def ticket() -> RunTicket:
    return RunTicket(
        "box@1795000000123",
        "box",
        1_795_000_000_123,
        1,
        (7 << 32) | 19,
        1,
        "at_most_once",
        "default",
        300,
        {"container": {"image": "alpine:3", "args": ["sleep", "300"]}},
        "retry:1",
    )


class Guard:
    """A watchdog stand-in that records, at each ``done``, whether the container still ran."""

    def __init__(self, state: Path, t: RunTicket) -> None:
        self.state, self.ticket = state, t
        self.done_while_alive: list[bool] = []

    def announce(self, marker: tuple[bytes, ...], container: object) -> int:
        assert container is not None
        return 1

    async def announced(self) -> None:
        pass

    def spawned(self, key: int, pgid: int) -> None:
        pass

    def done(self, key: int) -> None:
        # (wait_dead, not alive: a container ``rm -f`` just SIGKILLed may not be gone yet;
        # this blocks the loop, so a removal still to come cannot happen meanwhile)
        self.done_while_alive.append(not wait_dead(container_pid(self.state, self.ticket)))


def container_pid(state: Path, t: RunTicket) -> int:
    return int((state / f"{container_name(t)}.pid").read_text())


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, dict[str, str]]:
    monkeypatch.setattr(runner, "_CONTAINER_RM_RETRY_S", (0.2, 0.4))
    state = tmp_path / "state"
    state.mkdir()
    path = tmp_path / "fakedocker"
    path.write_text(FAKE)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path, state, {**os.environ, "FAKE_STATE": str(state)}


async def stop_container(
    t: RunTicket,
    runtime: Path,
    env: dict[str, str],
    rm_fails: int,
    out: runner.OnOutput,
    guard: Guard | None = None,
) -> runner.TaskOutcome:
    """``t`` run on the fake runtime to its timeout, with ``rm`` failing ``rm_fails`` times."""
    return await run_task(
        t,
        on_output=out,
        kill_grace_s=0.3,
        container_runtime=str(runtime),
        base_env={**env, "FAKE_RM_FAILS": str(rm_fails)},
        guard=guard,
    )


def test_a_failed_removal_is_tried_again_and_the_stop_reported_once_it_worked(
    fake: tuple[Path, Path, dict[str, str]],
) -> None:
    runtime, state, env = fake
    t = ticket()
    guard = Guard(state, t)
    err = bytearray()

    async def out(stream: str, data: bytes) -> None:
        if stream == "stderr":
            err.extend(data)

    result = trio.run(lambda: stop_container(t, runtime, env, 2, out, guard))
    assert result.outcome == "timed_out"
    assert wait_dead(container_pid(state, t)), "reported while the container still ran"
    assert (state / f"{container_name(t)}.rm").read_text().strip() == "3"
    text = err.decode()
    assert f"removed container {container_name(t)} after 3 tries; the first failed: " in text
    assert "Cannot connect to the daemon" in text
    # The removal came before the stop's notice (which waits for the node: see below).
    assert text.index("removed container") < text.index("tickwheel: stopped (timed out")
    assert guard.done_while_alive == [False], "the guard forgot the container before it went"


def test_a_removal_that_keeps_failing_is_never_reported_and_left_to_the_guard(
    fake: tuple[Path, Path, dict[str, str]],
) -> None:
    runtime, state, env = fake
    t = ticket()
    guard = Guard(state, t)
    returned: list[object] = []

    async def out(stream: str, data: bytes) -> None:
        pass

    async def main() -> None:
        # Cancelled after 3 s, as a worker that is ending cancels its runs.
        with trio.move_on_after(3):
            returned.append(await stop_container(t, runtime, env, 1000, out, guard))

    trio.run(main)
    pid = container_pid(state, t)
    try:
        assert returned == [], "a stop was reported while its container may still run"
        assert int((state / f"{container_name(t)}.rm").read_text()) >= 3  # (it kept trying)
        assert guard.done_while_alive == [], "the guard must keep the container it could not rm"
    finally:
        os.kill(pid, signal.SIGKILL)


def test_a_container_already_gone_counts_as_removed(
    fake: tuple[Path, Path, dict[str, str]],
) -> None:
    """``rm -f`` of a ``--rm`` container that ended by itself fails ("no such container"):
    ``container inspect`` tells that from a removal that failed."""
    runtime, state, env = fake
    t = ticket()

    async def out(stream: str, data: bytes) -> None:
        pass

    async def main() -> object:
        async def kill_container_then_break_rm() -> None:
            # The container ends by itself just as the stop begins; rm then always fails.
            while not (state / f"{container_name(t)}.pid").exists():
                await trio.sleep(0.02)
            os.kill(container_pid(state, t), signal.SIGKILL)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_container_then_break_rm)
            return await stop_container(t, runtime, env, 1000, out)

    start = time.monotonic()
    result = trio.run(main)
    assert getattr(result, "outcome", None) == "timed_out"
    assert time.monotonic() - start < 5
    assert (state / f"{container_name(t)}.rm").read_text().strip() == "1"


def test_the_container_is_removed_before_anything_waits_for_the_node(
    fake: tuple[Path, Path, dict[str, str]],
) -> None:
    """The task's log waits for the node (down, as when a worker fences itself): the stop
    notice blocked the removal behind it, and the container ran on (found by review)."""
    runtime, state, env = fake
    t = ticket()
    gone: list[bool] = []

    async def out(stream: str, data: bytes) -> None:
        if b"stopped (timed out" in data or b"cannot remove" in data:
            # (wait_dead: a SIGKILLed process is not gone the instant ``kill`` returns; a
            # removal held behind this notice leaves it running for the whole wait)
            gone.append(wait_dead(container_pid(state, t)))
            await trio.sleep_forever()  # the node is down

    async def main() -> None:
        with trio.move_on_after(3):
            await stop_container(t, runtime, env, 1, out)

    trio.run(main)
    assert gone == [True]


def test_a_container_that_does_not_run_any_more_counts_as_removed(
    fake: tuple[Path, Path, dict[str, str]],
) -> None:
    """One the daemon cannot remove ("Dead", "removal in progress") but that no longer runs
    holds nothing: not a reason to hold the run for ever."""
    runtime, state, env = fake
    t = ticket()
    runtime.write_text(
        runtime.read_text().replace(
            'if kill -0 "$(cat "$state/$name.pid")" 2>/dev/null; then echo true; exit 0; fi',
            'kill -9 "$(cat "$state/$name.pid")"; echo false; exit 0',
        )
    )

    async def out(stream: str, data: bytes) -> None:
        pass

    result = trio.run(lambda: stop_container(t, runtime, env, 1000, out))
    assert result.outcome == "timed_out"
    assert (state / f"{container_name(t)}.rm").read_text().strip() == "1"


def test_a_run_cancelled_while_its_container_is_removed_signals_no_reaped_group(
    fake: tuple[Path, Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader was reaped before the removal began, so its pid (the group's id) may have
    been given out again, most likely to another task of this worker: the cancel path must
    not SIGKILL it (found by review)."""
    runtime, state, env = fake
    t = ticket()
    removing = [False]
    late_signals: list[tuple[int, int]] = []
    signal_group, remove = runner._signal_group, runner._remove_container

    def spy_signal(pgid: int, sig: int) -> None:
        if removing[0]:
            late_signals.append((pgid, sig))
        signal_group(pgid, sig)

    async def spy_remove(plan: runner.Launch) -> str | None:
        removing[0] = True
        return await remove(plan)

    monkeypatch.setattr(runner, "_signal_group", spy_signal)
    monkeypatch.setattr(runner, "_remove_container", spy_remove)

    async def out(stream: str, data: bytes) -> None:
        pass

    async def main() -> None:
        with trio.move_on_after(3.0):
            await stop_container(t, runtime, env, 1000, out)

    trio.run(main)
    try:
        assert removing[0]
        assert late_signals == [], f"signalled a reaped leader's group id: {late_signals}"
    finally:
        os.kill(container_pid(state, t), signal.SIGKILL)
