"""Workflows: what plans, measures and learns in several steps, above placement, the cost models and profiling.

Calibration, racing and comparing plans, refinement by measured moves, the benchmark report, the
demo and DreamShard's outer loop each put the lower layers together; nothing below imports them.
"""
