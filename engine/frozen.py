"""Pickling of the frozen dataclasses that cross process boundaries (the simulation's pool
sends configs out and violations back).

Compiled (``make native``), a frozen dataclass has no ``__dict__`` for pickle to fill and its
``__setattr__`` refuses, so the default unpickling fails; such a class returns
:func:`rebuilt_by_init` from its ``__reduce__`` and is rebuilt through ``__init__`` (its
``__post_init__`` checks included). Owns nothing else.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def rebuilt_by_init(instance: DataclassInstance) -> tuple[type, tuple[object, ...]]:
    """``__reduce__``'s answer for ``instance``: its class, called with its fields in order."""
    return type(instance), tuple(getattr(instance, f.name) for f in fields(instance))


__all__ = ["rebuilt_by_init"]
