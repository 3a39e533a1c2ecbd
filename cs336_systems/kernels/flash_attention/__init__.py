"""FlashAttention-2: references (reference.py), Triton forward (forward.py), Triton and compiled
backward (backward.py), launchers and autograd Functions (function.py).

Import the Triton parts from `function` (it imports Triton); `reference` runs anywhere.
"""
