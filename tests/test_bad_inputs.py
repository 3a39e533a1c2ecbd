"""Bad input is refused before any work, with a message naming the argument, its value and what is allowed: a
table of command lines and Python calls (issue 33's cases among them), each with the message it must give."""

import math

import numpy as np
import pytest
import torch

from cs336_basics.data import get_batch
from cs336_basics.model import BasicsTransformerLM
from cs336_basics.optimizer import AdamW
from cs336_systems.attention import get_attention
from cs336_systems.bench.cli import main
from cs336_systems.bench.common import is_oom
from cs336_systems.kernels.flash_attention.reference import FlashAttentionPytorch
from cs336_systems.memory.policy import CheckpointPolicy
from cs336_systems.recipe import Recipe

MODEL = ["model", "--preset", "tiny", "--device", "cpu"]

# (command line, where the refusal is printed: "argparse" (exit 2, stderr) or "exit" (SystemExit message),
#  the text it must contain)
COMMAND_LINES = [
    ([*MODEL, "--num-heads", "5"], "exit", "d_model=64 must be divisible by num_heads=5"),
    ([*MODEL, "--checkpoint", "partial:99"], "exit", "--checkpoint: 'partial:99' names 99 blocks but the model has 2"),
    ([*MODEL, "--checkpoint", "every-k:9"], "exit", "'every-k:9' names 9 blocks but the model has 2"),
    ([*MODEL, "--checkpoint", "sometimes"], "argparse", "--checkpoint: unknown checkpoint policy 'sometimes'"),
    ([*MODEL, "--checkpoint", "nested+keep-attn"], "argparse", "+keep-attn applies to every-block, every-k"),
    (["model", "--preset", "huge", "--device", "cpu"], "argparse", "--preset: got 'huge'; allowed: tiny, small"),
    ([*MODEL, "--context", "0"], "argparse", "--context: got 0; must be >= 1"),
    ([*MODEL, "--device", "tpu"], "argparse", "--device: got 'tpu'; allowed: cpu, cuda, cuda:N"),
    (["ddp", "--device", "cpu", "--bucket-mb", "-5"], "argparse", "--bucket-mb: got '-5'; must be a finite number > 0"),
    (["ddp", "--device", "cpu", "--bucket-mb", "0"], "argparse", "--bucket-mb: got '0'; must be a finite number > 0"),
    (["ddp", "--device", "cpu", "--bucket-mb", "nan"], "argparse", "--bucket-mb: got 'nan'; must be a finite number"),
    (["ddp", "--device", "cpu", "--bucket-mb", "big"], "argparse", "--bucket-mb: 'big' is not a number"),
    (["ddp", "--device", "cpu", "--variant", "magic"], "argparse", "--variant: got 'magic'; allowed: naive, flat"),
    (["ddp", "--device", "cpu", "--world-size", "0"], "argparse", "--world-size: got 0; must be >= 1"),
    (["attention", "--device", "cpu", "--seq", "0"], "argparse", "--seq: got 0; must be >= 1"),
    (["attention", "--device", "cpu", "--dtype", "fp8"], "argparse", "--dtype: got 'fp8'; allowed: fp32, bf16, fp16"),
    (["attention", "--device", "cpu", "--pass", "sideways"], "argparse", "--pass: got 'sideways'; allowed: fwd"),
    (["memory", "search", "--device", "cpu", "--policies", "every-k:0"], "argparse",
     "--policies: checkpoint policy every-k needs a positive group size"),
    (["leaderboard", "--preset", "tiny", "--device", "cpu", "--fit-fraction", "1.5"], "argparse",
     "--fit-fraction: got '1.5'; must be in (0, 1]"),
    (["leaderboard", "--preset", "tiny", "--device", "cpu", "--checkpoint", "partial:9"], "exit",
     "--checkpoint: 'partial:9' names 9 blocks but the model has 2"),
    (["collectives", "--device", "cpu", "--steps", "0"], "argparse", "--steps: got 0; must be >= 1"),
    (["attention-tune", "--device", "cpu", "--dtype", "bf16"], "exit",
     "attention-tune: --dtype bf16 on the CPU runs under Triton's interpreter"),
    ([*MODEL, "--warmup", "-1"], "argparse", "--warmup: got -1; must be >= 0"),
    ([*MODEL, "--warmup-s", "-0.5"], "argparse", "--warmup-s: got '-0.5'; must be a finite number >= 0"),
    ([*MODEL, "--warmup-s", "inf"], "argparse", "--warmup-s: got 'inf'; must be a finite number >= 0"),
    ([*MODEL, "--steps", "0"], "argparse", "--steps: got 0; must be >= 1"),
    ([*MODEL, "--rounds", "0"], "argparse", "--rounds: got 0; must be >= 1"),
    ([*MODEL, "--rounds", "2", "--profile"], "exit", "--rounds 2 interleaves timing only; --memory and --profile"),
    ([*MODEL, "--dtype", "int8"], "argparse", "--dtype: got 'int8'; allowed: fp32, bf16, fp16"),
    ([*MODEL, "--attention", "magic"], "argparse", "--attention: invalid choice: 'magic'"),
    ([*MODEL, "--optimizer", "sgd"], "argparse", "--optimizer: invalid choice: 'sgd'"),
    ([*MODEL, "--compile", "maybe"], "argparse", "--compile: got 'maybe'; allowed: off, on"),
    ([*MODEL, "--weight-copies", "maybe"], "argparse", "--weight-copies: got 'maybe'; allowed: on, off"),
    (["attention", "--device", "cpu", "--d", "0"], "argparse", "--d: got 0; must be >= 1"),
    (["attention", "--device", "cpu", "--provider", "bogus"], "argparse", "--provider: got 'bogus'; allowed: triton"),
    (["attention", "--device", "cpu", "--batch", "0"], "argparse", "--batch: got 0; must be >= 1"),
    (["attention", "--device", "cpu", "--sweep", "nope"], "argparse", "--sweep: invalid choice: 'nope'"),
    (["leaderboard", "--preset", "tiny", "--device", "cpu", "--context", "0"], "argparse", "--context: got 0; must be"),
    (["leaderboard", "--preset", "tiny", "--device", "cpu", "--param-dtype", "int8"], "argparse",
     "--param-dtype: invalid choice: 'int8'"),
    (["cross-entropy", "--device", "cpu", "--vocab", "0"], "argparse", "--vocab: got 0; must be >= 1"),
    (["cross-entropy", "--device", "cpu", "--tokens", "-1"], "argparse", "--tokens: got -1; must be >= 1"),
    (["memory", "search", "--device", "cpu", "--context", "0"], "argparse", "--context: got 0; must be >= 1"),
    (["fsdp", "--device", "cpu", "--world-size", "0"], "argparse", "--world-size: got 0; must be >= 1"),
    (["sharding", "--device", "cpu", "--world-size", "-2"], "argparse", "--world-size: got -2; must be >= 1"),
    (["ddp", "--device", "cpu", "--backend", "mpi"], "argparse", "--backend: invalid choice: 'mpi'"),
    (["collectives", "--device", "cpu", "--sizes-mb", "0"], "exit", "--sizes-mb: sizes must be positive, got 0.0"),
]
if not torch.cuda.is_available():
    COMMAND_LINES.append(([*MODEL[:-1], "cuda:1"], "argparse", "--device: got 'cuda:1' but no CUDA device is visible"))


