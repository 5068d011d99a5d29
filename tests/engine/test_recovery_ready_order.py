"""The ready queue after a recovery is the same whether a snapshot was used or not.

Three one-shot jobs created a, b, c (keys 0, 1, 2) fire in the order c, b, a (their times are
in that order) while no worker has a free slot. Live, after a recovery from the log alone and
after one from a snapshot (which stores runs in (key, time) order), a worker with room gets
them c, b, a: the most overdue run first.
"""

from __future__ import annotations

import pytest

from engine.effects import WorkerHello
from engine.schedules import format_utc
from tests.engine.harness import T0, Node


def _order(*, via_snapshot: bool | None) -> list[str]:
    node = Node()
    node.create(id="a", schedule={"at": format_utc(T0 + 3_000)})
    node.create(id="b", schedule={"at": format_utc(T0 + 2_000)})
    node.create(id="c", schedule={"at": format_utc(T0 + 1_000)})
    node.run_until(5_000)
    if via_snapshot is not None:
        if via_snapshot:
            node.take_snapshot()
        node.crash_and_recover(via_snapshot=via_snapshot)
    node.do(WorkerHello("w", ("default",), 3))
    return [t.job_id for t in node.tickets()]


@pytest.mark.parametrize("via_snapshot", [None, False, True], ids=["live", "log", "snapshot"])
def test_waiting_runs_go_out_in_fire_order(via_snapshot: bool | None) -> None:
    assert _order(via_snapshot=via_snapshot) == ["c", "b", "a"]
