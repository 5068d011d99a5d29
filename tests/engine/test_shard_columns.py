"""The engine's columnar layout: the directory it consults, snapshots, and fire records."""

from __future__ import annotations

import pytest

from engine import shard
from engine.directory import MemoryDirectory
from engine.effects import (
    CancelJob,
    GetJob,
    PauseJob,
    ReportFinished,
    UpdateJob,
    WorkerHello,
)
from engine.errors import EngineStateError, EngineUsageError, JobSpecError, StaleEpoch
from engine.jobs import parse_policy, validate_job
from engine.records import ACCT_EXHAUSTED, expand
from engine.schedules import format_utc
from engine.shard import ShardEngine
from engine.snapshot import Snapshot
from tests.engine.harness import T0, Node


def spec(job_id: str, at_s: int, **extra: object) -> dict[str, object]:
    return {"id": job_id, "schedule": {"at": format_utc(T0 + at_s * 1000)}, **extra}


def test_a_pending_run_keeps_its_version_when_the_job_is_updated_before_the_claim() -> None:
    node = Node()
    node.create(**spec("p", 1), task={"shell": "echo old"})
    node.advance(1000)  # fired: PENDING, nobody to claim it
    new = validate_job({**spec("p", 100), "task": {"shell": "echo new"}}, now_ms=node.wall)
    node.do(UpdateJob(node.request(), new))
    for via_snapshot in (False, True):
        node.take_snapshot()
        node.crash_and_recover(via_snapshot=via_snapshot)
    node.do(WorkerHello("w", ("default",), 1))
    node.advance(1)
    tickets = node.tickets()
    assert [(t.run_id, t.version, t.task) for t in tickets][:1] == [
        (f"p@{T0 + 1000}", 1, {"shell": "echo old"})
    ]


def test_a_job_not_yet_durable_is_known_to_the_engine() -> None:
    node = Node(auto_durable=False)
    node.create(**spec("nd", 5), task={"command": ["true"]})
    assert node.directory.key_of("nd") is None  # the store has not seen it
    request = node.request()
    assert node.do(GetJob(request, "nd")) is None  # it describes what is not durable yet
    node.flush()
    reply = node.replies[request]
    assert reply.result is not None and reply.result["next_fire_ms"] == T0 + 5000
    node.do(CancelJob(node.request(), "nd"))
    node.flush()
    assert node.directory.key_of("nd") == 0
    assert node.engine._recent == {} and node.engine._recent_ids == {}


def test_update_owes_the_new_schedule_from_now_not_from_the_old_next_fire() -> None:
    node = Node()
    node.create(id="h", schedule={"cron": "0 * * * *"})  # hourly, next at 01:00
    node.advance(10 * 60_000)  # 00:10
    every = validate_job(
        {
            "id": "h",
            "schedule": {"every": "15m", "start": format_utc(T0)},
            "task": {"command": ["true"]},
        },
        now_ms=node.wall,
    )
    reply = node.do(UpdateJob(node.request(), every))
    assert reply is not None and reply.result is not None
    assert reply.result["next_fire_ms"] == T0 + 15 * 60_000


def test_moving_a_job_to_another_tier_moves_its_timer() -> None:
    node = Node()
    node.create(id="t", schedule={"every": "10s", "start": format_utc(T0 + 10_000)})
    moved = validate_job(
        {
            "id": "t",
            "schedule": {"every": "10s", "start": format_utc(T0 + 10_000)},
            "task": {"command": ["true"]},
            "tier": "gpu",
        },
        now_ms=node.wall,
    )
    node.do(UpdateJob(node.request(), moved))
    assert node.engine.pending_jobs() == 1
    node.do(WorkerHello("g", ("gpu",), 5))
    node.advance(10_000)
    assert [t.tier for t in node.tickets()] == ["gpu"]


