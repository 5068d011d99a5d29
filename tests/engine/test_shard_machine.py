"""The shard engine under random commands, time steps, clock jumps, crashes and worker deaths.

After every step: every owed fire time accounted for by a durable run or skip record; no
at-most-once attempt sent twice, and no at-most-once retry without a confirmed report; no run
sent before its time; no superseded report changing a state. At a crash after a full flush,
the recovered engine equals the live one.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.effects import (
    CancelJob,
    Heartbeat,
    OutboxDelivered,
    PauseJob,
    Pull,
    ReportFinished,
    ReportStarted,
    ResumeJob,
    TriggerJob,
    UpdateJob,
    WorkerHello,
)
from engine.jobs import validate_job
from engine.records import expand
from engine.runs import RunState
from engine.schedules import format_utc
from engine.shard import EngineConfig
from tests.engine.harness import T0, Node

JOBS = [f"j{i}" for i in range(6)]
WORKERS = ["w0", "w1", "w2"]
CONFIG = EngineConfig(
    worker_lease_ms=3_000,
    reattach_grace_ms=4_000,
    timeout_grace_ms=1_000,
    misfire_ms=5_000,
    ready_bound=6,
    max_clock_jump_ms=2_000,
)


class ShardMachine(RuleBasedStateMachine):
    config = CONFIG

    @initialize()
    def setup(self) -> None:
        self.node = Node(config=self.config, auto_durable=False)
        self.mono0 = self.node.mono
        self.seen_dispatches = 0
        self.amo_sent: Counter[tuple[str, int]] = Counter()
        self.confirmed: Counter[str] = Counter()  # confirmed final reports per AMO run id
        self.latest_token: dict[str, int] = {}
        self.old_tokens: dict[str, int] = {}
        self.delivery: dict[str, str] = {}
        self.held: dict[str, dict[str, int]] = {w: {} for w in WORKERS}
        self.alive: set[str] = set()

    # ------------------------------------------------------------------ helpers

    def true_now(self) -> int:
        return T0 + (self.node.mono - self.mono0)

    def observe(self) -> None:
        """Look at what the engine sent since the last step."""
        new = self.node.dispatches[self.seen_dispatches :]
        self.seen_dispatches = len(self.node.dispatches)
        for engine_ms, dispatch in new:
            ticket = dispatch.run
            # Never early: the engine's clock may run ahead of true time by the jump bound only.
            assert ticket.scheduled_ms <= self.true_now() + self.config.max_clock_jump_ms
            # ... and by its own clock never before the run's time, fired ahead or not.
            assert ticket.scheduled_ms <= engine_ms, (ticket, engine_ms)
            if ticket.delivery == "at_most_once":
                self.amo_sent[(ticket.run_id, ticket.attempt)] += 1
                assert self.amo_sent[(ticket.run_id, ticket.attempt)] == 1, ticket
                assert ticket.attempt <= self.confirmed[ticket.run_id] + 1, ticket
            previous = self.latest_token.get(ticket.run_id)
            if previous is not None:
                assert ticket.token > previous  # fencing tokens only grow
                self.old_tokens[ticket.run_id] = previous
            self.latest_token[ticket.run_id] = ticket.token
            if dispatch.worker_id in self.alive:
                self.held[dispatch.worker_id][ticket.run_id] = ticket.token
        for kill in self.node.kills:
            self.held.get(kill.worker_id, {}).pop(kill.run_id, None)
        self.node.kills.clear()

    # ------------------------------------------------------------------ jobs

    @rule(
        job=st.sampled_from(JOBS),
        kind=st.sampled_from(["once", "every", "cron"]),
        offset_s=st.integers(-20, 60),
        delivery=st.sampled_from(["at_least_once", "at_most_once"]),
        overlap=st.sampled_from(["allow", "skip", "buffer_one", "cancel_previous"]),
        catchup=st.sampled_from(["latest", "all", "skip"]),
        retries=st.integers(0, 2),
        on_timeout=st.sampled_from(["kill", "mark", "retry:1", "trigger:j0"]),
        paused=st.booleans(),
    )
    def create(
        self,
        job: str,
        kind: str,
        offset_s: int,
        delivery: str,
        overlap: str,
        catchup: str,
        retries: int,
        on_timeout: str,
        paused: bool,
    ) -> None:
        at = self.node.wall + offset_s * 1000
        schedule: dict[str, object]
        if kind == "once":
            schedule = {"at": format_utc(at)}
        elif kind == "every":
            schedule = {"every": "7s", "start": format_utc(at)}
        else:
            schedule = {"cron": "*/10 * * * * *"}
        spec = {
            "id": job,
            "schedule": schedule,
            "task": {"payload": job},
            "delivery": delivery,
            "overlap": overlap,
            "catchup": catchup,
            "max_catchup": 2,
            "retries": {"max": retries, "backoff": "2s"},
            "timeout": "4s",
            "on_timeout": on_timeout if on_timeout != f"trigger:{job}" else "kill",
            "paused": paused,
        }
        from engine.effects import CreateJob

        self.node.do(CreateJob(self.node.request(), validate_job(spec, now_ms=self.node.wall)))
        self.delivery[job] = delivery
        self.observe()

    @rule(
        job=st.sampled_from(JOBS),
        every_s=st.sampled_from([3, 7, 11]),
        overlap=st.sampled_from(["allow", "skip", "buffer_one", "cancel_previous"]),
    )
    def update(self, job: str, every_s: int, overlap: str) -> None:
        spec = {
            "id": job,
            "schedule": {"every": f"{every_s}s", "start": format_utc(self.node.wall)},
            "task": {"payload": [job, every_s]},
            "delivery": self.delivery.get(job, "at_least_once"),
            "overlap": overlap,
            "timeout": "4s",
        }
        self.node.do(UpdateJob(self.node.request(), validate_job(spec, now_ms=self.node.wall)))
        self.observe()

    @rule(job=st.sampled_from(JOBS), op=st.sampled_from(["pause", "resume", "cancel", "stop"]))
    def change(self, job: str, op: str) -> None:
        rid = self.node.request()
        command = {
            "pause": PauseJob(rid, job),
            "resume": ResumeJob(rid, job),
            "cancel": CancelJob(rid, job),
            "stop": CancelJob(rid, job, stop_running=True),
        }[op]
        self.node.do(command)
        self.observe()

    # ------------------------------------------------------------------ time and disk

    @rule(
        ms=st.sampled_from([1, 200, 1000, 3000, 9000, 40_000]),
        jump=st.sampled_from([0, 0, 0, 5000]),
    )
    def advance(self, ms: int, jump: int) -> None:
        self.node.advance(ms, wall_extra=jump)
        self.observe()

    @rule(k=st.integers(0, 4))
    def ack(self, k: int) -> None:
        if self.node.unacked:
            upto = self.node.unacked[min(k, len(self.node.unacked) - 1)].batch_id
            self.node.flush(upto)
        self.observe()

    @rule()
    def store_snapshot(self) -> None:
        self.node.take_snapshot()
        self.observe()

    @rule(flush_first=st.booleans(), via_snapshot=st.booleans())
    def crash(self, flush_first: bool, via_snapshot: bool) -> None:
        if flush_first:
            self.node.flush()
            live = self.node.engine.snapshot()
        # A restarted node has nothing but its wall clock to go by: the cluster's clock check
        # (DESIGN.md, "Cluster") is what keeps a node with a wrong clock from owning shards,
        # so the node comes back with a correct one.
        self.node.wall = self.true_now()
        self.node.crash_and_recover(downtime_ms=500, via_snapshot=via_snapshot)
        if flush_first:
            recovered = self.node.engine.snapshot()
            assert recovered["jobs"] == live["jobs"]
            assert recovered["runs"] == live["runs"]
        self.observe()

    @rule()
    def deliver_outbox(self) -> None:
        for trigger in list(self.node.triggers):
            self.node.do(TriggerJob(self.node.request(), trigger.job_id, trigger.source_run_id))
            self.node.do(OutboxDelivered(trigger.seq))
        self.node.triggers.clear()
        self.observe()

    # ------------------------------------------------------------------ workers

    @rule(w=st.sampled_from(WORKERS), credits=st.integers(0, 3))
    def hello(self, w: str, credits: int) -> None:
        self.alive.add(w)
        held = tuple(sorted(self.held[w].items()))
        self.node.do(WorkerHello(w, ("default",), credits, held))
        self.observe()

    @precondition(lambda self: bool(self.alive))
    @rule(data=st.data())
    def heartbeat_or_pull(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from(sorted(self.alive)))
        held = tuple(sorted(self.held[w].items()))
        try:
            self.node.do(Heartbeat(w, held))
            self.node.do(Pull(w, data.draw(st.integers(0, 3))))
        except Exception as error:  # a lapsed worker must say hello again
            assert getattr(error, "code", "") == "invalid"
            self.alive.discard(w)
        self.observe()

    @precondition(lambda self: bool(self.alive))
    @rule(w=st.sampled_from(WORKERS))
    def worker_dies(self, w: str) -> None:
        self.alive.discard(w)
        self.held[w].clear()

    @precondition(lambda self: any(self.held[w] for w in self.alive))
    @rule(data=st.data(), outcome=st.sampled_from(["start", "success", "failed", "timed_out"]))
    def report(self, data: st.DataObject, outcome: str) -> None:
        w = data.draw(st.sampled_from(sorted(w for w in self.alive if self.held[w])))
        rid, token = data.draw(st.sampled_from(sorted(self.held[w].items())))
        try:
            if outcome == "start":
                self.node.do(ReportStarted(w, rid, token))
            else:
                current = self.latest_token.get(rid) == token
                self.node.do(ReportFinished(w, rid, token, outcome, 1))
                self.held[w].pop(rid, None)
                job_id = rid.split("@")[0]
                if current and outcome != "success" and self.delivery.get(job_id) == "at_most_once":
                    self.confirmed[rid] += 1
        except Exception as error:
            assert getattr(error, "code", "") == "invalid"
        self.observe()

    @precondition(lambda self: bool(self.old_tokens))
    @rule(data=st.data())
    def superseded_report(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.old_tokens)))
        self.node.absorb(self.node.engine.tick(self.node.wall, self.node.mono))  # settle first
        self.observe()
        before = self.node.engine.run_state(rid)
        current = self.node.engine.snapshot()["runs"].get(rid)
        if current is not None and current[2] <= self.old_tokens[rid]:
            # A crash rolled the run back to the claim that token belongs to: it is the
            # current attempt again as far as the durable state knows, not a superseded one.
            return
        batches_before = len(self.node.unacked)
        self.node.do(ReportFinished("w0", rid, self.old_tokens[rid], "success", 0))
        assert self.node.engine.run_state(rid) == before
        _job_id, at = rid.rsplit("@", 1)
        for batch in self.node.unacked[batches_before:]:
            for r in (c for b in batch.records for c in expand(b)):
                assert not (r["t"] == "run" and r["at"] == int(at)), r
        self.observe()

    # ------------------------------------------------------------------ the promises

    @invariant()
    def every_owed_fire_time_is_accounted_for(self) -> None:
        if not hasattr(self, "node"):
            return
        jobs: dict[int, dict[str, object]] = {}
        created: dict[int, int] = {}
        acct: dict[int, int] = {}
        runs: set[tuple[int, int]] = set()
        skips: defaultdict[int, list[tuple[int, int]]] = defaultdict(list)
        for r in self.node.canonical_records():
            if r["t"] == "job":
                # A create or an update: from here the key owes the new version's fire times
                # from its next position on (what the old version owed was checked as it went:
                # its runs and skips are in the log before this record).
                jobs[r["key"]] = r["spec"]
                created.pop(r["key"], None)
                runs = {ref for ref in runs if ref[0] != r["key"]}
                skips.pop(r["key"], None)
            elif r["t"] == "pos":
                created.setdefault(r["key"], r["acct"])
                acct[r["key"]] = r["acct"]
            elif r["t"] == "run":
                runs.add((r["key"], r["at"]))
            elif r["t"] == "skip":
                assert r["why"] in ("catchup", "paused", "overlap", "updated", "cancelled")
                skips[r["key"]].append((r["lo"], r["hi"]))
        for key, spec in jobs.items():
            schedule = validate_job(spec, now_ms=T0).schedule
            t = schedule.next_after(created[key])
            while t is not None and t <= acct[key]:
                covered = (key, t) in runs or any(lo <= t <= hi for lo, hi in skips[key])
                assert covered, f"job {spec['id']}: fire time {t} owed but neither run nor skipped"
                t = schedule.next_after(t)

    @invariant()
    def in_memory_runs_are_not_final(self) -> None:
        if not hasattr(self, "node"):
            return
        for state, *_rest in self.node.engine.snapshot()["runs"].values():
            assert RunState(state) not in (RunState.SUCCESS, RunState.LOST, RunState.SKIPPED)


class FireAheadShardMachine(ShardMachine):
    """The same promises with fire-ahead (EngineConfig.fire_ahead_ms): jobs fired up to 3 s
    before their time (the steps move time by up to seconds, so that fires, commands, crashes
    and worker deaths land inside the window), overlap rules deferred to the time itself."""

    config = replace(CONFIG, fire_ahead_ms=3_000)

    @rule(ms=st.sampled_from([50, 300, 700, 1_500, 2_500]))
    def advance_within_the_window(self, ms: int) -> None:
        # Steps shorter than the window, so that fires, commands and crashes land inside it.
        self.node.advance(ms)
        self.observe()

    @invariant()
    def a_deferred_fire_time_is_nowhere_else(self) -> None:
        if not hasattr(self, "node"):
            return
        engine = self.node.engine
        for key, due in engine._deferred.items():
            assert all(wheel.due_of(key) is None for wheel in engine._fire.values()), key
            assert engine._next_due(key) == due


MACHINE_SETTINGS = settings(
    max_examples=120,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestShardMachine = ShardMachine.TestCase
TestShardMachine.settings = MACHINE_SETTINGS
TestFireAheadShardMachine = FireAheadShardMachine.TestCase
TestFireAheadShardMachine.settings = MACHINE_SETTINGS
