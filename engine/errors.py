"""The engine's exceptions, in one place.

Split like h11's errors: :class:`EngineUsageError` means the caller handed the engine something
invalid (a bad schedule, time going backwards) and nothing was changed; :class:`EngineStateError`
means a peer or a stored record is inconsistent with what the engine holds (a stale epoch, a
record of an unknown format). Every error carries a stable ``code`` that drivers put on the wire
and, where one input field is to blame, the dotted ``field`` name.
"""

from __future__ import annotations

from typing import ClassVar


class EngineError(Exception):
    """Root of every exception raised by ``engine``."""

    code: ClassVar[str] = "engine_error"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class EngineUsageError(EngineError, ValueError):
    """The caller passed something invalid; the engine state is unchanged."""

    code = "invalid"


class EngineStateError(EngineError):
    """A peer or a stored record disagrees with the engine (stale epoch, unknown format)."""

    code = "state"


class TimeWentBackwards(EngineUsageError):
    """A clock input was smaller than one already seen; engine time never goes backwards."""

    code = "time_backwards"


class InvalidKey(EngineUsageError):
    """A timer key is not an int in the supported range."""

    code = "invalid_key"


class InvalidDue(EngineUsageError):
    """A due time is not an int in the supported range."""

    code = "invalid_due"


class ScheduleError(EngineUsageError):
    """A schedule spec is invalid; ``field`` names the part to blame (``schedule.cron``...)."""

    code = "invalid_schedule"


class JobSpecError(EngineUsageError):
    """A job spec (or an update, or a job id) is invalid; ``field`` names the part to blame
    (``retries.max``, ``task.command[0]``, ``labels.team``...)."""

    code = "invalid_job"


class PolicyRecordError(EngineStateError):
    """A stored policy table is malformed, or a job refers to a policy id the table lacks."""

    code = "bad_policy"


class StaleEpoch(EngineStateError):
    """A command or record from an older epoch of this shard: its owner has been fenced off."""

    code = "stale_epoch"


class IllegalTransition(EngineStateError):
    """A run state change the table does not allow: a bug in the caller, or a corrupt record."""

    code = "illegal_transition"


class UnknownRecord(EngineStateError):
    """A record of a type or format version this engine cannot read."""

    code = "unknown_record"


class JobNotFound(EngineUsageError):
    """No job with that id on this shard (or it was cancelled)."""

    code = "not_found"


class RunNotFound(EngineUsageError):
    """No run with that id (never fired, or its history was removed by retention)."""

    code = "not_found"


class JobExists(EngineUsageError):
    """A create for an id that exists, without ``replace``."""

    code = "exists"


class VersionConflict(EngineUsageError):
    """An update made against a version of the job that is no longer its current one
    (``UpdateJob.expected_version``): nothing changed. The caller reads the job again."""

    code = "conflict"
