"""The entry points the official CS336 assignment-2 suites (26.x and 1.0.x) call.

One line each, absolute imports only; the logic lives in the package. INTERFACE.md
(shared with the project) lists every name; each is added here when its feature lands.
"""

from __future__ import annotations

from cs336_systems.kernels.flash_attention.reference import FlashAttentionPytorch


def get_flashattention_autograd_function_pytorch() -> type:
    return FlashAttentionPytorch


def get_flashattention_autograd_function_triton() -> type:
    from cs336_systems.kernels.flash_attention.function import FlashAttentionTriton  # imports Triton

    return FlashAttentionTriton
