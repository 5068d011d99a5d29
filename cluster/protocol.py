"""The operations of the wire protocol: names, arguments, and the shapes of replies.

Owns the vocabulary of :mod:`cluster.codec`'s messages: which ops exist, who may send them
(clients, workers), which arguments each takes with which types, and how a result, an error or
a push (a message the node sends unasked: a dispatch, a kill, a log chunk) is laid out. Every
request is checked here before anything acts on it, so that a wrong type or an unknown field
is a typed ``bad_args`` error naming the field, never an exception deep in the node. Must
never act: executing an op is :mod:`cluster.node`'s business.

A request is ``{"id": int, "op": str, "args": {...}}``; its reply ``{"id", "ok": true,
"result": {...}}`` or ``{"id", "ok": false, "error": {"code", "message", "field"}}``. Replies
may come out of order (pipelining); the id pairs them. A push is ``{"push": kind, ...}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from cluster.codec import Message, ProtocolError
from engine.schedules import MAX_PREVIEW

#: Per op: (argument name -> (accepted types, required)). ``object`` accepts any msgpack value.
_STR = (str,)
_INT = (int,)
_BOOL = (bool,)
_MAP = (dict,)
_LIST = (list,)
_BYTES = (bytes,)

ArgSpec = dict[str, tuple[tuple[type, ...], bool]]

OPS: Final[dict[str, ArgSpec]] = {
    "ping": {},
    # ---- jobs
    "job.create": {"spec": (_MAP, True)},
    "job.create_many": {"specs": (_LIST, True)},
    "job.update": {"id": (_STR, True), "changes": (_MAP, True), "if_version": (_INT, False)},
    "job.cancel": {"id": (_STR, True), "stop_running": (_BOOL, False)},
    "job.pause": {"id": (_STR, True)},
    "job.resume": {"id": (_STR, True)},
    "job.get": {"id": (_STR, True)},
    "job.list": {"after": (_STR, False), "limit": (_INT, False)},
    "job.preview": {"id": (_STR, False), "schedule": (_MAP, False), "count": (_INT, False)},
    # ---- runs
    "run.get": {"run_id": (_STR, True)},
    "run.history": {"job_id": (_STR, True), "last": (_INT, False)},
    "run.skips": {"job_id": (_STR, True), "last": (_INT, False)},
    "run.logs": {
        "run_id": (_STR, True),
        "offset": (_INT, False),
        "limit": (_INT, False),
    },
    # ---- workers
    "worker.hello": {
        "worker_id": (_STR, True),
        "tiers": (_LIST, True),
        "slots": (_INT, True),
        "held": (_LIST, False),
        "instance": (_STR, False),
        "seen": (_LIST, False),
    },
    "worker.heartbeat": {"held": (_LIST, False), "seen": (_LIST, False)},
    "worker.pull": {"credits": (_INT, True)},
    "worker.started": {"run_id": (_STR, True), "token": (_INT, True)},
    "worker.output": {
        "run_id": (_STR, True),
        "token": (_INT, True),
        "stream": (_STR, True),
        "data": (_BYTES, True),
        "attempt": (_INT, False),
        "offset": (_INT, False),
    },
    "worker.finished": {
        "run_id": (_STR, True),
        "token": (_INT, True),
        "outcome": (_STR, True),
        "exit_code": ((int, type(None)), False),
        "credits": (_INT, False),
    },
    # Several final reports in one request (each a map of worker.finished's fields but
    # credits); the free slots once, after them all.
    "worker.finished_many": {"reports": (_LIST, True), "credits": (_INT, False)},
}

#: Ops a connection may send only after ``worker.hello``.
WORKER_OPS: Final = frozenset(op for op in OPS if op.startswith("worker.") and op != "worker.hello")

MAX_LIMIT: Final = 10_000  # largest page of a list, history or log read
MAX_BATCH: Final = 10_000  # most specs in one job.create_many
#: most slots (credits) one worker may offer: its held runs, every one of which each hello
#: and heartbeat announces, then stay far below the codec's list limit (262,144)
MAX_WORKER_SLOTS: Final = 10_000


_TOP_KEYS: Final = frozenset(("id", "op", "args"))
#: per op: its argument names (a fast subset test), and the bounded ones it takes
_ARG_NAMES: Final = {op: frozenset(spec) for op, spec in OPS.items()}
_BOUNDED: Final = {
    op: tuple(name for name in ("limit", "last", "count") if name in spec)
    for op, spec in OPS.items()
}


@dataclass(frozen=True, slots=True)
class Request:
    id: int
    op: str
    args: dict[str, Any]


def parse_request(message: Message) -> Request:
    """The request in ``message``, its arguments checked against :data:`OPS`.

    Raises :class:`ProtocolError` with code ``bad_request`` (no integer id or no op),
    ``unknown_op``, or ``bad_args`` (an unknown argument, a missing one, a wrong type, a limit
    out of range); the error carries the request id whenever there is one.
    """
    request_id = message.get("id")
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise ProtocolError("bad_request", "a request needs an integer 'id'")
    op = message.get("op")
    if not isinstance(op, str):
        raise ProtocolError("bad_request", "a request needs a string 'op'", request_id)
    spec = OPS.get(op)
    if spec is None:
        raise ProtocolError("unknown_op", f"unknown op {op[:64]!r}", request_id)
    if not message.keys() <= _TOP_KEYS:  # (a subset test in C: the common case costs little)
        extra = set(message) - _TOP_KEYS
        # (by repr: keys may be text and bytes at once, which do not compare: found by review)
        raise ProtocolError("bad_request", f"unknown keys {sorted(extra, key=repr)}", request_id)
    args = message.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError("bad_args", "'args' must be a map", request_id)
    _check_args(spec, _ARG_NAMES[op], args, request_id, op)
    for name in _BOUNDED[op]:
        top = MAX_PREVIEW if name == "count" else MAX_LIMIT
        if name in args and not 1 <= args[name] <= top:
            raise _bad(request_id, name, f"must be in 1..{top}")
    if op == "job.create_many" and len(args["specs"]) > MAX_BATCH:
        raise _bad(request_id, "specs", f"at most {MAX_BATCH} specs per batch")
    return Request(request_id, op, args)


#: The fields of one report of ``worker.finished_many``: ``worker.finished``'s, but credits.
REPORT_ARGS: Final[ArgSpec] = {
    name: kind for name, kind in OPS["worker.finished"].items() if name != "credits"
}
_REPORT_NAMES: Final = frozenset(REPORT_ARGS)


def check_report(report: dict[str, Any], where: str) -> None:
    """Check one report of ``worker.finished_many`` as ``worker.finished``'s args are checked;
    :class:`BadArgs` naming ``where.field`` (``where``: ``reports[i]``) otherwise."""
    _check_args(REPORT_ARGS, _REPORT_NAMES, report, None, "a report", f"{where}.")


def _check_args(
    spec: ArgSpec,
    names: frozenset[str],
    args: dict[Any, Any],
    request_id: int | None,
    what: str,
    where: str = "",
) -> None:
    """Unknown, missing and mistyped arguments of ``args`` against ``spec`` (``names``: its
    keys), as :class:`BadArgs` naming ``where`` + the argument."""
    if not args.keys() <= names:
        for name in args:
            if name not in spec:
                raise _bad(
                    request_id, f"{where}{name}", f"unknown argument {str(name)[:64]!r} for {what}"
                )
    for name, (types, required) in spec.items():
        if name not in args:
            if required:
                raise _bad(request_id, f"{where}{name}", "is required")
            continue
        value = args[name]
        if isinstance(value, bool) and bool not in types:
            raise _bad(request_id, f"{where}{name}", f"must be {_names(types)}, got a boolean")
        if not isinstance(value, types):
            raise _bad(
                request_id,
                f"{where}{name}",
                f"must be {_names(types)}, got {type(value).__name__}",
            )


class BadArgs(ProtocolError):
    """``bad_args`` naming the argument at fault."""

    def __init__(self, message: str, request_id: int | None, field: str) -> None:
        super().__init__("bad_args", message, request_id)
        self.field = field


class WorkerIdInUse(BadArgs):
    """``worker_id_in_use``: a hello naming the worker id of another live worker process."""

    def __init__(self, message: str, request_id: int | None, field: str) -> None:
        super().__init__(message, request_id, field)
        self.code = "worker_id_in_use"


def _bad(request_id: int | None, field: str, message: str) -> BadArgs:
    return BadArgs(f"{field}: {message}", request_id, str(field)[:64])


def _names(types: tuple[type, ...]) -> str:
    words = {
        str: "a string",
        int: "an integer",
        bool: "a boolean",
        dict: "a map",
        list: "a list",
        bytes: "bytes",
        type(None): "null",
    }
    return " or ".join(words.get(t, t.__name__) for t in types)


def ok(request_id: int, result: Any) -> Message:
    return {"id": request_id, "ok": True, "result": result}


#: The most characters of an error's ``message`` and ``field`` a reply carries. Both may echo
#: what the peer sent (an unknown key, a bad value): whatever a request held, its error must
#: stay far below the frame limit, or the peer's decoder drops the reply and its caller waits
#: out a timeout instead of reading the error (found by review: an unknown schedule key of 3 MB
#: came back three times over, 9 MB, in one error).
MAX_ERROR_MESSAGE: Final = 1000
MAX_ERROR_FIELD: Final = 200


def clipped(text: str, most: int = MAX_ERROR_MESSAGE) -> str:
    """``text``, cut to ``most`` characters and saying how many more there were."""
    if len(text) <= most:
        return text
    return f"{text[:most]}... ({len(text) - most:,} more characters)"


def error_body(code: str, message: str, field: str | None = None) -> dict[str, Any]:
    """An error's ``{"code", "message", "field"}``, message and field cut to their bounds."""
    return {
        "code": code,
        "message": clipped(message, MAX_ERROR_MESSAGE),
        "field": None if field is None else clipped(field, MAX_ERROR_FIELD),
    }


def error(request_id: int | None, code: str, message: str, field: str | None = None) -> Message:
    return {"id": request_id, "ok": False, "error": error_body(code, message, field)}


def push(kind: str, **fields: Any) -> Message:
    return {"push": kind, **fields}