def test_fire_records_expand_to_a_run_and_a_position_each() -> None:
    node = Node(auto_durable=False)
    node.create(id="a", schedule={"every": "10s", "start": format_utc(T0 + 10_000)})
    node.create(**spec("b", 10), task={"command": ["true"]})
    node.flush()
    node.advance(10_000)
    (fire,) = node.unacked[-1].records
    assert fire["t"] == "fire" and sorted(fire["keys"]) == [0, 1]
    expanded = expand(fire)
    runs = [r for r in expanded if r["t"] == "run"]
    positions = {r["key"]: r for r in expanded if r["t"] == "pos"}
    assert {(r["key"], r["at"], r["state"], r["att"]) for r in runs} == {
        (0, T0 + 10_000, "PENDING", 1),
        (1, T0 + 10_000, "PENDING", 1),
    }
    assert positions[0]["next"] == T0 + 20_000 and positions[0]["acct"] == T0 + 19_999
    assert positions[1]["next"] is None and positions[1]["acct"] == ACCT_EXHAUSTED
    assert all(r["e"] == node.epoch for r in expanded)


def build_mixed_shard() -> Node:
    node = Node()
    node.do(WorkerHello("w", ("default",), 2))
    node.create(id="every", schedule={"every": "10s", "start": format_utc(T0 + 10_000)})
    node.create(id="cron", schedule={"cron": "*/5 * * * * *", "tz": "Europe/Berlin"})
    node.create(**spec("later", 3600), task={"payload": {"x": 1}}, delivery="at_most_once")
    node.create(**spec("paused", 30), task={"command": ["true"]})
    node.do(PauseJob(node.request(), "paused"))
    node.create(**spec("gone", 30), task={"command": ["true"]})
    node.do(CancelJob(node.request(), "gone"))
    node.create(
        id="buf",
        schedule={"every": "1s", "start": format_utc(T0 + 1000)},
        task={"command": ["true"]},
        overlap="buffer_one",
        tier="slow",
    )
    node.create(id="down", schedule={"at": format_utc(T0 + 10**9)}, after=["every"])
    node.deliver_registrations()
    node.advance(12_000)
    return node


def test_a_snapshot_rebuilds_exactly_the_state_records_rebuild() -> None:
    node = build_mixed_shard()
    live = node.engine.snapshot()
    assert live["runs"] and live["dependents"] == {"every": ["down"]}
    node.take_snapshot()
    # A few more changes after the snapshot: the tail.
    ticket = node.tickets()[0]
    node.do(ReportFinished("w", ticket.run_id, ticket.token, "success", 0))
    node.advance(3000)
    live = node.engine.snapshot()
    records = list(node.durable_records)
    node.crash_and_recover(via_snapshot=True)
    from_snapshot = node.engine.snapshot()
    from_records, _ = ShardEngine.recover(
        records,
        epoch=node.epoch,
        wall_ms=node.wall,
        mono_ms=node.mono,
        config=node.config,
        directory=MemoryDirectory(records),
    )
    for state in (from_snapshot, from_records.snapshot()):
        assert state["jobs"] == live["jobs"]
        assert state["runs"] == live["runs"]
        assert state["outbox"] == live["outbox"]
        assert state["dependents"] == live["dependents"]


def _recover(node: Node, snap: Snapshot) -> ShardEngine:
    engine, _ = ShardEngine.recover(
        [],
        snapshot=snap,
        directory=MemoryDirectory(node.durable_records),
        epoch=node.epoch + 1,
        wall_ms=node.wall,
        mono_ms=node.mono,
        config=node.config,
    )
    return engine


