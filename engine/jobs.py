"""Job specs: validate and normalize what clients submit; intern the policies jobs share.

Owns the job spec's fields, their defaults and limits (the ``MAX_*`` constants below), the
normalized wire/storage form (:meth:`JobSpec.to_dict`), partial updates, time-sortable job ids,
the retry backoff rule, and the :class:`PolicyTable` that maps the decision-relevant fields many
jobs share to a small integer. Must never do I/O, read a clock or draw random numbers: ``now_ms``
and id entropy are passed in, so every node validates a spec to the same result. Bad input raises
:class:`~engine.errors.JobSpecError` (or the schedule's :class:`~engine.errors.ScheduleError`),
both :class:`~engine.errors.EngineUsageError`, naming the field; nothing half-built escapes.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from msgpack import ExtType

from engine.errors import EngineUsageError, JobSpecError, PolicyRecordError, ScheduleError
from engine.memo import remember
from engine.schedules import Schedule, format_duration, parse_duration, parse_schedule

__all__ = [
    "CATCHUP_POLICIES",
    "DELIVERIES",
    "JOB_KEYS",
    "MAX_AFTER",
    "MAX_CATCHUP_LIMIT",
    "MAX_ID_LEN",
    "MAX_LABELS",
    "MAX_LABEL_KEY_LEN",
    "MAX_LABEL_VALUE_LEN",
    "MAX_PAYLOAD_DEPTH",
    "MAX_RETRIES",
    "MAX_RETRY_FACTOR",
    "MAX_TASK_BYTES",
    "MAX_TIER_LEN",
    "MAX_TIMEOUT_RETRIES",
    "MIN_ID_ENTROPY_BYTES",
    "ON_TIMEOUT_KINDS",
    "OVERLAP_POLICIES",
    "POLICY_KEYS",
    "TASK_KINDS",
    "JobSpec",
    "Policy",
    "PolicyTable",
    "apply_update",
    "new_job_id",
    "parse_policy",
    "retry_delay_ms",
    "validate_job",
    "validate_job_id",
]

# --------------------------------------------------------------------------------------------
# Limits and defaults (cited by the docs; changing one changes what clients may submit)

MAX_ID_LEN: Final = 200
MAX_TIER_LEN: Final = 64
MAX_TASK_BYTES: Final = 256 * 1024  # msgpack-encoded size of the normalized task
MAX_PAYLOAD_DEPTH: Final = 32  # nested lists/dicts in a payload; a scalar has depth 0
MAX_RETRIES: Final = 100
MAX_TIMEOUT_RETRIES: Final = 100  # the N of on_timeout "retry:N"
MAX_RETRY_FACTOR: Final = 100.0
MAX_AFTER: Final = 32
MAX_LABELS: Final = 64
MAX_LABEL_KEY_LEN: Final = 63
MAX_LABEL_VALUE_LEN: Final = 256
MAX_CATCHUP_LIMIT: Final = 10_000  # the largest max_catchup
MIN_ID_ENTROPY_BYTES: Final = 10

DEFAULT_TIER: Final = "default"
DEFAULT_RETRY_BACKOFF_MS: Final = 10_000
DEFAULT_RETRY_FACTOR: Final = 2.0
DEFAULT_RETRY_MAX_BACKOFF_MS: Final = 3_600_000
DEFAULT_CATCHUP_WINDOW_MS: Final = 86_400_000
DEFAULT_MAX_CATCHUP: Final = 100

# The first entry of each tuple is the default.
DELIVERIES: Final = ("at_least_once", "at_most_once")
CATCHUP_POLICIES: Final = ("latest", "all", "skip")
OVERLAP_POLICIES: Final = ("allow", "skip", "buffer_one", "cancel_previous")
ON_TIMEOUT_KINDS: Final = ("kill", "mark", "retry", "trigger")
TASK_KINDS: Final = ("command", "shell", "container", "payload")

POLICY_KEYS: Final = (
    "tier",
    "timeout",
    "on_timeout",
    "delivery",
    "retries",
    "catchup",
    "catchup_window",
    "max_catchup",
    "overlap",
)
JOB_KEYS: Final = ("id", "schedule", "task", *POLICY_KEYS, "after", "paused", "labels", "replace")
_JOB_KEY_SET: Final = frozenset(JOB_KEYS)
_POLICY_KEY_SET: Final = frozenset(POLICY_KEYS)
_RETRY_KEYS: Final = ("max", "backoff", "factor", "max_backoff")
_TASK_KEYS: Final = frozenset({*TASK_KINDS, "env", "cwd"})
_CONTAINER_KEYS: Final = ("image", "args")

_ID_RE: Final = re.compile(r"[A-Za-z0-9._:-]+")
_TIER_RE: Final = re.compile(r"[A-Za-z0-9._-]+")
_LABEL_KEY_RE: Final = re.compile(r"[A-Za-z0-9._/-]+")
_RETRY_N_RE: Final = re.compile(r"[0-9]{1,4}")
_IMAGE_BAD_RE: Final = re.compile(r"[\s\x00-\x1f\x7f]")
# A key shown inside a field name is cut here, so a hostile key cannot bloat the error.
_MAX_KEY_IN_FIELD: Final = 64

_INT_MIN: Final = -(2**63)
_UINT_MAX: Final = 2**64 - 1

_CROCKFORD: Final = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # ascending ASCII: text order = value order
_MAX_ID_MS: Final = 2**48 - 1


# --------------------------------------------------------------------------------------------
# Small validators


def _sub(parent: str, key: object) -> str:
    text = key if isinstance(key, str) else repr(key)
    if len(text) > _MAX_KEY_IN_FIELD:
        text = text[:_MAX_KEY_IN_FIELD] + "..."
    return f"{parent}.{text}" if parent else text


def _kind(value: object) -> str:
    return type(value).__name__


def _int(value: object, field: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise JobSpecError(f"must be an integer in {lo}..{hi}, got {_kind(value)}", field=field)
    if not lo <= value <= hi:
        raise JobSpecError(f"must be an integer in {lo}..{hi}, got {value}", field=field)
    return int(value)


def _bool(spec: Mapping[str, object], key: str) -> bool:
    value = spec.get(key, False)
    if not isinstance(value, bool):
        raise JobSpecError(f"must be true or false, got {_kind(value)}", field=key)
    return value


def _choice(value: object, field: str, options: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in options:
        shown = repr(value) if isinstance(value, str | int | float | None) else _kind(value)
        raise JobSpecError(
            f"must be one of {', '.join(repr(o) for o in options)}, got {shown}", field=field
        )
    return value


def _text(value: object, field: str, *, what: str = "a string", nul: bool = True) -> str:
    """A str that msgpack can encode (no lone surrogates) and, unless ``nul``, without NUL."""
    if not isinstance(value, str):
        raise JobSpecError(f"must be {what}, got {_kind(value)}", field=field)
    if len(value) > MAX_TASK_BYTES:
        raise JobSpecError(f"longer than {MAX_TASK_BYTES} characters", field=field)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise JobSpecError("is not valid Unicode (a lone surrogate)", field=field) from None
    if not nul and "\x00" in value:
        # execve and environ cannot carry NUL: refuse at submit time, not at fire time.
        raise JobSpecError("must not contain a NUL character", field=field)
    return value


def _is_list(value: object) -> bool:
    return isinstance(value, list | tuple)


def _job_id_problem(value: object) -> str | None:
    if not isinstance(value, str):
        return f"must be a job id string, got {_kind(value)}"
    if not 1 <= len(value) <= MAX_ID_LEN or not _ID_RE.fullmatch(value):
        shown = value if len(value) <= _MAX_KEY_IN_FIELD else value[:_MAX_KEY_IN_FIELD] + "..."
        return f"job ids are 1-{MAX_ID_LEN} characters of A-Za-z0-9._:- , got {shown!r}"
    return None


def validate_job_id(value: object, field: str = "id") -> str:
    """Return ``value`` if it is a valid job id: 1-200 characters of ``A-Za-z0-9._:-``.

    Raises :class:`JobSpecError` with ``field`` otherwise. O(len(value)).
    """
    problem = _job_id_problem(value)
    if problem is not None:
        raise JobSpecError(problem, field=field)
    assert isinstance(value, str)
    return value


def new_job_id(now_ms: object, entropy: object) -> str:
    """A time-sortable job id in the ULID layout: 26 Crockford base32 characters.

    The first 48 bits are ``now_ms``, the next 80 bits the first 10 bytes of ``entropy``
    (the caller draws them; this function has no randomness of its own, so the same inputs give
    the same id). Ids of increasing ``now_ms`` sort in increasing text order; ids of one
    millisecond sort by their entropy. Every result passes :func:`validate_job_id`. Raises
    :class:`JobSpecError` (field ``now_ms``) unless ``0 <= now_ms < 2**48``, and (field
    ``entropy``) for fewer than :data:`MIN_ID_ENTROPY_BYTES` bytes.
    """
    if isinstance(now_ms, bool) or not isinstance(now_ms, int) or not 0 <= now_ms <= _MAX_ID_MS:
        raise JobSpecError(f"must be an integer in 0..{_MAX_ID_MS}, got {now_ms!r}", field="now_ms")
    if not isinstance(entropy, bytes | bytearray | memoryview):
        raise JobSpecError(f"must be bytes, got {_kind(entropy)}", field="entropy")
    raw = bytes(entropy)
    if len(raw) < MIN_ID_ENTROPY_BYTES:
        raise JobSpecError(
            f"needs at least {MIN_ID_ENTROPY_BYTES} bytes, got {len(raw)}", field="entropy"
        )
    value = (now_ms << 80) | int.from_bytes(raw[:MIN_ID_ENTROPY_BYTES], "big")
    chars = [_CROCKFORD[(value >> shift) & 31] for shift in range(125, -1, -5)]
    return "".join(chars)


# --------------------------------------------------------------------------------------------
# Tasks


def _str_header(n: int) -> int:
    return 1 if n < 32 else 2 if n < 256 else 3 if n < 65_536 else 5


def _bin_header(n: int) -> int:
    return 2 if n < 256 else 3 if n < 65_536 else 5


def _container_header(n: int) -> int:
    return 1 if n < 16 else 3 if n < 65_536 else 5


def _int_size(v: int) -> int:
    if -32 <= v <= 127:
        return 1
    if v > 0:
        return 2 if v <= 0xFF else 3 if v <= 0xFFFF else 5 if v <= 0xFFFF_FFFF else 9
    return 2 if v >= -(2**7) else 3 if v >= -(2**15) else 5 if v >= -(2**31) else 9


def _packed_size(value: object) -> int:
    """The exact msgpack size (``use_bin_type=True``) of a normalized value."""
    if value is None or isinstance(value, bool):
        return 1
    if isinstance(value, int):
        return _int_size(value)
    if isinstance(value, float):
        return 9
    if isinstance(value, str):
        n = len(value.encode("utf-8"))
        return _str_header(n) + n
    if isinstance(value, bytes):
        return _bin_header(len(value)) + len(value)
    if isinstance(value, list):
        return _container_header(len(value)) + sum(_packed_size(v) for v in value)
    assert isinstance(value, dict)
    return _container_header(len(value)) + sum(
        _packed_size(k) + _packed_size(v) for k, v in value.items()
    )


class _Budget:
    """Bytes left for a payload; stops the walk of an oversized one early."""

    __slots__ = ("left",)

    def __init__(self, left: int) -> None:
        self.left = left

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise JobSpecError(
                f"the task is larger than {MAX_TASK_BYTES} bytes (256 KiB) encoded", field="task"
            )


def _payload(value: object, field: str, depth: int, budget: _Budget) -> object:
    """Validate a msgpack-able value and return a fresh copy (tuples -> lists, buffers -> bytes)."""
    if value is None or isinstance(value, bool):
        budget.spend(1)
        return value
    if isinstance(value, int):
        if not _INT_MIN <= value <= _UINT_MAX:
            raise JobSpecError(
                "integers must fit in 64 bits (-2**63 .. 2**64-1) to be encodable", field=field
            )
        budget.spend(_int_size(value))
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            # Neither JSON nor equality-based round trips cope with NaN or infinities.
            raise JobSpecError(f"floats must be finite, got {value!r}", field=field)
        budget.spend(9)
        return value
    if isinstance(value, str):
        budget.spend(len(value))  # a lower bound on the UTF-8 size, before encoding it
        try:
            n = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise JobSpecError("is not valid Unicode (a lone surrogate)", field=field) from None
        budget.spend(_str_header(n) + n - len(value))
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        size = value.nbytes if isinstance(value, memoryview) else len(value)
        budget.spend(_bin_header(size) + size)
        return bytes(value)
    if isinstance(value, ExtType):
        # (A named tuple: it was stored as the list [code, data], a value the client never
        # sent; found by review.)
        raise JobSpecError(
            f"must not hold a msgpack ext value (type {value.code}): use bin or a map",
            field=field,
        )
    if isinstance(value, list | tuple | dict):
        if depth >= MAX_PAYLOAD_DEPTH:
            raise JobSpecError(
                f"nested deeper than {MAX_PAYLOAD_DEPTH} lists and objects", field=field
            )
        budget.spend(_container_header(len(value)))
        if isinstance(value, dict):
            out: dict[str, object] = {}
            for key, item in value.items():
                if not isinstance(key, str):
                    raise JobSpecError(
                        f"object keys must be strings, got {_kind(key)}", field=field
                    )
                sub = _sub(field, key)
                _payload(key, sub, depth, budget)
                out[key] = _payload(item, sub, depth + 1, budget)
            return out
        return [_payload(item, f"{field}[{i}]", depth + 1, budget) for i, item in enumerate(value)]
    raise JobSpecError(
        f"must be null, a boolean, an integer, a float, a string, bytes, a list or an object "
        f"with string keys, got {_kind(value)}",
        field=field,
    )


class _Slow(Exception):
    """The fast payload walk met something it leaves to :func:`_payload` (which either accepts
    it or raises the typed error, with its field name)."""


_SLOW: Final = _Slow()


def _str_size(value: str) -> int:
    """The msgpack size of ``value``; :class:`_Slow` for a lone surrogate."""
    if value.isascii():
        n = len(value)
    else:
        try:
            n = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise _SLOW from None
    return n + (1 if n < 32 else 2 if n < 256 else 3 if n < 65_536 else 5)


def _fast_payload(value: object, depth: int) -> tuple[object, int]:
    """:func:`_payload` for the usual payload, built of exact dicts, lists, str, int, float,
    bool, None and bytes: the same copy and its exact msgpack size, without making a field
    name per key and item (most of :func:`_payload`'s cost) and without a budget object.
    Raises :class:`_Slow` for anything else (tuples, buffers, subclasses, a non-str key) and
    for anything :func:`_payload` would refuse (too deep, too large, not encodable): the
    caller then walks the value again with :func:`_payload`, which accepts it or raises the
    error a client sees. So the fast walk only ever accepts what the slow one accepts, and
    returns what it would return."""
    t = type(value)
    if t is str:
        return value, _str_size(value)  # type: ignore[arg-type]
    if t is int:
        if not _INT_MIN <= value <= _UINT_MAX:  # type: ignore[operator]
            raise _SLOW
        return value, _int_size(value)  # type: ignore[arg-type]
    if value is None or t is bool:
        return value, 1
    if t is float:
        if not math.isfinite(value):  # type: ignore[arg-type]
            raise _SLOW
        return value, 9
    if t is bytes:
        n = len(value)  # type: ignore[arg-type]
        return value, (2 if n < 256 else 3 if n < 65_536 else 5) + n
    if t is dict:
        if depth >= MAX_PAYLOAD_DEPTH:
            raise _SLOW
        items = value.items()  # type: ignore[attr-defined]
        n = len(items)
        if n > MAX_TASK_BYTES:
            raise _SLOW
        size = 1 if n < 16 else 3 if n < 65_536 else 5
        out: dict[str, object] = {}
        for key, item in items:
            if type(key) is not str:
                raise _SLOW
            size += _str_size(key)
            copied, used = _fast_payload(item, depth + 1)
            out[key] = copied
            size += used
            if size > MAX_TASK_BYTES:
                raise _SLOW
        return out, size
    if t is list:
        if depth >= MAX_PAYLOAD_DEPTH:
            raise _SLOW
        n = len(value)  # type: ignore[arg-type]
        if n > MAX_TASK_BYTES:
            raise _SLOW
        size = 1 if n < 16 else 3 if n < 65_536 else 5
        copy_: list[object] = []
        for item in value:  # type: ignore[attr-defined]
            copied, used = _fast_payload(item, depth + 1)
            copy_.append(copied)
            size += used
            if size > MAX_TASK_BYTES:
                raise _SLOW
        return copy_, size
    raise _SLOW


def _argv(value: object, field: str, *, non_empty: bool) -> list[str]:
    if not _is_list(value):
        raise JobSpecError(f"must be a list of strings, got {_kind(value)}", field=field)
    assert isinstance(value, list | tuple)
    if non_empty and not value:
        raise JobSpecError("must be a non-empty list of strings (the program first)", field=field)
    if len(value) > MAX_TASK_BYTES:
        raise JobSpecError(f"the task is larger than {MAX_TASK_BYTES} bytes", field="task")
    return [_text(a, f"{field}[{i}]", nul=False) for i, a in enumerate(value)]


def _env(value: object) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise JobSpecError(
            f"must be an object of string names to string values, got {_kind(value)}",
            field="task.env",
        )
    if len(value) > MAX_TASK_BYTES:
        raise JobSpecError(f"the task is larger than {MAX_TASK_BYTES} bytes", field="task")
    out: dict[str, str] = {}
    for name, text in value.items():
        sub = _sub("task.env", name)
        _text(name, sub, what="a string variable name", nul=False)
        assert isinstance(name, str)
        if not name or "=" in name:
            raise JobSpecError("variable names must be non-empty and contain no '='", field=sub)
        out[name] = _text(text, sub, nul=False)
    return out


def _object(value: object, field: str, what: str, known: Iterable[str]) -> Mapping[str, object]:
    """``value`` as a mapping whose keys are all in ``known``; else a JobSpecError naming
    ``field`` (not a mapping) or the first unknown key under it."""
    if not isinstance(value, Mapping):
        raise JobSpecError(f"must be an object with {what}, got {_kind(value)}", field=field)
    known = tuple(known)
    for key in value:
        if key not in known:
            raise JobSpecError(
                f"unknown key {key!r}; known keys: {', '.join(known)}", field=_sub(field, key)
            )
    return value


_TASK_WHAT: Final = f"one of {', '.join(TASK_KINDS)}"
_TASK_KEYS_SORTED: Final = tuple(sorted(_TASK_KEYS))
#: {"payload": ...} around a payload: a one-entry map header and the 8-byte key.
_PAYLOAD_WRAP_BYTES: Final = 1 + _packed_size("payload")


def _parse_task(value: object) -> dict[str, object]:
    if type(value) is dict and len(value) == 1 and "payload" in value:
        # The commonest task (a payload alone), walked without field names; anything the
        # fast walk leaves (see _fast_payload) takes the general path below.
        try:
            payload, size = _fast_payload(value["payload"], 0)
        except _Slow:
            pass
        else:
            if size + _PAYLOAD_WRAP_BYTES <= MAX_TASK_BYTES:
                return {"payload": payload}
    value = _object(value, "task", _TASK_WHAT, _TASK_KEYS_SORTED)
    kinds = [k for k in TASK_KINDS if k in value]
    if not kinds:
        raise JobSpecError(f"one of {', '.join(TASK_KINDS)} is required", field="task")
    if len(kinds) > 1:
        raise JobSpecError(
            f"give exactly one of {', '.join(TASK_KINDS)}; got {' and '.join(kinds)}",
            field=f"task.{kinds[1]}",
        )
    kind = kinds[0]
    task: dict[str, object]
    if kind == "payload":
        for key in ("env", "cwd"):
            if key in value:
                raise JobSpecError(
                    "applies only to command, shell and container tasks", field=f"task.{key}"
                )
        budget = _Budget(MAX_TASK_BYTES)
        task = {"payload": _payload(value["payload"], "task.payload", 0, budget)}
        # The walk spent exactly the payload's encoded size; add {"payload": ...} around it
        # (a one-entry map header and the 8-byte key) instead of walking it a second time.
        size = _PAYLOAD_WRAP_BYTES + MAX_TASK_BYTES - budget.left
        if size > MAX_TASK_BYTES:
            raise JobSpecError(
                f"the task is {size} bytes encoded; the limit is {MAX_TASK_BYTES} (256 KiB)",
                field="task",
            )
        return task
    elif kind == "command":
        argv = _argv(value["command"], "task.command", non_empty=True)
        if not argv[0]:
            raise JobSpecError("the program must be a non-empty string", field="task.command[0]")
        task = {"command": argv}
    elif kind == "shell":
        script = _text(value["shell"], "task.shell", nul=False)
        if not script.strip():
            raise JobSpecError("must be a non-empty shell script", field="task.shell")
        task = {"shell": script}
    else:
        box = _object(
            value["container"], "task.container", "image and optional args", _CONTAINER_KEYS
        )
        if "image" not in box:
            raise JobSpecError("is required", field="task.container.image")
        image = _text(box["image"], "task.container.image")
        if not image or _IMAGE_BAD_RE.search(image):
            raise JobSpecError(
                f"must be a non-empty image reference without spaces, got {image[:80]!r}",
                field="task.container.image",
            )
        args = _argv(box.get("args", []), "task.container.args", non_empty=False)
        task = {"container": {"image": image, "args": args}}
    if kind != "payload":
        if "env" in value:
            env = _env(value["env"])
            if env:  # an empty env is the same as none: keep one canonical form
                task["env"] = env
        if "cwd" in value:
            cwd = _text(value["cwd"], "task.cwd", nul=False)
            if not cwd:
                raise JobSpecError("must be a non-empty directory path", field="task.cwd")
            task["cwd"] = cwd
    size = _packed_size(task)
    if size > MAX_TASK_BYTES:
        raise JobSpecError(
            f"the task is {size} bytes encoded; the limit is {MAX_TASK_BYTES} (256 KiB)",
            field="task",
        )
    return task


# --------------------------------------------------------------------------------------------
# Policies


@dataclass(frozen=True, slots=True)
class Policy:
    """The decision-relevant fields of a job, shared by many jobs and interned by number.

    Immutable and hashable. Build it with :func:`validate_job` or :func:`parse_policy`; the
    constructor itself does not validate. The defaults are those of a spec that omits every
    policy field. ``on_timeout_retries`` is N of ``retry:N`` (0 otherwise) and
    ``on_timeout_target`` the job id of ``trigger:ID`` (None otherwise).
    """

    tier: str = DEFAULT_TIER
    delivery: str = "at_least_once"
    timeout_ms: int | None = None
    on_timeout: str = "kill"
    on_timeout_retries: int = 0
    on_timeout_target: str | None = None
    retries_max: int = 0
    retry_backoff_ms: int = DEFAULT_RETRY_BACKOFF_MS
    retry_factor: float = DEFAULT_RETRY_FACTOR
    retry_max_backoff_ms: int = DEFAULT_RETRY_MAX_BACKOFF_MS
    catchup: str = "latest"
    catchup_window_ms: int = DEFAULT_CATCHUP_WINDOW_MS
    max_catchup: int = DEFAULT_MAX_CATCHUP
    overlap: str = "allow"

    def on_timeout_text(self) -> str:
        """The spec form of the timeout handler: ``kill``, ``mark``, ``retry:N``, ``trigger:ID``."""
        if self.on_timeout == "retry":
            return f"retry:{self.on_timeout_retries}"
        if self.on_timeout == "trigger":
            return f"trigger:{self.on_timeout_target}"
        return self.on_timeout

    def to_dict(self) -> dict[str, object]:
        """The policy keys of a spec, every one present, durations canonical (msgpack-able).

        ``parse_policy(p.to_dict()) == p`` for every validated ``p``. A fresh dict each call;
        the rendering is cached per distinct policy (formatting durations is most of a create's
        cost otherwise, and a shard has few distinct policies).
        """
        cached = _POLICY_DICTS.get(self)
        if cached is None:
            cached = remember(_POLICY_DICTS, self, self._render(), _POLICY_DICT_CACHE)
        out = dict(cached)
        out["retries"] = dict(cached["retries"])  # type: ignore[call-overload]
        return out

    def spec_template(self) -> dict[str, object]:
        """A fresh dict with every key of a stored spec in its order (:meth:`JobSpec.to_dict`):
        this policy's keys as :meth:`to_dict` renders them, the job's own keys None."""
        last = _LAST_TEMPLATE[0]
        if last[0] is self:
            template = last[1]
        else:
            template = {"id": None, "schedule": None, "task": None}
            template.update(self.to_dict())
            template.update(after=None, paused=None, labels=None, replace=None)
            _LAST_TEMPLATE[0] = (self, template)
        out = template.copy()
        out["retries"] = dict(template["retries"])  # type: ignore[call-overload]
        return out

    def _render(self) -> dict[str, object]:
        return {
            "tier": self.tier,
            "timeout": None if self.timeout_ms is None else format_duration(self.timeout_ms),
            "on_timeout": self.on_timeout_text(),
            "delivery": self.delivery,
            "retries": {
                "max": self.retries_max,
                "backoff": format_duration(self.retry_backoff_ms),
                "factor": self.retry_factor,
                "max_backoff": format_duration(self.retry_max_backoff_ms),
            },
            "catchup": self.catchup,
            "catchup_window": format_duration(self.catchup_window_ms),
            "max_catchup": self.max_catchup,
            "overlap": self.overlap,
        }


#: Rendered policies (see :meth:`Policy.to_dict`), cleared when it reaches its bound: sized
#: for the ~10,000 distinct policies of the large simulation, which a snapshot export renders
#: each time (at most ~16 MB: an entry is about a kilobyte). The parsed policies below share it.
_POLICY_DICTS: dict[Policy, dict[str, object]] = {}
_POLICY_DICT_CACHE: Final = 1 << 14
#: The policy whose spec template (:meth:`Policy.spec_template`) was made last, and it.
_LAST_TEMPLATE: list[tuple[Policy | None, dict[str, object]]] = [(None, {})]


def _duration(value: object, field: str) -> int:
    return parse_duration(value, field=field, error=JobSpecError)


def _parse_on_timeout(value: object) -> tuple[str, int, str | None]:
    if isinstance(value, str):
        if value in ("kill", "mark"):
            return value, 0, None
        kind, sep, arg = value.partition(":")
        if kind == "retry" and sep:
            if not _RETRY_N_RE.fullmatch(arg) or not 1 <= int(arg) <= MAX_TIMEOUT_RETRIES:
                raise JobSpecError(
                    f"retry:N needs an integer N in 1..{MAX_TIMEOUT_RETRIES}, got {arg[:20]!r}",
                    field="on_timeout",
                )
            return "retry", int(arg), None
        if kind == "trigger" and sep:
            problem = _job_id_problem(arg)
            if problem is not None:
                raise JobSpecError(f"trigger target: {problem}", field="on_timeout")
            return "trigger", 0, arg
    shown = repr(value[:80]) if isinstance(value, str) else _kind(value)
    raise JobSpecError(
        f"must be 'kill', 'mark', 'retry:N' (N in 1..{MAX_TIMEOUT_RETRIES}) or "
        f"'trigger:JOB_ID', got {shown}",
        field="on_timeout",
    )


def _parse_retries(value: object) -> tuple[int, int, float, int]:
    value = _object(value, "retries", "max, backoff, factor, max_backoff", _RETRY_KEYS)
    count = _int(value.get("max", 0), "retries.max", 0, MAX_RETRIES)
    backoff = (
        _duration(value["backoff"], "retries.backoff")
        if "backoff" in value
        else DEFAULT_RETRY_BACKOFF_MS
    )
    factor = value.get("factor", DEFAULT_RETRY_FACTOR)
    if (
        isinstance(factor, bool)
        or not isinstance(factor, int | float)
        or not 1.0 <= factor <= MAX_RETRY_FACTOR  # also refuses NaN
    ):
        shown = factor if isinstance(factor, int | float) else _kind(factor)
        raise JobSpecError(
            f"must be a number in 1..{MAX_RETRY_FACTOR:g}, got {shown}", field="retries.factor"
        )
    if "max_backoff" in value:
        cap = _duration(value["max_backoff"], "retries.max_backoff")
        if cap < backoff:
            raise JobSpecError(
                f"max_backoff {format_duration(cap)} is below backoff {format_duration(backoff)}",
                field="retries.max_backoff",
            )
    else:
        # A long backoff with the default cap would be an error on a field nobody wrote.
        cap = max(DEFAULT_RETRY_MAX_BACKOFF_MS, backoff)
    return count, backoff, float(factor), cap


def _parse_policy(spec: Mapping[str, object]) -> Policy:
    """The policy fields of ``spec`` (other keys ignored), defaults filled in."""
    tier = spec.get("tier", DEFAULT_TIER)
    if (
        not isinstance(tier, str)
        or not 1 <= len(tier) <= MAX_TIER_LEN
        or not _TIER_RE.fullmatch(tier)
    ):
        shown = repr(tier[:80]) if isinstance(tier, str) else _kind(tier)
        raise JobSpecError(
            f"must be 1-{MAX_TIER_LEN} characters of A-Za-z0-9._- , got {shown}", field="tier"
        )
    raw_timeout = spec.get("timeout")
    timeout = None if raw_timeout is None else _duration(raw_timeout, "timeout")
    on_timeout, on_timeout_retries, target = _parse_on_timeout(spec.get("on_timeout", "kill"))
    delivery = _choice(spec.get("delivery", DELIVERIES[0]), "delivery", DELIVERIES)
    retries = _parse_retries(spec.get("retries", {}))
    catchup = _choice(spec.get("catchup", CATCHUP_POLICIES[0]), "catchup", CATCHUP_POLICIES)
    window = (
        _duration(spec["catchup_window"], "catchup_window")
        if "catchup_window" in spec
        else DEFAULT_CATCHUP_WINDOW_MS
    )
    max_catchup = _int(
        spec.get("max_catchup", DEFAULT_MAX_CATCHUP), "max_catchup", 1, MAX_CATCHUP_LIMIT
    )
    overlap = _choice(spec.get("overlap", OVERLAP_POLICIES[0]), "overlap", OVERLAP_POLICIES)
    return Policy(
        tier=tier,
        delivery=delivery,
        timeout_ms=timeout,
        on_timeout=on_timeout,
        on_timeout_retries=on_timeout_retries,
        on_timeout_target=target,
        retries_max=retries[0],
        retry_backoff_ms=retries[1],
        retry_factor=retries[2],
        retry_max_backoff_ms=retries[3],
        catchup=catchup,
        catchup_window_ms=window,
        max_catchup=max_catchup,
        overlap=overlap,
    )


#: Validated policies by the raw values they came from: a node sees few distinct policies,
#: and parsing one (durations, choices, retries) is a fifth of validating a spec.
_PARSED_POLICIES: dict[tuple[object, ...], Policy] = {}


def _policy_key_part(value: object) -> object:
    # The type goes into the key: True == 1 == 1.0 as dict keys, but not as policy values.
    if value is None or type(value) in (str, int, float, bool):
        return (type(value), value)
    return (type(value), repr(value))  # a retries object: compared by its text


def _parse_policy_cached(spec: Mapping[str, object]) -> Policy:
    """:func:`_parse_policy`, kept per distinct raw policy values (errors are not kept)."""
    if _POLICY_KEY_SET.isdisjoint(spec):  # most specs: every policy field its default
        key: tuple[object, ...] = ()
    else:
        key = tuple((k, _policy_key_part(spec[k])) for k in POLICY_KEYS if k in spec)
    policy = _PARSED_POLICIES.get(key)
    if policy is None:
        policy = remember(_PARSED_POLICIES, key, _parse_policy(spec), _POLICY_DICT_CACHE)
    return policy


def stored_policy(spec: Mapping[str, object]) -> tuple[Policy, tuple[str, ...]]:
    """The policy and ``after`` of a stored spec (one :meth:`JobSpec.to_dict` wrote, so
    valid): what a replay needs, without walking the task, labels and schedule again.
    Raises :class:`JobSpecError` if the policy fields are not valid after all."""
    after = spec.get("after", ())
    if not isinstance(after, list | tuple):
        raise JobSpecError(f"must be a list of job ids, got {_kind(after)}", field="after")
    return _parse_policy_cached(spec), tuple(str(a) for a in after)


def parse_policy(spec: object) -> Policy:
    """Validate an object of policy keys only (:data:`POLICY_KEYS`; each optional).

    Accepts exactly what :func:`validate_job` accepts for those keys and returns the same
    :class:`Policy`. Raises :class:`JobSpecError` naming the field, including for a key that is
    not a policy key.
    """
    if not isinstance(spec, Mapping):
        raise JobSpecError(f"a policy must be an object, got {_kind(spec)}", field=None)
    for key in spec:
        if key not in _POLICY_KEY_SET:
            raise JobSpecError(
                f"unknown policy key {key!r}; known keys: {', '.join(POLICY_KEYS)}",
                field=_sub("", key),
            )
    return _parse_policy(spec)


def retry_delay_ms(policy: Policy, attempt: object) -> int:
    """The backoff before retry number ``attempt`` (the first retry is 1), in whole ms.

    ``min(backoff * factor ** (attempt - 1), max_backoff)``, rounded to the nearest ms; no
    jitter, so every node computes the same delay. Never below ``retry_backoff_ms`` when the
    policy is valid; huge attempts saturate at ``retry_max_backoff_ms`` instead of overflowing.
    Raises :class:`JobSpecError` (field ``attempt``) unless ``attempt`` is an integer >= 1.
    """
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise JobSpecError(f"must be an integer >= 1, got {attempt!r}", field="attempt")
    cap = policy.retry_max_backoff_ms
    try:
        raw = policy.retry_backoff_ms * policy.retry_factor ** (attempt - 1)
    except OverflowError:
        return cap
    return cap if raw >= cap else round(raw)


class PolicyTable:
    """Interns :class:`Policy` values to dense small ints: 0, 1, 2... in first-seen order.

    Equal policies get the same id; ids never change or get reused, so they can be stored in
    per-job columns and persisted with :meth:`to_list` / :meth:`from_list`. :meth:`intern` and
    :meth:`get` are O(1). Not thread-safe.
    """

    __slots__ = ("_ids", "_policies")

    def __init__(self) -> None:
        self._ids: dict[Policy, int] = {}
        self._policies: list[Policy] = []

    def intern(self, policy: object) -> int:
        """The id of ``policy``, assigning the next one if it is new."""
        if not isinstance(policy, Policy):
            raise EngineUsageError(f"must be a Policy, got {_kind(policy)}", field="policy")
        pid = self._ids.get(policy)
        if pid is None:
            pid = len(self._policies)
            self._policies.append(policy)
            self._ids[policy] = pid
        return pid

    def get(self, pid: object) -> Policy:
        """The policy with id ``pid``; raises :class:`PolicyRecordError` for an unknown id."""
        if isinstance(pid, int) and not isinstance(pid, bool) and 0 <= pid < len(self._policies):
            return self._policies[pid]
        raise PolicyRecordError(
            f"no policy with id {pid!r}; the table holds {len(self._policies)}", field="policy_id"
        )

    def __len__(self) -> int:
        return len(self._policies)

    def to_list(self) -> list[dict[str, object]]:
        """Every policy's :meth:`Policy.to_dict`, in id order: msgpack- and JSON-able."""
        return [p.to_dict() for p in self._policies]

    @classmethod
    def from_list(cls, items: object) -> PolicyTable:
        """Rebuild a table from :meth:`to_list` output; ids are the list positions.

        Raises :class:`PolicyRecordError` (an engine state error: the store is inconsistent)
        naming ``policies[i].field`` for a record that does not validate, and ``policies[i]``
        for a duplicate record, which would make ids ambiguous.
        """
        if not isinstance(items, list | tuple):
            raise PolicyRecordError(f"must be a list, got {_kind(items)}", field="policies")
        table = cls()
        for i, item in enumerate(items):
            try:
                policy = parse_policy(item)
            except EngineUsageError as exc:
                where = f"policies[{i}]" + (f".{exc.field}" if exc.field else "")
                raise PolicyRecordError(exc.message, field=where) from None
            if policy in table._ids:
                raise PolicyRecordError(
                    f"duplicates policy {table._ids[policy]}", field=f"policies[{i}]"
                )
            table.intern(policy)
        return table

    def _check(self) -> None:
        """Assert the invariants: ids are dense, unique and map both ways."""
        assert len(self._ids) == len(self._policies)
        for pid, policy in enumerate(self._policies):
            assert self._ids[policy] == pid


# --------------------------------------------------------------------------------------------
# Job specs


@dataclass(frozen=True)
class JobSpec:
    """A validated, normalized job. Build it with :func:`validate_job` or :func:`apply_update`.

    Compares by value (``schedule`` by its normalized spec and jitter delay). Not hashable: the
    task is a dict, owned by this object and never to be mutated; :meth:`to_dict` hands out
    copies. ``after`` is sorted; ``labels`` is a sorted tuple of ``(key, value)`` pairs.
    """

    id: str
    schedule: Schedule
    task: dict[str, object]
    policy: Policy
    after: tuple[str, ...] = ()
    paused: bool = False
    labels: tuple[tuple[str, str], ...] = ()
    replace: bool = False

    @property
    def task_kind(self) -> str:
        """``command``, ``shell``, ``container`` or ``payload``."""
        return next(k for k in TASK_KINDS if k in self.task)

    def to_dict(self, *, copy_task: bool = True) -> dict[str, object]:
        """The normalized wire/storage form: every key present, defaults filled in.

        The schedule comes from its ``to_spec()`` (instants in UTC, an ``every`` with its
        explicit start), durations are canonical (``1h30m``), ``timeout`` is None when unset.
        ``validate_job(s.to_dict(), now_ms=t) == s`` for any ``t``. A fresh deep copy each call,
        unless ``copy_task=False``: then the task is this spec's own (for a record that is only
        encoded, never changed).
        """
        # A copy of the policy's template (every key in place, in the stored order) with
        # this job's fields set: cheaper than building the 16 keys again.
        out = self.policy.spec_template()
        out["id"] = self.id
        out["schedule"] = self.schedule.to_spec()
        out["task"] = copy.deepcopy(self.task) if copy_task else self.task
        out["after"] = list(self.after)
        out["paused"] = self.paused
        out["labels"] = dict(self.labels)
        out["replace"] = self.replace
        return out


def _parse_after(value: object, job_id: str) -> tuple[str, ...]:
    if not _is_list(value):
        raise JobSpecError(f"must be a list of job ids, got {_kind(value)}", field="after")
    assert isinstance(value, list | tuple)
    if len(value) > MAX_AFTER:
        raise JobSpecError(f"at most {MAX_AFTER} dependencies, got {len(value)}", field="after")
    seen: set[str] = set()
    for i, item in enumerate(value):
        dep = validate_job_id(item, f"after[{i}]")
        if dep == job_id:
            raise JobSpecError("a job cannot depend on itself", field=f"after[{i}]")
        if dep in seen:
            raise JobSpecError(f"duplicate dependency {dep!r}", field=f"after[{i}]")
        seen.add(dep)
    # Dependencies are a set: one canonical order makes equal specs compare equal.
    return tuple(sorted(seen))


def _parse_labels(value: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping):
        raise JobSpecError(
            f"must be an object of string keys to string values, got {_kind(value)}",
            field="labels",
        )
    if len(value) > MAX_LABELS:
        raise JobSpecError(f"at most {MAX_LABELS} labels, got {len(value)}", field="labels")
    pairs: list[tuple[str, str]] = []
    for key, text in value.items():
        if not isinstance(key, str):
            raise JobSpecError(f"label keys must be strings, got {_kind(key)}", field="labels")
        sub = _sub("labels", key)
        if not 1 <= len(key) <= MAX_LABEL_KEY_LEN or not _LABEL_KEY_RE.fullmatch(key):
            raise JobSpecError(
                f"label keys are 1-{MAX_LABEL_KEY_LEN} characters of A-Za-z0-9._/- , "
                f"got {key[:80]!r}",
                field=sub,
            )
        if not isinstance(text, str):
            raise JobSpecError(f"must be a string, got {_kind(text)}", field=sub)
        if len(text) > MAX_LABEL_VALUE_LEN:
            raise JobSpecError(
                f"label values are at most {MAX_LABEL_VALUE_LEN} characters, got {len(text)}",
                field=sub,
            )
        pairs.append((key, _text(text, sub)))
    return tuple(sorted(pairs))


def validate_job(spec: Mapping[str, object], *, now_ms: object) -> JobSpec:
    """Validate a job spec and return it normalized, with defaults filled in.

    ``spec`` has the keys of :data:`JOB_KEYS`; ``id``, ``schedule`` and ``task`` are required.
    ``now_ms`` is the creation time: the default ``start`` of an ``every`` schedule, and nothing
    else. Raises :class:`JobSpecError` for a non-object spec (field None), an unknown key (the
    key as field), a missing required key, and any invalid field (the dotted field, such as
    ``retries.max``, ``task.command[0]`` or ``labels.team``); the schedule's own errors propagate
    unchanged as :class:`ScheduleError` naming ``schedule.*``. Both are
    :class:`EngineUsageError`; no other exception escapes for any input built of dicts, lists
    and scalars. Fields are checked in :data:`JOB_KEYS` order, so the first error is stable.
    Cost: O(size of the spec), the task walk bounded by :data:`MAX_TASK_BYTES`.
    """
    if type(spec) is not dict and not isinstance(spec, Mapping):  # (an ABC check is slow)
        raise JobSpecError(f"a job spec must be an object, got {_kind(spec)}", field=None)
    if isinstance(now_ms, bool) or not isinstance(now_ms, int):
        raise JobSpecError(f"must be integer milliseconds, got {_kind(now_ms)}", field="now_ms")
    # (one C-level check for the usual spec, a dict; another Mapping's keys() may not be a set)
    if type(spec) is not dict or not spec.keys() <= _JOB_KEY_SET:
        # A key from the wire may be of any type: typed as such, so that compiled code does
        # not refuse it before the typed error below names it.
        keys: Iterable[object] = spec
        for key in keys:
            if key not in _JOB_KEY_SET:
                raise JobSpecError(
                    f"unknown key {key!r}; known keys: {', '.join(JOB_KEYS)}",
                    field=_sub("", key),
                )
    for key in ("id", "schedule", "task"):
        if key not in spec:
            raise JobSpecError("is required", field=key)
    job_id = validate_job_id(spec["id"])
    schedule = _schedule(spec["schedule"], now_ms, job_id)
    task = _parse_task(spec["task"])
    policy = _parse_policy_cached(spec)
    if policy.on_timeout_target == job_id:
        raise JobSpecError(
            "a job cannot trigger itself on timeout; use 'retry:N'", field="on_timeout"
        )
    # Absent optional fields are their defaults, without parsing a default value.
    after = _parse_after(spec["after"], job_id) if "after" in spec else ()
    paused = _bool(spec, "paused")
    labels = _parse_labels(spec["labels"]) if "labels" in spec else ()
    replace = _bool(spec, "replace")
    return JobSpec(job_id, schedule, task, policy, after, paused, labels, replace)


#: Schedules validated, by their raw text: jobs submitted together usually share one (a
#: batch of one-shots due at the same minute, a fleet of jobs on one cron rule), and parsing
#: an instant or a rule is a fifth of validating a spec. Only schedules whose result depends
#: on nothing but the spec (no jitter, which depends on the job id; no ``every`` without a
#: start, which depends on the creation time). A bound (cleared when full), not an LRU;
#: errors are not kept.
_SCHEDULES: dict[tuple[tuple[str, str], ...], Schedule] = {}
_SCHEDULE_CACHE: Final = 4096


#: Zone directories only a host's own zone files have (leap-second ``right/`` and ``posix/``
#: copies): the ``tzdata`` package, what a node without system zone files loads, has neither.
_HOST_ONLY_ZONE_DIRS: Final = ("right/", "posix/")


def _schedule(raw: object, now_ms: int, job_id: str) -> Schedule:
    """:func:`parse_schedule` of a job's schedule, kept per raw spec when it may be.

    A new version (create, update) is also refused a zone only this host's files
    have (:data:`_HOST_ONLY_ZONE_DIRS`): another node, or this one after an upgrade, might
    not load it. (Checked here, not where stored schedules are loaded: a store that already
    holds one must still recover.)"""
    if type(raw) is dict:
        tz = raw.get("tz")
        if type(tz) is str and tz.startswith(_HOST_ONLY_ZONE_DIRS):
            raise ScheduleError(
                f"{tz!r} is a zone only this host's zone files have (not the tzdata package); "
                f"use the IANA name {tz.split('/', 1)[1]!r}",
                field="schedule.tz",
            )
    if type(raw) is not dict or "jitter" in raw or ("every" in raw and "start" not in raw):
        return parse_schedule(raw, created_ms=now_ms, job_id=job_id)
    items = tuple(raw.items())
    for _key, value in items:
        if type(value) is not str:  # (a str key and value alone: the key is its text)
            return parse_schedule(raw, created_ms=now_ms, job_id=job_id)
    schedule = _SCHEDULES.get(items)
    if schedule is None:
        schedule = remember(
            _SCHEDULES,
            items,
            parse_schedule(raw, created_ms=now_ms, job_id=job_id),
            _SCHEDULE_CACHE,
        )
    return schedule


def apply_update(current: JobSpec, changes: Mapping[str, object], *, now_ms: int) -> JobSpec:
    """The job after an update: keys in ``changes`` replace those of ``current.to_dict()``.

    Replacement is per top-level key: ``{"retries": {"max": 3}}`` resets the other retry fields
    to their defaults, and a new ``every`` schedule without ``start`` starts at ``now_ms``.
    ``replace`` is a create-time flag, so it is reset to False unless ``changes`` sets it. An
    ``id`` in ``changes`` must equal ``current.id``. Raises :class:`JobSpecError` /
    :class:`ScheduleError` as :func:`validate_job` does on the merged spec; ``current`` is
    never modified.
    """
    if not isinstance(changes, Mapping):
        raise JobSpecError(f"an update must be an object, got {_kind(changes)}", field=None)
    if "id" in changes:
        new_id = changes["id"]
        if not isinstance(new_id, str) or new_id != current.id:
            shown = repr(new_id[:80]) if isinstance(new_id, str) else _kind(new_id)
            raise JobSpecError(
                f"an update cannot change the job id {current.id!r} (got {shown}); "
                "create a new job instead",
                field="id",
            )
    merged = current.to_dict()
    merged["replace"] = False
    merged.update(changes)
    return validate_job(merged, now_ms=now_ms)
