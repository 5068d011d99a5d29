"""Record factories for the store's tests: the shapes :mod:`engine.records` documents, with
defaults, so a test names only what it is about."""

from __future__ import annotations

from typing import Any

from engine import records as rec
from engine.effects import Persist
from engine.records import Record

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z


def job(key: int, job_id: str | None = None, ver: int = 1, **spec: Any) -> Record:
    jid = job_id or f"job-{key}"
    return rec.make("job", key=key, id=jid, ver=ver, spec={"id": jid, **spec})


def pos(
    key: int, nxt: int | None = T0, *, paused: bool = False, gone: bool = False, acct: int = 0
) -> Record:
    return rec.make("pos", key=key, next=nxt, acct=acct, paused=paused, gone=gone, why="catchup")


def run(key: int, at: int, state: str = "PENDING", *, att: int = 1, tok: int = 0) -> Record:
    return rec.make(
        "run",
        key=key,
        at=at,
        state=state,
        att=att,
        tok=tok,
        w=None if state == "PENDING" else "w1",
        ver=1,
        due=None,
        fail=0,
        tmo=0,
        src=None,
        exit=None,
        why=None,
    )


def skip(key: int, lo: int, hi: int | None = None, n: int = 1, why: str = "overlap") -> Record:
    return rec.make("skip", key=key, lo=lo, hi=lo if hi is None else hi, n=n, why=why)


def note(key: int, at: int, tok: int = 1) -> Record:
    return rec.make("note", key=key, at=at, tok=tok, what="late report", exit=0)


def batch(batch_id: int, *records: Record, epoch: int = 1) -> Persist:
    return Persist(batch_id, epoch, tuple(records))


def created(key: int, at: int = T0, *, epoch: int = 1, batch_id: int | None = None) -> Persist:
    """The batch a create makes: the job and its position."""
    return batch(key if batch_id is None else batch_id, job(key), pos(key, at), epoch=epoch)
