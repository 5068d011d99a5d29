"""Hypothesis profiles. ``ci`` (the default, what ``make test`` and CI run) draws the same
examples on every run, so a submission's result does not depend on the luck of the draw;
``fuzz`` (``make fuzz``) draws new ones each time and is run in a loop to explore. Neither has
a deadline per example: a stall of a loaded machine longer than Hypothesis's default 200 ms
would fail an example as "unreliable timings", which says nothing of the code."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("fuzz", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
