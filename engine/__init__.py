"""The pure core of tickwheel.

Owns every decision a node makes: the timing wheel, schedules, the job and run model and the
shard state machine. Must never do I/O, read a clock, use ``async``, or draw randomness that was
not injected as a seed: both drivers (the Trio node in ``cluster/`` and the SimPy harness in
``sim/``) have to reach the same decisions from the same inputs.
"""
