"""Simulated clients: the workload, and a client library that routes, retries and records.

Owns the job mix (issue 4): about 70% one-shot, 20% every 1-60 minutes, 10% cron in several
zones, half at-most-once, every overlap, catch-up, retry and timeout policy, dependencies
(``after``) and timeout triggers, some created paused; then updates, pauses, resumes and
cancels over the run. With the ``burst`` fault, a share of the one-shot jobs is due in one
second, the top of the first hour (one-shots due then, every-jobs starting then, cron jobs on
``0 * * * *``). Each job's operations go one after another to the owner of
its shard (read from the shard map, as a client library caches it), and are retried with the
same job id on a timeout, a lost reply or a redirect.

Records what the checks need: every create or update acknowledged with a reply (which the
engine sends only once the job's record is durable). Must never check anything itself.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.effects import CancelJob, Command, CreateJob, PauseJob, ResumeJob, UpdateJob
from engine.errors import EngineError
from engine.jobs import JobSpec, apply_update, validate_job
from engine.routing import shard_of
from engine.schedules import format_utc
from sim.config import HOUR_MS, T0

if TYPE_CHECKING:
    from sim.world import World

NAME = "client"
_TIMEOUT_MS = 3_000
_MAX_TRIES = 40

CRONS = (
    "*/5 * * * *",
    "*/15 * * * *",
    "0 * * * *",
    "30 */2 * * *",
    "*/10 * * * 1-5",
    "15,45 * * * *",
    "0 */3 * * *",
    "30 */7 * * * *",
    "0 0 * * *",
    "5 4 * * *",
)
ZONES = ("UTC", "Europe/Berlin", "America/New_York", "Asia/Kolkata")


@dataclass(slots=True)
class _Op:
    at: int
    kind: str  # create, update, pause, resume, cancel
    stop_running: bool = False
    changes: dict[str, Any] = field(default_factory=dict)
    built: JobSpec | None = None  # an update's complete new spec, as last sent


@dataclass(slots=True)
class _Job:
    job_id: str
    spec: dict[str, Any]
    ops: deque[_Op]
    current: JobSpec | None = None
    busy: bool = False
    tries: int = 0


class Client:
    def __init__(self, world: World, rng: random.Random) -> None:
        self.w = world
        self.k = world.kernel
        self._rng = rng
        self._creq = 0
        self._pending: dict[int, tuple[_Job, _Op]] = {}
        self.jobs: list[_Job] = []
        self.sent = 0
        self.exists_answers = 0  # retried creates answered "exists" (acknowledged)
        self.told_exists: list[str] = []
        self.gave_up = 0
        cfg = world.config
        end = cfg.end_ms
        self.burst_at = HOUR_MS if end > HOUR_MS + 10 * 60_000 else (end // 2 // 60_000) * 60_000
        self._plan(cfg.jobs, end, "burst" in cfg.faults, cfg.burst_share)

    # ================================================================ the workload

    def _plan(self, count: int, end: int, burst: bool, share: float) -> None:
        rng = self._rng
        ids = [f"job-{i:06d}" for i in range(count)]
        repeating: list[str] = []
        for i, job_id in enumerate(ids):
            r = rng.random()
            kind = "once" if r < 0.7 else "every" if r < 0.9 else "cron"
            in_burst = burst and rng.random() < share
            if in_burst:
                created = rng.randint(0, max(0, self.burst_at - 60_000))
            elif rng.random() < 0.5:
                created = rng.randint(0, min(120_000, end // 4))
            else:
                created = rng.randint(0, int(end * 0.8))
            spec = self._spec(job_id, kind, created, end, in_burst, repeating, ids[:i])
            if kind != "once":
                repeating.append(job_id)
            ops = [_Op(created, "create")]
            if rng.random() < self.w.config.update_share:
                ops.append(_Op(rng.randint(created, end), "update", changes=self._change(kind)))
            if rng.random() < 0.05:
                paused_at = rng.randint(created, end)
                ops.append(_Op(paused_at, "pause"))
                if rng.random() < 0.7:
                    ops.append(_Op(paused_at + rng.randint(60_000, 30 * 60_000), "resume"))
            if rng.random() < 0.04:
                ops.append(_Op(rng.randint(created, end), "cancel", rng.random() < 0.5))
            ops.sort(key=lambda op: op.at)
            self.jobs.append(_Job(job_id, spec, deque(ops)))

    def _spec(
        self,
        job_id: str,
        kind: str,
        created: int,
        end: int,
        in_burst: bool,
        repeating: list[str],
        earlier: list[str],
    ) -> dict[str, Any]:
        rng = self._rng
        schedule: dict[str, Any]
        if kind == "once":
            at = self.burst_at if in_burst else rng.randint(created + 5_000, end + 5 * 60_000)
            schedule = {"at": format_utc(T0 + at)}
        elif kind == "every":
            minutes = rng.randint(1, 60)
            start = self.burst_at if in_burst else created + rng.randint(0, minutes * 60_000)
            schedule = {"every": f"{minutes}m", "start": format_utc(T0 + start)}
        elif in_burst:
            schedule = {"cron": "0 * * * *", "tz": "UTC"}  # every top of the hour
        else:
            schedule = {"cron": rng.choice(CRONS), "tz": rng.choice(ZONES)}
        spec: dict[str, Any] = {
            "id": job_id,
            "schedule": schedule,
            "task": {"command": ["run", job_id]} if rng.random() < 0.5 else {"payload": job_id},
            "delivery": rng.choice(("at_least_once", "at_most_once")),
            "overlap": rng.choices(
                ("allow", "skip", "buffer_one", "cancel_previous"), (55, 15, 15, 15)
            )[0],
            "catchup": rng.choice(("latest", "all", "skip")),
            "max_catchup": rng.randint(1, 5),
            "catchup_window": rng.choice(("10m", "1h", "1d")),
            "retries": {"max": rng.randint(0, 3), "backoff": rng.choice(("5s", "30s", "2m"))},
            "tier": "batch" if rng.random() < 0.2 else "default",
        }
        if rng.random() < 0.5:
            spec["timeout"] = rng.choice(("20s", "1m", "5m", "30m"))
            handler = rng.choice(("kill", "mark", "retry:1", "retry:2", "trigger"))
            if handler == "trigger":
                handler = f"trigger:{rng.choice(earlier)}" if earlier else "kill"
            spec["on_timeout"] = handler
        if rng.random() < 0.03:
            spec["paused"] = True
        if repeating and rng.random() < 0.03:
            spec["after"] = [rng.choice(repeating)]
        return spec

    def _change(self, kind: str) -> dict[str, Any]:
        rng = self._rng
        r = rng.random()
        if r < 0.4:
            if kind == "cron":
                return {"schedule": {"cron": rng.choice(CRONS), "tz": rng.choice(ZONES)}}
            if kind == "every":
                return {"schedule": {"every": f"{rng.randint(1, 60)}m"}}
            return {"timeout": rng.choice(("30s", "2m"))}
        if r < 0.7:
            return {"overlap": rng.choice(("allow", "skip", "buffer_one", "cancel_previous"))}
        if r < 0.85:
            return {"delivery": rng.choice(("at_least_once", "at_most_once"))}
        # A new task: a run of the version before keeps its own (checked: "pinned-version").
        return {"task": {"payload": f"changed-{rng.randrange(1_000_000)}"}}

    # ================================================================ running it

    def start(self) -> None:
        for job in self.jobs:
            self.k.later(job.ops[0].at, self._next, job)

    def _next(self, job: _Job) -> None:
        if job.busy or not job.ops:
            return
        op = job.ops[0]
        now = self.k.now
        if op.at > now:
            self.k.later(op.at - now, self._next, job)
            return
        job.busy, job.tries = True, 0
        self._send(job, op)

    def _command(self, job: _Job, op: _Op) -> Command | None:
        now_ms = T0 + self.k.now
        try:
            if op.kind == "create":
                job.current = validate_job(job.spec, now_ms=now_ms)
                return CreateJob(0, job.current)
            if job.current is None:
                return None
            if op.kind == "update":
                op.built = apply_update(job.current, op.changes, now_ms=now_ms)
                return UpdateJob(0, op.built)
        except EngineError:
            return None
        if op.kind == "pause":
            return PauseJob(0, job.job_id)
        if op.kind == "resume":
            return ResumeJob(0, job.job_id)
        return CancelJob(0, job.job_id, stop_running=op.stop_running)

    def _send(self, job: _Job, op: _Op) -> None:
        command = self._command(job, op)
        if command is None or job.tries >= _MAX_TRIES:
            self.gave_up += 1
            self._done(job)
            return
        job.tries += 1
        shard = shard_of(job.job_id, self.w.shards)
        owner = self.w.coord.owner_of(shard)
        if owner is None:
            self.k.later(1_000, self._send, job, op)
            return
        self._creq += 1
        creq = self._creq
        self._pending[creq] = (job, op)
        node = self.w.node_by_name[owner]
        self.sent += 1
        self.w.net.send(NAME, owner, node.receive, None, node.on_client, self, creq, shard, command)
        self.k.later(_TIMEOUT_MS, self._timeout, creq)

    def _timeout(self, creq: int) -> None:
        entry = self._pending.pop(creq, None)
        if entry is not None:
            self._send(*entry)

    def on_not_owner(self, creq: int) -> None:
        entry = self._pending.pop(creq, None)
        if entry is not None:
            self.k.later(300, self._send, *entry)

    def on_reply(self, creq: int, result: dict[str, Any] | None, error: str | None) -> None:
        entry = self._pending.pop(creq, None)
        if entry is None:
            return
        job, op = entry
        if error is None:
            if op.kind in ("create", "update") and result is not None:
                self.w.observer.acked(job.job_id, int(result["version"]))
                if op.built is not None:
                    job.current = op.built
            self.k.trace("ack", op.kind, job.job_id)
        elif error == "exists" and op.kind == "create" and job.tries > 1:
            # Our earlier attempt got through: the engine answers "exists" only once the job
            # is durable, so a retried create takes it as its acknowledgement (check 4).
            self.exists_answers += 1
            self.told_exists.append(job.job_id)
            self.w.observer.acked(job.job_id, 1)
            self.k.trace("exists", job.job_id)
        elif error == "not_found":
            job.ops.clear()  # cancelled, or its create was lost: nothing more to do
        elif error in ("stale_epoch",):
            self.k.later(300, self._send, job, op)
            return
        else:
            self.k.trace("client-error", op.kind, job.job_id, error)
        self._done(job)

    def _done(self, job: _Job) -> None:
        if job.ops:
            job.ops.popleft()
        job.busy = False
        if job.ops:
            self._next(job)
