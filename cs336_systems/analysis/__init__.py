"""Calculators for the handout's written problems: collectives, parallelism of an FFN layer,
training-state memory and device meshes, and the DDP bucket size. Each returns `Calculation`s
that carry their formula, inputs and value, so the CLI (`cs336-analyze`) and the report print
the derivation beside the number."""

from cs336_systems.analysis.calculation import Calculation

__all__ = ["Calculation"]
