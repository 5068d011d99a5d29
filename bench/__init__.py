"""Benchmarks with their anchors measured side by side in the same run.

Every suite returns the same JSON shape: ``{"suite", "machine", "metrics": [...]}``, each metric
with ``name``, ``value``, ``unit``, its parameters as fields and, where an anchor ran beside it,
``anchor``, ``anchor_value`` and ``ratio`` (see :mod:`bench.common`).
"""
