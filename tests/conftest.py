"""Hypothesis profiles. ``ci`` (the default, what ``make test`` and CI run) draws the same
examples on every run, so a submission's result does not depend on the luck of the draw;
``fuzz`` (``make fuzz``) draws new ones each time and is run in a loop to explore."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True)
settings.register_profile("fuzz", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
