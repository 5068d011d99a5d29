"""SimPy driver of the same engine under simulated faults. Imports ``engine``, never ``cluster``."""

from engine import refuse_stale_compiled

refuse_stale_compiled(__file__)