@pytest.mark.parametrize("argv, where, message", COMMAND_LINES, ids=[" ".join(c[0][:1] + c[0][-2:]) for c in
                                                                       COMMAND_LINES])
def test_a_bad_command_line_is_refused_before_work(argv, where, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--results-dir", str(tmp_path / "runs")])
    if where == "argparse":
        assert stop.value.code == 2 and message in capsys.readouterr().err
    else:
        assert message in str(stop.value.code)
    assert not (tmp_path / "runs").exists()  # nothing was measured or written


TOKENS = np.arange(100, dtype=np.int64)
PARAMS = [torch.nn.Parameter(torch.zeros(2))]
Q = torch.randn(1, 8, 16)
LM = BasicsTransformerLM(100, 16, 32, 1, 4, 64, 10000.0)  # vocab 100, context 16


def flash_attention(*args, **kwargs):
    from cs336_systems.kernels.flash_attention.function import flash_attention as triton_flash_attention  # (Triton)

    return triton_flash_attention(*args, **kwargs)


# (a call that must be refused, the error type, the text its message must contain)
PYTHON_CALLS = [
    (lambda: get_batch(TOKENS, -1, 8, "cpu"), ValueError, "get_batch: batch_size must be a positive integer, got -1"),
    (lambda: get_batch(TOKENS, 2, 0, "cpu"), ValueError, "get_batch: context_length must be a positive integer, got 0"),
    (lambda: get_batch(TOKENS, 2.5, 8, "cpu"), ValueError, "batch_size must be a positive integer, got 2.5"),
    (lambda: get_batch(TOKENS, 2, 100, "cpu"), ValueError, "dataset has 100 tokens, needs more than context_length"),
    (lambda: AdamW(PARAMS, lr=math.nan), ValueError, "AdamW: lr must be a number >= 0, got nan"),
    (lambda: AdamW(PARAMS, lr=-1e-3), ValueError, "AdamW: lr must be a number >= 0, got -0.001"),
    (lambda: AdamW(PARAMS, eps=math.nan), ValueError, "AdamW: eps must be > 0, got nan"),
    (lambda: AdamW(PARAMS, weight_decay=math.nan), ValueError, "AdamW: weight_decay must be >= 0, got nan"),
    (lambda: AdamW(PARAMS, betas=(math.nan, 0.9)), ValueError, "AdamW: betas must lie in [0, 1)"),
    (lambda: BasicsTransformerLM(100, 16, 30, 1, 4, 64, 10000.0), ValueError,
     "BasicsTransformerLM: d_model=30 must be divisible by num_heads=4"),
    (lambda: CheckpointPolicy.parse("partial:x"), ValueError, "partial needs a block count M >= 0"),
    (lambda: CheckpointPolicy.parse("partial:3").check_fits(2), ValueError, "names 3 blocks but the model has 2"),
    (lambda: Recipe(compile="yes"), ValueError, "Recipe: compile must be one of off, model, block, got 'yes'"),
    (lambda: Recipe(optimizer="sgd"), ValueError, "Recipe: optimizer must be one of cs336, fused, got 'sgd'"),
    (lambda: Recipe(fused=True, weight_copy_dtype=torch.bfloat16), ValueError,
     "Recipe: weight_copy_dtype must be bfloat16 or float16, with fused, the fused optimizer"),
    (lambda: FlashAttentionPytorch.apply(Q, Q.double(), Q), ValueError,
     "FlashAttentionPytorch: q, k, v must share a dtype, got torch.float32, torch.float64, torch.float32"),
    (lambda: FlashAttentionPytorch.apply(Q, Q[:, :0], Q[:, :0]), ValueError,
     "FlashAttentionPytorch: sequences must be non-empty"),
    (lambda: FlashAttentionPytorch.apply(Q, Q[..., :8], Q[..., :8]), ValueError,
     "FlashAttentionPytorch: q, k, v must share the head dim, got 16, 8, 8"),
    (lambda: FlashAttentionPytorch.apply(Q, Q, torch.randn(1, 7, 16)), ValueError,
     "FlashAttentionPytorch: batch/head dims must match and k, v must have the same length"),
    (lambda: FlashAttentionPytorch.apply(Q[..., :0], Q[..., :0], Q[..., :0]), ValueError,
     "FlashAttentionPytorch: the head dim must be at least 1, got 0"),
    (lambda: FlashAttentionPytorch.apply(Q[0], Q[0], Q[0]), ValueError, "FlashAttentionPytorch: q must be 3-D"),
    (lambda: LM(torch.tensor([[3, -1]])), ValueError, "token ids must lie in [0, 100), got ids from -1 to 3"),
    (lambda: LM(torch.tensor([[100]])), ValueError, "Embedding: token ids must lie in [0, 100), got ids from 100"),
    (lambda: LM(torch.tensor([[1.0]])), TypeError, "BasicsTransformerLM: token ids must be integers, got dtype"),
    (lambda: LM(torch.zeros(1, 0, dtype=torch.long)), ValueError, "sequence length must be at least 1, got 0"),
    (lambda: LM(torch.zeros(1, 17, dtype=torch.long)), ValueError, "sequence length 17 exceeds context_length 16"),
    (lambda: get_batch(np.zeros((10, 10), dtype=np.int64), 2, 4, "cpu"), ValueError,
     "get_batch: dataset must be a 1-D token array, got shape (10, 10)"),
    (lambda: get_batch(TOKENS, 2, 4, "tpu"), ValueError, "get_batch: device must be a torch device such as"),
    (lambda: AdamW(PARAMS, betas=(0.9, 1.0)), ValueError, "AdamW: betas must lie in [0, 1), got (0.9, 1.0)"),
    (lambda: CheckpointPolicy.parse("every-k:0"), ValueError, "every-k needs a positive group size"),
    (lambda: CheckpointPolicy.parse(""), ValueError, "unknown checkpoint policy ''; valid: none, every-block"),
    (lambda: Recipe(attention="bogus"), ValueError, "Recipe: attention must be one of reference"),
    (lambda: get_attention("nope"), ValueError, "unknown attention implementation 'nope'; valid: reference"),
    (lambda: flash_attention(Q, Q, Q, backward="magic"), ValueError,
     "flash_attention: backward must be one of triton, two-pass, tl, fused, compile, got 'magic'"),
    (lambda: flash_attention(Q, Q, Q, launcher="rust"), ValueError,
     "flash_attention: launcher must be one of python, native, got 'rust'"),
    (lambda: flash_attention(Q, Q, Q, fp32_precision="fp64"), ValueError,
     "flash_attention: fp32_precision: got 'fp64'; allowed: ieee, tf32x3, tf32"),
]


@pytest.mark.parametrize("call, error, message", PYTHON_CALLS, ids=[c[2][:40] for c in PYTHON_CALLS])
def test_a_bad_python_call_is_refused_naming_the_argument(call, error, message):
    with pytest.raises(error) as raised:
        call()
    assert message in str(raised.value)


def test_an_out_of_memory_on_the_cpu_is_recorded_as_oom():
    assert is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                               "you tried to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)"))
    assert is_oom(MemoryError()) and is_oom(torch.OutOfMemoryError("CUDA out of memory."))
    assert not is_oom(RuntimeError("shape mismatch"))


def test_triton_attention_refuses_what_its_kernels_cannot_compute(monkeypatch):
    """bf16 on the CPU (Triton 3.6's interpreter gets bf16 products wrong) and a head dim of 0, before any launch."""
    from cs336_systems.kernels.flash_attention.dispatch import validate_attention_inputs

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bf16 = Q.to(torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 on the CPU runs under Triton's interpreter"):
        validate_attention_inputs(bf16, bf16, bf16)
    with pytest.raises(ValueError, match="flash attention: the head dim must be at least 1, got 0"):
        validate_attention_inputs(Q[..., :0], Q[..., :0], Q[..., :0])
    validate_attention_inputs(Q.half(), Q.half(), Q.half())  # fp16 and fp32 compute correctly there
    validate_attention_inputs(Q, Q, Q)