def test_a_snapshot_stores_each_policy_once_and_reads_the_older_form_too() -> None:
    node = build_mixed_shard()
    node.flush()
    live = node.engine.snapshot()
    snap = node.engine.export_snapshot()
    policies, profiles = snap.meta["policies"], snap.meta["profiles"]
    distinct = {p.policy for p in node.engine._profiles}
    assert len(policies) == len(distinct) < len(profiles)
    assert all(isinstance(d["policy"], int) for d in profiles)
    assert _recover(node, snap).snapshot()["jobs"] == live["jobs"]
    # Snapshots written before the table carried each profile's policy whole.
    older = dict(snap.meta)
    del older["policies"]
    older["profiles"] = [{**d, "policy": policies[d["policy"]]} for d in profiles]
    recovered = _recover(node, Snapshot(snap.arrays, older))
    assert recovered.snapshot()["jobs"] == live["jobs"]
    assert [p.policy for p in recovered._profiles] == [p.policy for p in node.engine._profiles]
    # A profile naming a policy the table does not hold is a broken store, not a default.
    broken = dict(snap.meta)
    broken["profiles"] = [{**profiles[0], "policy": len(policies)}, *profiles[1:]]
    with pytest.raises(EngineStateError, match="names policy"):
        _recover(node, Snapshot(snap.arrays, broken))


def _clear_snapshot_caches() -> None:
    from engine import jobs

    shard._SNAPSHOT_POLICIES.clear()
    shard._STORED_SCHEDULES.clear()
    jobs._POLICY_DICTS.clear()


def test_snapshot_caches_give_what_parsing_and_rendering_give() -> None:
    node = build_mixed_shard()
    node.flush()
    live = node.engine.snapshot()
    _clear_snapshot_caches()
    cold = node.engine.export_snapshot()
    warm = node.engine.export_snapshot()  # every policy's form from the cache now
    assert warm.meta["policies"] == cold.meta["policies"]
    assert warm.meta["profiles"] == cold.meta["profiles"]
    uncached = [
        p.to_dict() for p in {id(p.policy): p.policy for p in node.engine._profiles}.values()
    ]
    assert all(form in uncached for form in warm.meta["policies"])
    # Each snapshot has dicts of its own: changing one changes neither the cache nor the next.
    warm.meta["policies"][0]["retries"]["max"] = 99
    warm.meta["policies"][0]["tier"] = "changed"
    assert node.engine.export_snapshot().meta["policies"] == cold.meta["policies"]
    # Loading: cold (parsing every policy and schedule) and warm give the same engine state,
    # with policies and schedules equal to those parsed afresh.
    _clear_snapshot_caches()
    first = _recover(node, cold)
    second = _recover(node, cold)
    for engine in (first, second):
        assert engine.snapshot()["jobs"] == live["jobs"]
        assert [p.policy for p in engine._profiles] == [p.policy for p in node.engine._profiles]
        assert [p.schedule for p in engine._profiles] == [p.schedule for p in node.engine._profiles]
    for stored in cold.meta["policies"]:
        assert shard._snapshot_policy(stored) == parse_policy(stored)


def test_the_snapshot_policy_cache_tells_apart_values_that_compare_equal() -> None:
    _clear_snapshot_caches()
    assert shard._snapshot_policy({"max_catchup": 1}).max_catchup == 1
    # True == 1 as a dict key, but a bool is no count: still refused once 1 is cached.
    with pytest.raises(JobSpecError):
        parse_policy({"max_catchup": True})
    with pytest.raises(JobSpecError):
        shard._snapshot_policy({"max_catchup": True})
    # A refusal is not kept: the same text refused again, and a bound that clears when full.
    with pytest.raises(JobSpecError):
        shard._snapshot_policy({"max_catchup": True})
    assert len(shard._SNAPSHOT_POLICIES) == 1


def test_a_snapshot_needs_the_stores_directory_and_a_newer_epoch() -> None:
    node = build_mixed_shard()
    snap = node.engine.export_snapshot()
    with pytest.raises(EngineUsageError):
        ShardEngine.recover([], snapshot=snap, epoch=9, wall_ms=node.wall, mono_ms=node.mono)
    with pytest.raises(StaleEpoch):
        ShardEngine.recover(
            [],
            snapshot=snap,
            directory=MemoryDirectory(node.durable_records),
            epoch=node.epoch,
            wall_ms=node.wall,
            mono_ms=node.mono,
        )


