"""What must hold after every simulated run, judged on ground truth (issue 4):

1. every owed fire time is accounted for: by a run that finished or is really in progress at
   the end, or by a SKIPPED record whose reason the job's policies allow and the moment bears
   out. In detail:
   - the owed times run up to the end of the load for every job live at the end (not
     cancelled, not paused, not exhausted), not merely as far as the engine's own accounting
     got: a job that silently stops firing owes the rest;
   - ``catchup`` only for a time more than the misfire threshold late when its skip became
     durable; ``updated`` and ``cancelled`` only in the batch of that job's update or cancel;
   - an at-least-once run never ends LOST (only an at-most-once run's outcome may be
     unknown), and an at-most-once run is LOST no sooner than the reattach grace after the
     last hello or heartbeat its owner took from the worker while it executed that attempt;
   - no retry after a reported failure starts before its backoff (of the run's job version)
     has passed since the failed attempt ended, less twice the skew bound;
   - every attempt runs the version its run's records name, with that version's task and
     delivery, whatever the job became since;
2. no at-most-once run executed twice (a second execution needs a confirmed final report of
   the first);
3. no run started before its scheduled time by more than the skew bound;
4. every acknowledged create or update exists in the shard's durable log;
5. never two nodes (or two incarnations of one) acting for one shard under the same epoch;
6. no write or dispatch of a node accepted after that node's lease expired in the
   coordinator's view: a node never decides one after the coordinator let its lease lapse,
   and no store or worker takes one stamped with an epoch older than one it has already
   been opened or contacted under (the zombie's late delivery is what the fence is for);
7. every final report a worker was told was taken is in the shard's durable log (the worker
   forgets it then: a crash that lost it would turn a known outcome into LOST, or run an
   at-least-once run that succeeded again);
8. no attempt of an at-least-once run starts while an earlier attempt of it still executes:
   a retry follows the earlier attempt's end, and a run handed out again after its worker's
   lease lapsed follows that worker's self-fence (DESIGN.md, "Workers fence themselves").
   Except in the crash window DESIGN.md leaves open: an attempt sent by an owner that
   crashed before its claim was durable, and sent again by the next owner, which could not
   know of it (its worker's hello, announcing it, may come a moment later: it is then
   stopped, and its report is only a note);
9. triggers across shards (DESIGN.md: a durable outbox, delivered at least once, repeats
   ignored by the source run id): a job's ``after`` registration reaches its upstream's
   shard; an upstream success sends a trigger to every dependent its shard had registered,
   and a timeout with a ``trigger:`` handler to its target; and every trigger sent leaves at
   most one run or skip tagged with its source in the target job, and exactly one when the
   target job stood unchanged from before the trigger to the end.

Owns the :class:`Observer` (drivers report what happened as it happens: actions, executions,
acknowledgements) and :func:`final_checks` (the durable logs at the end). Must never change
what it observes.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.effects import RunTicket
from engine.frozen import rebuilt_by_init
from engine.jobs import retry_delay_ms, stored_policy
from engine.records import expand
from engine.runs import FINAL_VALUES, token_epoch
from engine.schedules import Schedule, parse_schedule
from sim.config import T0

if TYPE_CHECKING:
    from sim.node import SimNode
    from sim.world import World


@dataclass(frozen=True)
class Violation:
    """A broken promise: which check, what happened, and the names a trace excerpt of the
    re-run should follow."""

    check: str
    message: str
    focus: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "message": self.message}

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return rebuilt_by_init(self)


@dataclass(slots=True)
class Execution:
    """One task execution on a worker, from dispatch to its end."""

    worker: str
    shard: int
    run_id: str
    attempt: int
    token: int
    delivery: str
    scheduled_ms: int
    start: int  # simulated ms
    end: int | None = None
    outcome: str | None = None
    reported: bool = False
    version: int = 0  # the job version the ticket names, and the task it carries
    task: dict[str, Any] | None = None


class Observer:
    """Collects ground truth while the simulation runs; some checks answer at once."""

    def __init__(self, world: World) -> None:
        self.w = world
        self.violations: list[Violation] = []
        self.executions: list[Execution] = []
        self.first_start: dict[str, int] = {}  # run id -> its first execution's start
        self.lateness: list[tuple[int, int]] = []  # (start, ms late) of first executions
        self.early = 0
        self.acks: dict[str, int] = {}  # job id -> highest acknowledged version
        self.reports: list[tuple[int, str, int, int]] = []  # (shard, run id, token, when) acked
        self.faults: list[tuple[int, int, str, str]] = []  # (start, end, kind, target)
        #: (shard, worker) -> when the shard's owner took a hello or heartbeat of the worker
        self.contacts: defaultdict[tuple[int, str], list[int]] = defaultdict(list)
        self._actor: dict[tuple[int, int], tuple[str, int]] = {}
        self._late_actors: set[tuple[str, int, int, int]] = set()

    def fault(self, start: int, end: int, kind: str, target: str) -> None:
        self.faults.append((start, end, kind, target))
        self.w.kernel.trace("fault", kind, target, end - start)

    # ---------------------------------------------------------------- nodes (checks 5, 6)

    def acted(self, node: SimNode, shard: int, epoch: int, decided_at: int, what: str) -> None:
        """``node`` decided a write or dispatch for ``shard`` under ``epoch`` at ``decided_at``."""
        key = (shard, epoch)
        actor = (node.name, node.incarnation)
        first = self._actor.setdefault(key, actor)
        if first != actor:
            self._violate(
                "one-actor-per-epoch",
                f"shard {shard} epoch {epoch}: {actor[0]}#{actor[1]} acted ({what}) after "
                f"{first[0]}#{first[1]}",
                f"s{shard}",
                node.name,
            )
        if not self.w.coord.live(shard, epoch, decided_at):
            late = (node.name, node.incarnation, shard, epoch)
            if late not in self._late_actors:
                self._late_actors.add(late)
                tenure = self.w.coord.tenures.get(key)
                ended = None if tenure is None else tenure.ended_at
                self._violate(
                    "acted-after-lease",
                    f"{node.name} decided a {what} for shard {shard} under epoch {epoch} at "
                    f"{decided_at} ms; the coordinator ended that lease at {ended} ms",
                    f"s{shard}",
                    node.name,
                )

    def stale_dispatch(self, worker: str, shard: int, ticket: RunTicket, newest: int) -> None:
        self._violate(
            "stale-dispatch-accepted",
            f"{worker} ran {ticket.run_id} (token {ticket.token}, epoch "
            f"{ticket.token >> 32}) after shard {shard}'s owner at epoch {newest} contacted it",
            ticket.run_id,
            worker,
        )

    # ---------------------------------------------------------------- workers (checks 2, 3)

    def started(self, worker: str, shard: int, ticket: RunTicket) -> Execution:
        now = self.w.kernel.now
        execution = Execution(
            worker,
            shard,
            ticket.run_id,
            ticket.attempt,
            ticket.token,
            ticket.delivery,
            ticket.scheduled_ms,
            now,
            version=ticket.version,
            task=ticket.task,
        )
        self.executions.append(execution)
        cluster_now = T0 + now
        if cluster_now < ticket.scheduled_ms - self.w.config.skew_bound_ms:
            self.early += 1
            self._violate(
                "early",
                f"{ticket.run_id} started at {cluster_now}, "
                f"{ticket.scheduled_ms - cluster_now} ms before its time (bound "
                f"{self.w.config.skew_bound_ms} ms)",
                ticket.run_id,
            )
        if ticket.run_id not in self.first_start:
            self.first_start[ticket.run_id] = now
            self.lateness.append((now, cluster_now - ticket.scheduled_ms))
        return execution

    def ended(self, execution: Execution, outcome: str, *, reported: bool) -> None:
        execution.end, execution.outcome, execution.reported = (
            self.w.kernel.now,
            outcome,
            reported,
        )

    def contact(self, shard: int, worker: str) -> None:
        """The owner of ``shard`` took a hello or heartbeat of ``worker`` (now)."""
        self.contacts[(shard, worker)].append(self.w.kernel.now)

    # ---------------------------------------------------------------- clients (check 4)

    def acked(self, job_id: str, version: int) -> None:
        if version > self.acks.get(job_id, 0):
            self.acks[job_id] = version

    # ---------------------------------------------------------------- reports (check 7)

    def report_acked(self, shard: int, run_id: str, token: int) -> None:
        """A worker was told its final report of ``run_id`` (``token``) was taken."""
        self.reports.append((shard, run_id, token, self.w.kernel.now))

    def _violate(self, check: str, message: str, *focus: str) -> None:
        self.violations.append(Violation(check, message, tuple(focus)))


# ==================================================================== the checks at the end


_SKIP_REASONS = frozenset({"catchup", "paused", "overlap", "updated", "cancelled"})
_REPORTED = frozenset({"SUCCESS", "FAILED", "TIMED_OUT"})
_ENDED = frozenset({"SUCCESS", "FAILED", "TIMED_OUT", "LOST", "SKIPPED", "CANCELLED"})


@dataclass(slots=True)
class _Key:
    """One job key's accounting while its shard's log is replayed."""

    job_id: str
    spec: dict[str, Any]
    schedule: Schedule
    created: int | None = None  # acct of the first position after this version's record
    acct: int = 0
    live: bool = True  # the newest position: neither paused nor cancelled
    runs: set[int] | None = None
    skips: list[tuple[int, int]] | None = None
    paused_ever: bool = False


@dataclass
class Totals:
    runs: int = 0
    missed: int = 0
    double_executed: int = 0
    stuck: int = 0


def final_checks(world: World) -> tuple[list[Violation], Totals]:
    """Checks 1, 2, 4, 8 and the durable half of 6 on the state at the end of the run."""
    out: list[Violation] = []
    totals = Totals()
    # (shard, token) -> when a record of that attempt first became durable (for check 8),
    # filled by the one replay of each log
    known: dict[tuple[int, int], int] = {}
    for store in world.stores:
        _check_log(world, store.shard, out, totals, known)
    _check_amo(world, out, totals)
    out += alo_overlaps(_executions_by_run(world, "at_least_once"), known)
    _check_triggers(world, out)
    return out, totals


def _executions_by_run(world: World, delivery: str) -> dict[str, list[Execution]]:
    """Run id -> the executions of its attempts, for runs of ``delivery``."""
    by_run: defaultdict[str, list[Execution]] = defaultdict(list)
    for e in world.observer.executions:
        if e.delivery == delivery:
            by_run[e.run_id].append(e)
    return by_run


def _schedule_of(spec: dict[str, Any], cache: dict[str, Schedule]) -> Schedule:
    raw = spec["schedule"]
    key = f"{spec['id']}|{sorted(raw.items())}"
    found = cache.get(key)
    if found is None:
        found = cache[key] = parse_schedule(raw, created_ms=T0, job_id=spec["id"])
    return found


def _check_log(
    world: World,
    shard: int,
    out: list[Violation],
    totals: Totals,
    known: dict[tuple[int, int], int],
) -> None:
    store = world.stores[shard]
    cfg = world.config
    keys: dict[int, _Key] = {}
    versions: dict[str, int] = {}  # job id -> highest durable version
    last_run: dict[tuple[int, int], tuple[dict[str, Any], int]] = {}  # (key, at) -> (rec, time)
    # (key, at, token) of every durable trace a final report leaves: the outcome it reports
    # under its token (final, or PENDING for the retry it asked for), or a note (a report of
    # a superseded attempt, or of a run already final). Not LOST: that is what a lost report
    # turns into.
    reported: set[tuple[int, int, int]] = set()
    cache: dict[str, Schedule] = {}
    newest_epoch = 0
    interleaved = False

    # Every owed time up to the end of the load is accounted for by the time the checks run
    # (the drain, free of faults and client operations, is minutes long: a failover, a
    # catch-up or a burst behind the ready bound is over well before).
    horizon = T0 + cfg.end_ms
    misfire, skew = cfg.engine.misfire_ms, cfg.skew_bound_ms
    spec_of: dict[tuple[int, int], dict[str, Any]] = {}  # (key, version) -> its spec
    # (key, at) -> the job versions its run records named: one, but for a run made again at
    # the same time by a newer version (an update takes back a run fired ahead, never sent,
    # and owes its time: the same run id, the new version's run)
    versions_at: dict[tuple[int, int], set[int]] = {}
    holder: dict[tuple[int, int, int], str] = {}  # (key, at, token) -> the worker it went to
    # (key, at, attempt) -> which retry made the attempt (a durable "...; retry N" record),
    # and the job version of that record
    retry_of: dict[tuple[int, int, int], tuple[int, int]] = {}

    def verify(k: _Key, *, final: bool = False) -> None:
        if k.created is None:
            return
        t = k.schedule.next_after(k.created)
        runs, skips = k.runs or set(), k.skips or []
        # The newest version of a live job owes its times up to the horizon, whatever the
        # engine accounted for (its ``acct`` is the engine's own word: a job no longer armed
        # keeps the last one it wrote).
        until = max(k.acct, horizon) if final and k.live else k.acct
        while t is not None and t <= until:
            if t not in runs and not any(lo <= t <= hi for lo, hi in skips):
                totals.missed += 1
                out.append(
                    Violation(
                        "owed-fire-time",
                        f"job {k.job_id} (shard {shard}): fire time {t} owed, neither run "
                        f"nor skipped (accounted up to {k.acct})",
                        (k.job_id,),
                    )
                )
                return  # one per job version is enough
            t = k.schedule.next_after(t)

    for batch in store.batches:
        if batch.epoch < newest_epoch and not interleaved:
            interleaved = True
            out.append(
                Violation(
                    "interleaved-epochs",
                    f"shard {shard}: a batch of epoch {batch.epoch} (from {batch.writer}) is "
                    f"durable after epoch {newest_epoch}'s: two owners wrote into one log",
                    (f"s{shard}", batch.writer),
                )
            )
        newest_epoch = max(newest_epoch, batch.epoch)
        # The jobs this batch updates or cancels: a skip for "updated" or "cancelled" must
        # come with one (the engine records it in the same batch as the change).
        changed: dict[int, set[str]] = {}
        for raw in batch.records:
            if raw["t"] == "job":
                changed.setdefault(raw["key"], set()).add("updated")
            elif raw["t"] == "pos" and raw["gone"]:
                changed.setdefault(raw["key"], set()).add("cancelled")
        for raw in batch.records:
            for r in expand(raw) if raw["t"] == "fire" else (raw,):
                kind = r["t"]
                if kind == "run":
                    ref = (r["key"], r["at"])
                    if ref not in last_run:
                        totals.runs += 1
                    versions_at.setdefault(ref, set()).add(r["ver"])
                    last_run[ref] = (r, batch.durable_at)
                    if r["tok"]:
                        known.setdefault((shard, r["tok"]), batch.durable_at)
                        if r["w"] is not None:
                            holder[(r["key"], r["at"], r["tok"])] = r["w"]
                    why_text = r.get("why") or ""
                    if r["state"] == "PENDING" and "; retry " in why_text:
                        nth = why_text.rpartition("; retry ")[2]
                        if nth.isdigit():
                            retry_of[(r["key"], r["at"], r["att"])] = (int(nth), r["ver"])
                    if r["state"] in _REPORTED or "; retry" in why_text:
                        reported.add((r["key"], r["at"], r["tok"]))
                    k = keys.get(r["key"])
                    if k is not None:
                        if k.runs is None:
                            k.runs = set()
                        k.runs.add(r["at"])
                elif kind == "note":
                    reported.add((r["key"], r["at"], r["tok"]))
                elif kind == "pos":
                    k = keys[r["key"]]
                    if k.created is None:
                        k.created = r["acct"]
                    k.acct = r["acct"]
                    k.paused_ever = k.paused_ever or r["paused"]
                    k.live = not (r["paused"] or r["gone"])
                elif kind == "job":
                    old = keys.get(r["key"])
                    if old is not None:
                        verify(old)  # the old version's span ends here
                    spec = r["spec"]
                    spec_of[(r["key"], r["ver"])] = spec
                    keys[r["key"]] = _Key(
                        r["id"],
                        spec,
                        _schedule_of(spec, cache),
                        paused_ever=bool(spec.get("paused"))
                        or (old is not None and old.paused_ever),
                    )
                    versions[r["id"]] = max(versions.get(r["id"], 0), r["ver"])
                elif kind == "skip":
                    k = keys[r["key"]]
                    why = r["why"]
                    # A fire time whose run id (job @ time) an earlier version's run still
                    # holds, not final, cannot have a run of its own: the engine skips it as
                    # an overlap whatever the policy (README: the job was updated or
                    # re-created around that run; found by 300 seeds with a burst, where the
                    # updated job's time was still due).
                    held = last_run.get((r["key"], r["lo"]))
                    same_id = (
                        r["lo"] == r["hi"] and held is not None and held[0]["state"] not in _ENDED
                    )
                    allowed = (
                        why in _SKIP_REASONS
                        and (
                            why != "overlap"
                            or k.spec["overlap"] in ("skip", "buffer_one")
                            or same_id
                        )
                        and (why != "paused" or k.paused_ever)
                        # Late beyond the threshold when it was decided (by a clock at most
                        # the skew bound ahead of true time, and decided before durable).
                        and (why != "catchup" or T0 + batch.durable_at - r["lo"] > misfire - skew)
                        and (
                            why not in ("updated", "cancelled") or why in changed.get(r["key"], ())
                        )
                    )
                    if not allowed:
                        out.append(
                            Violation(
                                "skip-reason",
                                f"job {k.job_id}: skip {r['lo']}..{r['hi']} for {why!r} "
                                f"durable at {T0 + batch.durable_at}, which its policies "
                                f"({k.spec['overlap']}, paused={k.paused_ever}) or the batch "
                                "do not allow",
                                (k.job_id,),
                            )
                        )
                    if k.skips is None:
                        k.skips = []
                    k.skips.append((r["lo"], r["hi"]))
    for k in keys.values():
        verify(k, final=True)

    # Check 4: what clients were told is durable.
    for job_id, version in world.observer.acks.items():
        if world.shard_of(job_id) == shard and versions.get(job_id, 0) < version:
            out.append(
                Violation(
                    "acknowledged-submit",
                    f"job {job_id} version {version} was acknowledged; the log of shard "
                    f"{shard} has version {versions.get(job_id)}",
                    (job_id,),
                )
            )

    # Check 7: what workers were told of their final reports is durable.
    key_of = {k.job_id: key for key, k in keys.items()}
    for acked_shard, rid, token, when in world.observer.reports:
        if acked_shard != shard:
            continue
        job_id, _, at_text = rid.rpartition("@")
        key = key_of.get(job_id)
        if key is not None and (key, int(at_text), token) not in reported:
            out.append(
                Violation(
                    "acknowledged-report",
                    f"shard {shard}: the final report of {rid} (token {token}) was "
                    f"acknowledged at {when} ms; the log has no trace of it",
                    (rid,),
                )
            )
            break  # one per shard is enough

    # Check 1, second half: a run is final, or really in progress at the end.
    running = {(e.run_id, e.token) for e in world.observer.executions if e.end is None}
    stop = world.kernel.now
    in_flight_slack = (
        cfg.engine.worker_lease_ms + cfg.engine.reattach_grace_ms + cfg.engine.timeout_grace_ms
    ) + 60_000
    ids = {key: k.job_id for key, k in keys.items()}
    for (key, at), (r, when) in last_run.items():
        state = r["state"]
        spec = spec_of.get((key, r["ver"]))  # (a run pins the version it fired under)
        if state == "LOST" and spec is not None and spec["delivery"] == "at_least_once":
            out.append(
                Violation(
                    "at-least-once-lost",
                    f"shard {shard}: at-least-once run {ids.get(key, key)}@{at} ended LOST "
                    f"at {when} ms ({r.get('why')}); it must go out again",
                    (f"{ids.get(key, key)}@{at}",),
                )
            )
            continue
        if state in FINAL_VALUES:
            continue
        rid = f"{ids.get(key, key)}@{at}"
        age = stop - when
        if state in ("CLAIMED", "RUNNING"):
            if (rid, r["tok"]) in running or age < in_flight_slack:
                continue
            what = f"{state} by {r['w']} (token {r['tok']}) since {when} ms, and nobody runs it"
        else:  # PENDING
            due = r.get("due")
            if r.get("buf") or (due is not None and due > T0 + stop - 60_000) or age < 5 * 60_000:
                continue
            what = f"PENDING since {when} ms"
        totals.stuck += 1
        out.append(Violation("stuck-run", f"shard {shard}: run {rid} {what}", (rid,)))

    # Check 1, retries: no retry starts before its backoff is over. The node decides it at a
    # failure report, which comes after the failed attempt ended (a timeout's retry may be
    # decided before its task ended, so only failures are looked at), by a clock at most the skew
    # bound behind true time; the retry goes out at that clock's ready time, read by a clock
    # (maybe another owner's) at most the skew bound ahead.
    mine = [e for e in world.observer.executions if e.shard == shard]

    def ref_of(e: Execution) -> tuple[int, int]:
        job_id, _, at_text = e.run_id.rpartition("@")
        return key_of.get(job_id, -1), int(at_text)

    failed_end: dict[tuple[str, int], int] = {}  # (run id, attempt) -> when its execution ended
    for e in mine:
        if e.end is not None and e.outcome == "failed":
            failed_end[(e.run_id, e.attempt)] = min(
                failed_end.get((e.run_id, e.attempt), e.end), e.end
            )
    for e in mine:
        if e.attempt < 2:
            continue
        key, at = ref_of(e)
        retry = retry_of.get((key, at, e.attempt))
        failed_at = failed_end.get((e.run_id, e.attempt - 1))
        if retry is None or failed_at is None:
            continue
        nth, version = retry
        spec = spec_of.get((key, version))
        if spec is None:
            continue
        policy, _after = stored_policy(spec)
        earliest = failed_at + retry_delay_ms(policy, nth) - 2 * cfg.skew_bound_ms
        if e.start < earliest:
            out.append(
                Violation(
                    "retry-before-backoff",
                    f"{e.run_id}: attempt {e.attempt} (retry {nth}) started at {e.start} ms, "
                    f"{e.start - failed_at} ms after the attempt before failed; its backoff is "
                    f"{retry_delay_ms(policy, nth)} ms",
                    (e.run_id,),
                )
            )
            break  # one per shard is enough

    # Check 1, pinned versions: an attempt runs the version its run fired under.
    for e in mine:
        ref = ref_of(e)
        named = versions_at.get(ref)
        if named is None:
            continue
        spec = spec_of.get((ref[0], e.version))
        if e.version not in named or spec is None:
            wrong = f"its run's records name versions {sorted(named)}"
        elif e.task != spec["task"] or e.delivery != spec["delivery"]:
            wrong = f"version {e.version} is {spec['task']} ({spec['delivery']})"
        else:
            continue
        out.append(
            Violation(
                "pinned-version",
                f"{e.run_id}: attempt {e.attempt} ran version {e.version} with task {e.task} "
                f"({e.delivery}); {wrong}",
                (e.run_id,),
            )
        )
        break  # one per shard is enough

    # Check 1, the reattach grace: an at-most-once run is LOST only a grace after the last
    # sign of life its worker gave while executing the attempt. (The engine's clock may run
    # slow by the drift bound, and its timers fire on ticks: 1% and 200 ms of slack.)
    grace_floor = cfg.engine.reattach_grace_ms * 0.99 - 200
    running_on: defaultdict[tuple[str, int], list[Execution]] = defaultdict(list)
    for e in mine:
        running_on[(e.run_id, e.token)].append(e)
    for (key, at), (r, when) in last_run.items():
        if r["state"] != "LOST":
            continue
        worker = holder.get((key, at, r["tok"]))
        rid = f"{ids.get(key, key)}@{at}"
        if worker is None:
            continue
        spans = [
            (e.start, when if e.end is None else min(e.end, when))
            for e in running_on[(rid, r["tok"])]
            if e.worker == worker
        ]
        alive = [
            c
            for c in world.observer.contacts.get((shard, worker), ())
            if c <= when and any(a <= c <= b for a, b in spans)
        ]
        if alive and when - max(alive) < grace_floor:
            out.append(
                Violation(
                    "lost-within-grace",
                    f"shard {shard}: {rid} (token {r['tok']}) LOST at {when} ms, "
                    f"{when - max(alive)} ms after its owner last heard from {worker}, which "
                    f"executed it then (the reattach grace is {cfg.engine.reattach_grace_ms} ms)",
                    (rid, worker),
                )
            )
            break  # one per shard is enough

    # Check 6, the store's half: a stale owner's write accepted.
    for at, writer, stamped, newest in store.stale_accepted:
        tenure = world.coord.tenures.get((shard, stamped))
        ended = None if tenure is None else tenure.ended_at
        out.append(
            Violation(
                "stale-write-accepted",
                f"shard {shard}: {writer}'s write stamped epoch {stamped} accepted at {at} ms, "
                f"after epoch {newest} opened the store (its lease ended at {ended} ms)",
                (f"s{shard}", writer),
            )
        )
        break


def _check_triggers(world: World, out: list[Violation]) -> None:
    """Check 9, over every shard's log at once (a trigger's source and target, and a
    dependency's two jobs, may live on different shards). At most one violation of a kind."""
    end = world.config.end_ms
    # (target job id, source run id, source shard, when durable) of every trigger sent
    sent: list[tuple[str, str, int, int]] = []
    # (target job id, source run id) -> the runs (by time) and skips tagged with that source
    landed: defaultdict[tuple[str, str], set[tuple[str, int]]] = defaultdict(set)
    since: dict[str, int] = {}  # job id -> when its newest version became durable
    gone: dict[str, bool] = {}  # job id -> whether its newest position is cancelled
    after: dict[str, tuple[str, ...]] = {}  # job id -> its newest version's upstream jobs
    registered: set[tuple[str, str]] = set()  # (upstream, downstream) on at the end
    found: dict[str, str] = {}  # violation kind -> message (the first of each)

    def flag(kind: str, message: str) -> None:
        found.setdefault(kind, message)

    for store in world.stores:
        shard = store.shard
        ids: dict[int, str] = {}
        specs: dict[tuple[int, int], dict[str, Any]] = {}
        deps: defaultdict[str, set[str]] = defaultdict(set)  # upstream -> its dependents
        finals: set[tuple[int, int]] = set()
        for batch in store.batches:
            owed: list[tuple[str, str]] = []  # (target, source) this batch must send
            outs: set[tuple[str, str]] = set()
            for raw in batch.records:
                for r in expand(raw) if raw["t"] == "fire" else (raw,):
                    kind = r["t"]
                    if kind == "job":
                        ids[r["key"]] = r["id"]
                        specs[(r["key"], r["ver"])] = r["spec"]
                        since[r["id"]] = batch.durable_at
                        after[r["id"]] = tuple(r["spec"].get("after", ()))
                    elif kind == "pos" and r["key"] in ids:
                        gone[ids[r["key"]]] = bool(r["gone"])
                    elif kind == "dep":
                        if r["on"]:
                            deps[r["up"]].add(r["down"])
                        else:
                            deps[r["up"]].discard(r["down"])
                    elif kind == "out" and r.get("dep") is None and r.get("src") is not None:
                        sent.append((r["job"], r["src"], shard, batch.durable_at))
                        outs.add((r["job"], r["src"]))
                    elif kind == "skip" and r.get("src") is not None:
                        landed[(ids.get(r["key"], "?"), r["src"])].add(("skip", r["lo"]))
                    elif kind == "run":
                        ref = (r["key"], r["at"])
                        job_id = ids.get(r["key"], "?")
                        if r.get("src") is not None:
                            landed[(job_id, r["src"])].add(("run", r["at"]))
                        state = r["state"]
                        if state not in _ENDED or ref in finals:
                            continue
                        finals.add(ref)
                        rid = f"{job_id}@{r['at']}"
                        if state == "SUCCESS":
                            owed += [(down, rid) for down in sorted(deps.get(job_id, ()))]
                        elif state == "TIMED_OUT":
                            spec = specs.get((r["key"], r["ver"]), {})
                            handler = spec.get("on_timeout")
                            if isinstance(handler, str) and handler.startswith("trigger:"):
                                owed.append((handler.partition(":")[2], rid))
            for target, source in owed:
                if (target, source) not in outs:
                    flag(
                        "trigger-not-sent",
                        f"shard {shard}: {source} ended at {batch.durable_at} ms owing a "
                        f"trigger to {target}; its batch sent none",
                    )
        registered |= {(up, down) for up, downs in deps.items() for down in downs}

    for job_id, ups in after.items():
        if gone.get(job_id, True) or since[job_id] > end:
            continue
        for up in ups:
            if (up, job_id) not in registered:
                flag(
                    "dependency-not-registered",
                    f"{job_id} runs after {up} (its version durable at {since[job_id]} ms); "
                    f"{up}'s shard does not have it at the end",
                )
    for target, source, shard, when in sent:
        n = len(landed.get((target, source), ()))
        if n > 1:
            flag(
                "trigger-repeated",
                f"{source}'s trigger of {target} (sent from shard {shard}) left {n} runs or "
                f"skips: {sorted(landed[(target, source)])}",
            )
        elif n == 0 and when <= end and not gone.get(target, True) and since[target] < when:
            flag(
                "trigger-lost",
                f"{source}'s trigger of {target}, durable on shard {shard} at {when} ms, left "
                f"no run or skip in {target}, which stood unchanged since {since[target]} ms",
            )
    out += [Violation(kind, message) for kind, message in found.items()]


