"""The pure core of tickwheel.

Owns every decision a node makes: the timing wheel, schedules, the job and run model and the
shard state machine. Must never do I/O, read a clock, use ``async``, or draw randomness that was
not injected as a seed: both drivers (the Trio node in ``cluster/`` and the SimPy harness in
``sim/``) have to reach the same decisions from the same inputs. (The one exception is the
import-time check below that no compiled module is older than its source.)
"""

from __future__ import annotations

import importlib.machinery
import os

#: The file name prefix of the compiled build's shared library (``build_native.GROUP``), which
#: sits in this package: every compiled module of ``engine`` and ``sim`` imports it.
GROUP_LIBRARY_PREFIX = "_native__mypyc."


class StaleCompiledModule(ImportError):
    """A compiled module (``make native``) is older than its source, or its source is gone:
    Python would import the compiled one and run code that is no longer the source's."""


def refuse_stale_compiled(package_file: str) -> None:
    """Raise :class:`StaleCompiledModule` when any extension module beside ``package_file``
    (a package's ``__init__.py``) is older than the ``.py`` it was compiled from.

    Called first by each compiled package's ``__init__`` (which itself stays interpreted), so
    that an edited source is never shadowed by its old compiled self without a word. O(files in
    the package directory): one listing and two stats per compiled module.
    """
    directory = os.path.dirname(os.path.abspath(package_file))
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    for name in os.listdir(directory):
        suffix = next((s for s in suffixes if name.endswith(s)), None)
        if suffix is None or name.startswith(GROUP_LIBRARY_PREFIX):
            # (the group's shared library has no source of its own; the shims that load it
            # are each checked against theirs, and the build writes them all together)
            continue
        compiled = os.path.join(directory, name)
        source = os.path.join(directory, name[: -len(suffix)] + ".py")
        try:
            stale = os.stat(source).st_mtime_ns > os.stat(compiled).st_mtime_ns
        except FileNotFoundError:
            stale = True
        if stale:
            raise StaleCompiledModule(
                f"{compiled} is older than {source} (or its source is gone): run `make native` "
                "to compile it again, or `make interpreted` to remove every compiled module"
            )


refuse_stale_compiled(__file__)
