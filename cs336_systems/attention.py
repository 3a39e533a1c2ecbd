"""Choosing the attention the model runs, by an explicit name.

Every implementation has the signature of `cs336_basics.model.scaled_dot_product_attention`
(Q, K, V, mask=None), plus `is_causal`, and is installed by swapping that module global, so
the model stays ignorant of it. Unknown names raise and list the valid ones.

* reference: the staff maths (materialised scores, softmax, mask).
* compile: the reference under torch.compile.
* pytorch-flash: our tiled pure-PyTorch FlashAttention-2 (slow; any device).
* triton: our Triton FlashAttention-2, forward and the fastest measured backward (two passes; on Hopper
  one pass at head dim 128, not bitwise reproducible).
* triton-two-pass-bwd: Triton forward, always the two deterministic backward passes.
* triton-fused-bwd: Triton forward, one-pass Triton backward (dQ reduced in fp32 across key tiles;
  fewer FLOPs, not bitwise reproducible).
* triton-compile-bwd: Triton forward, torch.compile'd PyTorch backward.

The flash implementations carry `causal_without_mask = True`, so the model hands them
`is_causal=True` instead of building a (seq, seq) mask. Called with a mask, they recognise
the causal mask (one compare against a cached lower triangle) and use the kernel; any
other mask falls back to the reference, with a warning that says so.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator

import torch

import cs336_basics.model as basics_model
from cs336_systems.kernels._triton_utils import missing_triton_message, triton_installed

AttentionFn = Callable[..., torch.Tensor]

_REFERENCE = basics_model.scaled_dot_product_attention
# Our Triton implementations by name -> `flash_attention`'s backward (the benchmarks' provider names too).
TRITON_BACKWARDS = {"triton": "triton", "triton-two-pass-bwd": "two-pass", "triton-fused-bwd": "fused",
                    "triton-compile-bwd": "compile"}


@functools.lru_cache(maxsize=8)
def _lower_triangle(n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n_keys, device=device)[None, :] <= torch.arange(n_queries, device=device)[:, None]


def is_causal_mask(mask: torch.Tensor, n_queries: int, n_keys: int) -> bool:
    """True when `mask` (bool, broadcastable to (..., n_queries, n_keys)) is the causal mask for every head."""
    if mask.dtype != torch.bool or mask.shape[-2:] != (n_queries, n_keys) or any(s != 1 for s in mask.shape[:-2]):
        return False
    return torch.equal(mask.reshape(n_queries, n_keys), _lower_triangle(n_queries, n_keys, mask.device))


def _flash(kernel_call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor], name: str,
           traceable: bool) -> AttentionFn:
    """traceable: torch.compile traces the call (our Triton attention is a registered operator with fake and
    autograd rules: no graph break, dynamic shapes); else it runs eagerly between graphs (the tiled PyTorch
    class, whose Python loops over tiles would unroll into the graph)."""

    def attention(Q, K, V, mask=None, is_causal=False):
        if mask is not None:
            if is_causal_mask(mask, Q.shape[-2], K.shape[-2]):
                is_causal = True
            else:
                warnings.warn(f"attention {name!r}: mask is not the causal mask; falling back to the reference",
                              stacklevel=2)
                return _REFERENCE(Q, K, V, mask)
        return kernel_call(Q, K, V, is_causal)

    attention.causal_without_mask = True
    attention.__name__ = f"{name.replace('-', '_')}_attention"
    return attention if traceable else torch.compiler.disable(attention)


@functools.cache
def _triton(backward: str) -> AttentionFn:
    name = next(name for name, impl in TRITON_BACKWARDS.items() if impl == backward)
    if not triton_installed():
        raise ModuleNotFoundError(missing_triton_message(f"attention {name!r}"), name="triton")
    from cs336_systems.kernels.flash_attention.function import flash_attention

    return _flash(lambda q, k, v, causal: flash_attention(q, k, v, causal, backward=backward), name,
                  traceable=True)


@functools.cache
def _pytorch_flash() -> AttentionFn:
    from cs336_systems.kernels.flash_attention.reference import FlashAttentionPytorch

    return _flash(lambda q, k, v, causal: FlashAttentionPytorch.apply(q, k, v, causal), "pytorch-flash",
                  traceable=False)


@functools.cache
def _compiled_reference() -> AttentionFn:
    return torch.compile(_REFERENCE)


_REGISTRY: dict[str, Callable[[], AttentionFn]] = {
    "reference": lambda: _REFERENCE,
    "compile": _compiled_reference,
    "pytorch-flash": _pytorch_flash,
    **{name: functools.partial(_triton, backward) for name, backward in TRITON_BACKWARDS.items()},
}


def attention_names() -> list[str]:
    return list(_REGISTRY)


def get_attention(name: str) -> AttentionFn:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention implementation {name!r}; valid: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]()


def flash_scaled_dot_product_attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                                       mask: torch.Tensor | None = None) -> torch.Tensor:
    """Drop-in for `cs336_basics.model.scaled_dot_product_attention` running our Triton kernel
    (causal mask recognised; other masks fall back to the reference, with a warning)."""
    return get_attention("triton")(Q, K, V, mask)


@contextlib.contextmanager
def use_attention(name: str) -> Iterator[AttentionFn]:
    """Run the model with attention `name` inside the block; the previous function is restored after."""
    fn = get_attention(name)
    previous = basics_model.scaled_dot_product_attention
    basics_model.scaled_dot_product_attention = fn
    try:
        yield fn
    finally:
        basics_model.scaled_dot_product_attention = previous