def _check_amo(world: World, out: list[Violation], totals: Totals) -> None:
    for run_id, executions in _executions_by_run(world, "at_most_once").items():
        if len(executions) < 2:
            continue
        executions.sort(key=lambda e: (e.start, e.token))
        for a, b in itertools.pairwise(executions):
            confirmed = (
                a.reported
                and a.outcome in ("failed", "timed_out", "killed")
                and a.end is not None
                and a.end <= b.start
                and b.attempt > a.attempt
            )
            if not confirmed:
                totals.double_executed += 1
                out.append(
                    Violation(
                        "at-most-once-executed-twice",
                        f"{run_id}: attempt {a.attempt} (token {a.token}, {a.worker}, "
                        f"{a.start}..{a.end} {a.outcome}) and attempt {b.attempt} (token "
                        f"{b.token}, {b.worker}, from {b.start})",
                        (run_id,),
                    )
                )
                break


def alo_overlaps(
    by_run: dict[str, list[Execution]], known: dict[tuple[int, int], int]
) -> list[Violation]:
    """Check 8: ``by_run`` maps a run id to its at-least-once executions,
    ``known`` maps (shard, token) to when a record of that attempt first became durable.
    At most one violation per run."""
    out: list[Violation] = []
    for run_id, executions in by_run.items():
        if len(executions) < 2:
            continue
        executions.sort(key=lambda e: (e.start, e.token))
        found = _overlap(executions, known)
        if found is not None:
            a, b = found
            out.append(
                Violation(
                    "at-least-once-attempts-overlap",
                    f"{run_id}: attempt {a.attempt} (token {a.token}, {a.worker}, "
                    f"{a.start}..{a.end} {a.outcome}) still executed when attempt "
                    f"{b.attempt} (token {b.token}, {b.worker}) started at {b.start}",
                    (run_id,),
                )
            )
    return out


def _overlap(
    executions: list[Execution], known: dict[tuple[int, int], int]
) -> tuple[Execution, Execution] | None:
    """The first (earlier, later) pair of ``executions`` (sorted by start) that ran at once
    and is not the crash window's. Every earlier attempt still running counts, not only the
    one just before: one exempt from the crash window says nothing of the attempts after it
    (found by review)."""
    for i, b in enumerate(executions):
        for a in executions[:i]:
            if a.end is not None and a.end <= b.start:
                continue
            unknown_to_b = (
                token_epoch(b.token) > token_epoch(a.token)
                and known.get((a.shard, a.token), b.start + 1) > b.start
            )
            if not unknown_to_b:
                return a, b
    return None
