"""SimPy driver of the same engine under simulated faults. Imports ``engine``, never ``cluster``."""
