"""Training-state memory of a model and its sharding, in the handout's accounting for the XXL
model: num_blocks FFN blocks of two linear layers (D x F and F x D), attention, embeddings and
the output layer left out; master weights, accumulated gradients and AdamW state (two moments)
in fp32 (4 + 4 + 8 bytes per parameter); activations saved for backward in bf16: each linear
keeps its input, so per block and token D + F elements (no checkpointing).
"""

from __future__ import annotations

import math

from cs336_systems.analysis.calculation import Calculation, positive

GB = 1e9


def ffn_stack_parameters(d_model: int, d_ff: int, num_blocks: int) -> Calculation:
    return Calculation("P", "num_blocks * 2 D F", num_blocks * 2 * d_model * d_ff, "params",
                       dict(D=d_model, F=d_ff, num_blocks=num_blocks))


def training_state(d_model: int, d_ff: int, num_blocks: int, tokens: int, device_bytes: float,
                   master_bytes: int = 4, grad_bytes: int = 4, optimizer_bytes: int = 8,
                   activation_bytes: int = 2) -> list[Calculation]:
    """Bytes of master weights, gradients, optimizer state and saved activations, and devices of
    `device_bytes` their sum fills."""
    positive("device_bytes", device_bytes)
    P = ffn_stack_parameters(d_model, d_ff, num_blocks).value
    inputs = dict(P=P, D=d_model, F=d_ff, num_blocks=num_blocks, tokens=tokens)
    state = P * (master_bytes + grad_bytes + optimizer_bytes)
    acts = num_blocks * tokens * (d_model + d_ff) * activation_bytes
    return [
        Calculation("master_weights", f"{master_bytes} P", P * master_bytes, "B", inputs),
        Calculation("gradients", f"{grad_bytes} P", P * grad_bytes, "B", inputs),
        Calculation("optimizer_state", f"{optimizer_bytes} P", P * optimizer_bytes, "B", inputs),
        Calculation("state_total", f"{master_bytes + grad_bytes + optimizer_bytes} P", state, "B", inputs),
        Calculation("activations", f"num_blocks * tokens * (D + F) * {activation_bytes}", acts, "B", inputs),
        Calculation("devices_for_state", "ceil(state_total / device_bytes)", math.ceil(state / device_bytes),
                    "devices", inputs | dict(device_bytes=device_bytes)),
        Calculation("devices_for_state_and_activations", "ceil((state_total + activations) / device_bytes)",
                    math.ceil((state + acts) / device_bytes), "devices", inputs | dict(device_bytes=device_bytes)),
    ]


def fsdp_shards_to_fit(state_bytes: float, activation_bytes: float, device_bytes: float,
                       sharded_activation_fraction: float = 0.5) -> list[Calculation]:
    """Per-device memory with state and a fraction of activations sharded over N_FSDP devices,
    M(N) = (state + f A) / N + (1 - f) A, and the least N with M(N) < device_bytes."""
    f, S, A = sharded_activation_fraction, state_bytes, activation_bytes
    inputs = dict(state=S, A=A, f=f, device_bytes=device_bytes)
    room = device_bytes - (1 - f) * A
    if room <= 0:
        raise ValueError(f"the unsharded activations ({(1 - f) * A / GB:.1f} GB) alone exceed device_bytes "
                         f"({device_bytes / GB:.1f} GB): no N_FSDP fits")
    n = math.floor((S + f * A) / room) + 1
    return [Calculation("N_FSDP_min", "floor((state + f A) / (device_bytes - (1 - f) A)) + 1", n, "devices", inputs),
            Calculation("memory_per_device", "(state + f A) / N + (1 - f) A", (S + f * A) / n + (1 - f) * A, "B",
                        inputs | dict(N=n))]