def test_pending_one_shot_jobs_cost_columns_not_objects() -> None:
    node = Node()
    engine = node.engine
    for i in range(2000):
        node.create(**spec(f"j{i}", 60 + i % 600), task={"payload": i})
    assert engine.pending_jobs() == 2000
    # Nothing per job but columns and wheel entries: no dict entry of any kind survives.
    assert engine._recent == {} and engine._active == {} and engine._held_next == {}
    assert len(engine._profiles) == 1  # one-shot jobs with equal policies share a profile
    assert len(engine._ver) >= 2000 and engine._next_key == 2000


def test_handle_many_decides_as_handling_one_by_one() -> None:
    from engine.effects import CreateJob, Durable, Persist, Reply

    def run(grouped: bool) -> tuple[dict[str, object], list[object]]:
        engine = ShardEngine(epoch=1, wall_ms=T0, mono_ms=0)
        commands = [
            CreateJob(i, validate_job(spec(f"g{i % 7}", 1 + i % 3, task={"payload": i}), now_ms=T0))
            for i in range(20)
        ]
        replies: list[object] = []
        effects = (
            engine.handle_many(commands, T0, 0)
            if grouped
            else [e for c in commands for e in engine.handle(c, T0, 0)]
        )
        for _ in range(3):
            acks = [Durable(e.batch_id) for e in effects if isinstance(e, Persist)]
            replies += [(e.request_id, e.error is None) for e in effects if isinstance(e, Reply)]
            effects = engine.handle_many(acks, T0 + 5000, 5000) if acks else []
        return engine.snapshot(), sorted(replies)

    assert run(grouped=True) == run(grouped=False)


def test_replays_keep_profiles_by_text_and_build_what_parsing_builds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = build_mixed_shard()
    # More of the same and more versions: jobs alike, updated, with jitter (whose profile
    # depends on the id), and a policy value that a dict key would confuse with another.
    for n in range(3):
        node.create(**spec(f"alike{n}", 600), task={"command": ["true"]}, max_catchup=1)
        node.create(
            id=f"jit{n}",
            schedule={"every": "1m", "start": format_utc(T0 + 60_000), "jitter": "30s"},
            task={"command": ["true"]},
        )
        node.create(
            id=f"float{n}",
            schedule={"every": "1m", "start": format_utc(T0 + 60_000)},
            task={"command": ["true"]},
            retries={"max": 1, "factor": 2 if n else 2.5},
        )
    update = {**spec("alike0", 900), "task": {"command": ["false"]}, "max_catchup": 1}
    node.do(UpdateJob(node.request(), validate_job(update, now_ms=node.wall)))
    node.flush()
    records = list(node.durable_records)

    def recover() -> ShardEngine:
        engine, _ = ShardEngine.recover(
            records,
            epoch=node.epoch + 1,
            wall_ms=node.wall,
            mono_ms=node.mono,
            config=node.config,
            directory=MemoryDirectory(records),
        )
        return engine

    shard._STORED_PROFILES.clear()
    parses: list[object] = []
    slow = ShardEngine._stored_profile_parsed
    with monkeypatch.context() as m:
        m.setattr(
            ShardEngine,
            "_stored_profile_parsed",
            lambda self, s: parses.append(s) or slow(self, s),
        )
        kept = recover()
    jobs = [r for r in records if r["t"] == "job"]
    assert len(parses) < len(jobs)  # the alike ones were not parsed again
    parsed_before = len(parses)
    with monkeypatch.context() as m:
        m.setattr(ShardEngine, "_stored_profile_parsed", lambda self, s: parses.append(s))
        again = recover()  # another engine of the process: every profile from the cache
    assert len(parses) == parsed_before
    assert again._profiles == kept._profiles
    with monkeypatch.context() as m:
        m.setattr(ShardEngine, "_stored_profile", ShardEngine._stored_profile_parsed)
        parsed = recover()
    assert len(kept._profiles) == len(parsed._profiles) < len(records)
    assert kept._profiles == parsed._profiles
    assert [p.jitter_id for p in kept._profiles] == [p.jitter_id for p in parsed._profiles]
    assert list(kept._prof) == list(parsed._prof)
    assert kept.snapshot() == parsed.snapshot()
