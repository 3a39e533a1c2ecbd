"""Launch plans (kernels/launch_plan.py): repeat attention calls replay the compiled kernels.

On CPU: the pieces (argument binding, slot naming, the signature, the bounded cache) with stand-ins for a
compiled kernel. On the GPU: a replayed call gives exactly what the normal launch path gives, for every
backward, layout and dtype, and inputs that share an address make no plan.
"""

import contextlib

import pytest
import torch
import torch.utils._python_dispatch
import triton
import triton.language as tl

from cs336_systems.kernels import launch_plan
from tests._support import requires_cuda, requires_hopper


@triton.jit
def _scale_kernel(src, dst, n, factor, BLOCK: tl.constexpr, EVEN: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n) * factor, mask=offs < n)


def test_bound_values_lists_every_parameter_in_order_with_defaults():
    src, dst = torch.zeros(4), torch.zeros(4)
    values = launch_plan.bound_values(_scale_kernel, (src, dst, 4), dict(factor=2.0, BLOCK=16, num_warps=4))
    assert values[:2] == [src, dst] and values[2:] == [4, 2.0, 16, False]  # num_warps is a launch option


class _FakeCompiled:
    """Stands in for a CompiledKernel: `compiled[grid]` gives a launcher that records its arguments."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args: self.calls.append((grid, args))


def test_capture_names_tensor_arguments_and_replays_with_new_addresses():
    q, out = torch.zeros(8), torch.zeros(8)
    compiled = _FakeCompiled()
    captured = launch_plan.capture(compiled, (3, 2), [q, out, 8, 0.5], dict(q=q, out=out))
    assert captured.slots == ((0, "q"), (1, "out")) and captured.values == [None, None, 8, 0.5]
    captured(dict(q=111, out=222))
    captured(dict(q=333, out=444))
    assert compiled.calls == [((3, 2, 1), (111, 222, 8, 0.5)), ((3, 2, 1), (333, 444, 8, 0.5))]


def _host_descriptor(t4: torch.Tensor, rows: int):
    from cs336_systems.kernels.flash_attention import gluon_common

    return gluon_common.host_row_tiles(t4, rows)


def test_capture_moves_a_host_descriptor_to_its_tensors_new_address():
    """A host tensor descriptor over a slot's tensor keeps its shape, strides and tiles and is rebuilt over the
    tensor's address per call (Triton's launcher encodes it from `base.data_ptr()`); the plan holds no tensor."""
    q = torch.zeros(2, 5, 3, 64, dtype=torch.bfloat16).transpose(1, 2)  # a head view: (2, 3, 5, 64)
    lse = torch.zeros(2, 3, 5)
    compiled = _FakeCompiled()
    captured = launch_plan.capture(compiled, (1, 6), [_host_descriptor(q, 64), lse, 5], dict(q=q, lse=lse))
    assert captured.slots == ((1, "lse"),) and captured.descriptor_slots == ((0, "q"),)
    assert not any(isinstance(getattr(value, "base", value), torch.Tensor) for value in captured.values)
    captured(dict(q=4096, lse=8192))
    (grid, (descriptor, lse_address, n)), = compiled.calls
    assert grid == (1, 6, 1) and (lse_address, n) == (8192, 5)
    assert descriptor.base.data_ptr() == 4096 and descriptor.base.dtype == torch.bfloat16
    assert list(descriptor.shape) == [2, 3, 5, 64] and list(descriptor.strides) == list(q.stride())
    assert list(descriptor.block_shape) == [1, 1, 64, 64]
    unknown = torch.zeros_like(q)  # over no slot's tensor: no plan
    assert launch_plan.capture(_FakeCompiled(), (1,), [_host_descriptor(unknown, 64)], dict(q=q)) is None


def test_capture_refuses_aliased_or_unknown_tensors():
    x, y = torch.zeros(8), torch.zeros(8)
    assert launch_plan.capture(_FakeCompiled(), (1,), [x, 1], dict(q=x, k=x)) is None  # one address, two roles
    assert launch_plan.capture(_FakeCompiled(), (1,), [x, y], dict(q=x)) is None  # y has no name


def test_a_view_is_named_by_its_base_tensor():
    q = torch.zeros(2, 5, 4)
    captured = launch_plan.capture(_FakeCompiled(), (1,), [q.unsqueeze(1)], dict(q=q))
    assert captured.slots == ((0, "q"),)


def test_signature_tells_layouts_dtypes_and_alignment_apart():
    base = torch.zeros(64)
    a = base[:32].view(4, 8)
    assert launch_plan.tensor_signature(a) == launch_plan.tensor_signature(torch.zeros(4, 8))
    assert launch_plan.tensor_signature(a) != launch_plan.tensor_signature(a.t())
    assert launch_plan.tensor_signature(a) != launch_plan.tensor_signature(a.double())
    assert launch_plan.tensor_signature(a) != launch_plan.tensor_signature(base[1:33].view(4, 8))  # 4-byte offset


def test_plan_cache_is_bounded_and_drops_the_oldest(monkeypatch):
    monkeypatch.setattr(launch_plan, "MAX_PLANS", 3)
    monkeypatch.setattr(launch_plan, "_plans", type(launch_plan._plans)())
    for i in range(5):
        launch_plan.store(("key", i), i)
    assert launch_plan.plan_count() == 3
    assert launch_plan.lookup(("key", 0)) is None and launch_plan.lookup(("key", 4)) == 4


class _FakeJitKernel:
    """Stands in for a plain `triton.jit` kernel: `kernel[grid](...)` and `kernel.run(...)` record a normal launch
    and hand back a `_FakeCompiled`; `.fn` is the Python function whose parameters `bound_values` reads."""

    def __init__(self):
        self.fn = _scale_kernel.fn
        self.normal_launches = []
        self.compiled = _FakeCompiled()

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.normal_launches.append((grid, args, kwargs))

    def run(self, *args, grid, warmup, **kwargs):
        self.normal_launches.append((grid, args, kwargs))
        return self.compiled


def test_a_single_kernel_launch_is_replayed_per_signature_with_new_addresses(monkeypatch):
    """`launch_plan.launch` (RMSNorm, SwiGLU, RoPE, cross-entropy): the first launch of a signature takes the normal
    path and is kept; a repeat replays it with the new tensors' addresses by position, aliases included; another
    shape, scalar or keyword makes its own plan; off the planning device it is the normal launch every time."""
    monkeypatch.setattr(launch_plan, "_plans", type(launch_plan._plans)())
    monkeypatch.setattr(launch_plan, "_plans_device", lambda tensor: True)
    kernel = _FakeJitKernel()
    src, dst = torch.zeros(8), torch.zeros(8)
    launch_plan.launch(kernel, (2,), src, dst, 8, 0.5, BLOCK=4)
    assert len(kernel.normal_launches) == 1 and kernel.compiled.calls == []
    src2, dst2 = torch.zeros(8), torch.zeros(8)
    launch_plan.launch(kernel, (2,), src2, dst2, 8, 0.5, BLOCK=4)
    launch_plan.launch(kernel, (2,), src2, src2, 8, 0.5, BLOCK=4)  # in place: one tensor in two slots
    assert len(kernel.normal_launches) == 1
    assert kernel.compiled.calls == [((2, 1, 1), (src2.data_ptr(), dst2.data_ptr(), 8, 0.5, 4, False)),
                                     ((2, 1, 1), (src2.data_ptr(), src2.data_ptr(), 8, 0.5, 4, False))]
    launch_plan.launch(kernel, (2,), src, dst, 8, 0.25, BLOCK=4)  # another scalar
    launch_plan.launch(kernel, (2,), src, dst, 8, 0.5, BLOCK=8)  # another constexpr
    launch_plan.launch(kernel, (2,), torch.zeros(4, 2), dst, 8, 0.5, BLOCK=4)  # another shape
    launch_plan.launch(kernel, (2,), src.double(), dst, 8, 0.5, BLOCK=4)  # another dtype
    assert len(kernel.normal_launches) == 5 and len(kernel.compiled.calls) == 2
    monkeypatch.setattr(launch_plan, "_plans_device", lambda tensor: False)
    launch_plan.launch(kernel, (2,), src, dst, 8, 0.5, BLOCK=4)
    assert len(kernel.normal_launches) == 6 and len(kernel.compiled.calls) == 2
    monkeypatch.setattr(launch_plan, "_plans_device", lambda tensor: True)
    launch_plan.use_plans(False)
    try:
        launch_plan.launch(kernel, (2,), src, dst, 8, 0.5, BLOCK=4)
    finally:
        launch_plan.use_plans(True)
    assert len(kernel.normal_launches) == 7 and len(kernel.compiled.calls) == 2


# ---- GPU: a replay is the normal path's result exactly ----

# (batch, heads or None, n_queries, n_keys, d, dtype): the Gluon paths (d 64, 128 in bf16/fp16), the tl paths
# (d 32, fp32), ragged lengths.
PLAN_CASES = [(1, 2, 1000, 1000, 128, torch.bfloat16), (2, 3, 513, 257, 64, torch.bfloat16),
              (1, None, 300, 300, 128, torch.float16), (2, 2, 77, 130, 32, torch.bfloat16),
              (1, 2, 200, 200, 64, torch.float32), (2, None, 1, 17, 16, torch.float32)]


def _attend(q, k, v, causal, backward, grad_out, launcher="python"):
    from cs336_systems.kernels.flash_attention.function import flash_attention

    for t in (q, k, v):
        t.grad = None
    out = flash_attention(q, k, v, causal, backward=backward, launcher=launcher)
    out.backward(grad_out)
    return out.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()


def _assert_same_results(ours, expected, backward):
    for name, mine, theirs in zip(("out", "dq", "dk", "dv"), ours, expected):
        if name == "dq" and backward in ("triton", "fused"):
            # One-pass dQ is an fp32 sum in arrival order: equal up to that order's rounding.
            torch.testing.assert_close(mine, theirs, rtol=2e-2, atol=2e-2 * theirs.abs().max().item())
        else:
            assert torch.equal(mine, theirs), name


def _fresh_inputs(batch, heads, nq, nk, d, dtype, seed):
    torch.manual_seed(seed)
    lead = (batch,) if heads is None else (batch, heads)
    return [torch.randn(*lead, n, d, device="cuda", dtype=dtype, requires_grad=True) for n in (nq, nk, nk)]


@requires_cuda
@pytest.mark.parametrize("backward", ["triton", "two-pass", "tl", "fused"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", PLAN_CASES)
def test_replayed_plan_matches_the_launch_path(case, causal, backward):
    *shape, dtype = case
    launch_plan.use_plans(True)
    q, k, v = _fresh_inputs(*shape, dtype, seed=0)
    _attend(q, k, v, causal, backward, torch.randn_like(q))  # makes the plans (and tunes)
    before = launch_plan.plan_count()
    q, k, v = _fresh_inputs(*shape, dtype, seed=1)  # new addresses and values
    grad_out = torch.randn_like(q)
    replayed = _attend(q, k, v, causal, backward, grad_out)
    assert launch_plan.plan_count() == before  # replayed, not made again
    launch_plan.use_plans(False)
    try:
        direct = _attend(q, k, v, causal, backward, grad_out)
    finally:
        launch_plan.use_plans(True)
    _assert_same_results(replayed, direct, backward)


@requires_cuda
def test_plans_follow_the_models_head_views():
    """(batch, seq, heads, d) storage read as (batch, heads, seq, d): strided inputs and gradients."""
    from cs336_systems.kernels.flash_attention.function import flash_attention

    def attend(qkv):
        qkv.grad = None
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (batch, heads, seq, d) views
        out = flash_attention(q, k, v, True)
        out.backward(torch.ones_like(out))
        return out.detach().clone(), qkv.grad.clone()

    launch_plan.use_plans(True)
    for seed in (0, 1):  # the first call makes the plans, the second replays them
        torch.manual_seed(seed)
        qkv = torch.randn(2, 300, 3, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        replayed = attend(qkv)
    launch_plan.use_plans(False)
    try:
        direct = attend(qkv)
    finally:
        launch_plan.use_plans(True)
    assert torch.equal(replayed[0], direct[0])
    torch.testing.assert_close(replayed[1], direct[1], rtol=2e-2, atol=2e-2 * direct[1].abs().max().item())


@requires_cuda
def test_self_attention_on_one_tensor_makes_no_plan_and_replays_correctly():
    from cs336_systems.kernels.flash_attention.dispatch import flash_forward

    x, y, z = (torch.randn(1, 2, 190, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    launch_plan.clear_plans()
    out, _ = flash_forward(x, x, x, True)  # one address in three roles: no plan
    assert launch_plan.plan_count() == 0
    flash_forward(y, x, z, True)  # the same signature, three addresses: a plan
    assert launch_plan.plan_count() == 1
    again, _ = flash_forward(x, x, x, True)  # replayed with one address in three roles
    assert launch_plan.plan_count() == 1
    assert torch.equal(again, out)


# ---- native plans (native_launch.py / .cpp): the parameter packing on CPU, the replay on the GPU ----

class _FakeMetadata:
    launch_cooperative_grid = False
    launch_pdl = False
    global_scratch_size = 128
    profile_scratch_size = 0


class _FakeKernel(_FakeCompiled):
    """A compiled kernel's metadata as native_launch.kernel_spec reads it."""

    function = 0xABC
    metadata = _FakeMetadata()
    packed_metadata = (8, 1, 99328)

    class src:  # noqa: N801 (stands in for the kernel's ASTSource)
        signature = {"Q": "*bf16", "L": "*fp32", "scratch": "*fp32", "n": "i32", "big": "i64", "scale": "fp32",
                     "flag": "u1", "BLOCK": "constexpr"}

    def _init_handles(self):
        pass


def _fake_capture():
    q, lse = torch.zeros(4), torch.zeros(4)
    values = [q, lse, None, 1000, 2**40, 0.125, True, 64]
    return launch_plan.capture(_FakeKernel(), (5, 6), values, dict(q=q, lse=lse))


def test_kernel_spec_follows_the_compiled_signature():
    from cs336_systems.kernels.flash_attention import native_launch

    function, config, kinds, integers, reals, maps = native_launch.kernel_spec(_fake_capture())
    assert function == 0xABC and config == [5, 6, 1, 8, 1, 99328, 0, 0, 128] and maps == []
    names = [native_launch.ARG_KINDS[k] for k in kinds]
    assert names == ["tensor", "tensor", "null", "i32", "i64", "fp32", "u8"]  # the constexpr is not a parameter
    assert integers[:2] == [native_launch.SLOTS.index("q"), native_launch.SLOTS.index("lse")]
    assert integers[3:5] == [1000, 2**40] and reals[5] == 0.125 and integers[6] == 1


def test_kernel_spec_flattens_stride_tuples_as_tritons_launcher_does():
    """A tensor's strides arrive as one tuple parameter; the JIT specialises each element (a stride of 1 becomes a
    constexpr) and Triton's launcher passes the others depth first, one scalar each."""
    from cs336_systems.kernels.flash_attention import native_launch

    captured = _fake_capture()
    signature = dict(_FakeKernel.src.signature, n=("i32", "i32", "constexpr"), big=(("i64", "constexpr"), "i32"))
    captured.compiled = type("Strided", (_FakeKernel,), {"src": type("src", (), {"signature": signature})})()
    captured.values[3], captured.values[4] = (4096, 64, 1), ((2**40, 1), 7)
    _, _, kinds, integers, _, _ = native_launch.kernel_spec(captured)
    names = [native_launch.ARG_KINDS[k] for k in kinds]
    assert names == ["tensor", "tensor", "null", "i32", "i32", "i64", "i32", "fp32", "u8"]
    assert integers[3:7] == [4096, 64, 2**40, 7]
    pointer_inside = dict(signature, n=("*fp32", "i32"))
    captured.compiled = type("Pointer", (_FakeKernel,), {"src": type("src", (), {"signature": pointer_inside})})()
    assert native_launch.kernel_spec(captured) is None


def test_kernel_spec_refuses_scalars_it_cannot_pack():
    from cs336_systems.kernels.flash_attention import native_launch

    captured = _fake_capture()
    half_scale = dict(_FakeKernel.src.signature, scale="fp16")  # a half-precision scalar: not packed
    captured.compiled = type("Half", (_FakeKernel,), {"src": type("src", (), {"signature": half_scale})})()
    assert native_launch.kernel_spec(captured) is None


class _FakeDescriptorMetadata(_FakeMetadata):
    global_scratch_size = 0
    tensordesc_meta = [{"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [1, 1, 64, 64],
                        "fp4_padded": False}]


class _FakeDescriptorKernel(_FakeKernel):
    """A Gluon kernel taking Q as a host descriptor, as Triton 3.6 compiles it (a `tensordesc<...>` parameter and
    its `tensordesc_meta`: swizzle, element size and device type, tile)."""

    metadata = _FakeDescriptorMetadata()

    class src:  # noqa: N801
        signature = {"Q": "tensordesc<bf16[1,1,64,64],NVMMASharedLayout(swizzle_byte_width=128)>", "L": "*fp32",
                     "q_strides": ("i32", "i32", "i32"), "n": "i32", "HEAD_DIM": "constexpr"}


def _descriptor_capture():
    q = torch.zeros(2, 5, 3, 64, dtype=torch.bfloat16).transpose(1, 2)  # a head view: (2, 3, 5, 64)
    lse = torch.zeros(2, 3, 5)
    values = [_host_descriptor(q, 64), lse, (960, 64, 192), 5, 64]
    return launch_plan.capture(_FakeDescriptorKernel(), (1, 6), values, dict(q=q, lse=lse)), q


def test_kernel_spec_takes_a_host_descriptor_as_tritons_launcher_expands_it():
    """A descriptor parameter is launched as its CUtensorMap, then its shape (i32) and strides (i64); the map is
    encoded as fill_tma_descriptor encodes it: dimensions innermost first, strides in bytes without the last,
    the host's data type for bf16 (device 10 -> host 9), the kernel's swizzle and tile."""
    from cs336_systems.kernels.flash_attention import native_launch

    captured, q = _descriptor_capture()
    _, config, kinds, integers, _, maps = native_launch.kernel_spec(captured)
    names = [native_launch.ARG_KINDS[k] for k in kinds]
    assert names == ["tensormap", *["i32"] * 4, *["i64"] * 4, "tensor", "i32", "i32", "i32", "i32"]
    assert integers[0] == 0 and integers[1:9] == [2, 3, 5, 64, *q.stride()]
    assert integers[9] == native_launch.SLOTS.index("lse") and integers[10:] == [960, 64, 192, 5]
    batch_stride, head_stride, row_stride, _ = q.stride()
    assert maps == [[native_launch.SLOTS.index("q"), 9, 3, 0, 4, 64, 5, 3, 2,
                     2 * row_stride, 2 * head_stride, 2 * batch_stride, 64, 64, 1, 1]]
    no_meta = type("NoMeta", (_FakeDescriptorMetadata,), {"tensordesc_meta": None})
    captured.compiled = type("Lowered", (_FakeDescriptorKernel,), {"metadata": no_meta()})()
    assert native_launch.kernel_spec(captured) is None  # lowered to a pointer, shape and strides: not packed


def test_native_packs_a_descriptors_tensor_address_and_checks_its_map():
    """In the packed parameters (what a dry run records) a descriptor's entry is its tensor's address (the launch
    encodes the CUtensorMap over it); a map of the wrong length or slot is refused when the plan is made."""
    import struct

    from cs336_systems.kernels.flash_attention import native_launch

    module = native_launch.load_module()
    if module is None:
        pytest.skip("the native extension did not build here")
    captured, _ = _descriptor_capture()
    spec = native_launch.kernel_spec(captured)
    addresses = [0x1000 * (i + 1) for i in range(len(native_launch.SLOTS))]
    packed = module.packed_parameters(spec, addresses, 0)
    words = struct.unpack(f"<{len(packed) // 8}Q", packed)
    assert words[0] == addresses[native_launch.SLOTS.index("q")]
    assert words[9] == addresses[native_launch.SLOTS.index("lse")]
    short = (*spec[:5], [spec[5][0][:-1]])
    with pytest.raises(RuntimeError, match="tensor map of rank 4"):
        module.packed_parameters(short, addresses, 0)
    bad_slot = (*spec[:5], [[99, *spec[5][0][1:]]])
    with pytest.raises(RuntimeError, match="tensor slot 99"):
        module.packed_parameters(bad_slot, addresses, 0)


def test_native_parameters_are_packed_as_tritons_launcher_packs_them():
    """Each parameter in 8 bytes of its own in its C type (int32, int64, float32 bits, uint8), then the global
    scratch and profile scratch pointers: backends/nvidia/driver.py's `_launch` takes `&argN` of each."""
    import struct

    from cs336_systems.kernels.flash_attention import native_launch

    module = native_launch.load_module()
    if module is None:
        pytest.skip("the native extension did not build here")
    spec = native_launch.kernel_spec(_fake_capture())
    addresses = [0x1000 * (i + 1) for i in range(len(native_launch.SLOTS))]
    packed = module.packed_parameters(spec, addresses, 0x7700)
    expected = b"".join([
        struct.pack("<Q", addresses[native_launch.SLOTS.index("q")]),
        struct.pack("<Q", addresses[native_launch.SLOTS.index("lse")]),
        struct.pack("<Q", 0),
        struct.pack("<i", 1000) + bytes(4),
        struct.pack("<q", 2**40),
        struct.pack("<f", 0.125) + bytes(4),
        struct.pack("<B", 1) + bytes(7),
        struct.pack("<Q", 0x7700),  # global scratch
        struct.pack("<Q", 0),  # profile scratch
    ])
    assert packed == expected


def _native_module():
    from cs336_systems.kernels.flash_attention import native_launch

    module = native_launch.load_module()
    if module is None:
        pytest.fail("the native extension did not build on this GPU machine")
    return module


def _dry_spec(*slots_and_scalars):
    """A kernel spec for dry runs (no CUfunction): tensor slots by name, then int32 scalars."""
    from cs336_systems.kernels.flash_attention import native_launch

    kinds, integers = [], []
    for item in slots_and_scalars:
        if isinstance(item, str):
            kinds.append(native_launch.ARG_KINDS.index("tensor"))
            integers.append(native_launch.SLOTS.index(item))
        else:
            kinds.append(native_launch.ARG_KINDS.index("i32"))
            integers.append(item)
    return 0, [2, 3, 1, 4, 1, 0, 0, 0, 0], kinds, integers, [0.0] * len(kinds), []


@pytest.mark.parametrize("accum, row_stats", [(0, False), (1, False), (0, True), (1, True)])
def test_native_node_allocates_and_addresses_like_the_python_path(accum, row_stats):
    """The C++ autograd node on CPU tensors with launches recorded, not run: the forward hands its kernel q, k, v
    and fresh O and L; the backward copies a broadcast gradient into O's layout, allocates D, dK, dV and dQ (or
    the fp32 accumulator, cast into dQ afterwards), and with row statistics (fp32-accurate dots) each row's max
    and inverse sum, and hands them over; autograd keeps those very tensors as the inputs' .grad (no copy)."""
    from cs336_systems.kernels.flash_attention import native_launch

    module = native_launch.load_module()
    if module is None:
        pytest.skip("the native extension did not build here")
    q, k, v = (torch.randn(2, 3, 40, 16, requires_grad=True) for _ in range(3))
    forward = _dry_spec("q", "k", "v", "out", "lse", 7)
    dq_slot = "dq_accum" if accum else "dq"
    backward = _dry_spec("grad_out", "out", "lse", "delta", "dk", "dv", dq_slot, "row_max", "row_inv_sum")
    module.register_plan(q, k, v, True, 1, [forward], [backward], accum, 1.0, 128, 16, row_stats)
    module.set_recording(True)
    try:
        out = module.attention(q, k, v, True, 1)
        assert module.attention(q, k, v, False, 1) is None  # another signature: no plan
        assert out.shape == q.shape and out.stride() == q.stride() and "FlashAttentionNative" in out.grad_fn.name()
        out.sum().backward()  # a gradient of stride 0
        launches = module.recorded_launches()
    finally:
        module.set_recording(False)
    assert len(launches) == 2
    fwd, bwd = launches
    lse_address = fwd[4]
    assert fwd[:4] == [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()] and fwd[5] == 7
    assert fwd[6:] == [0, 0]  # no global scratch asked for; no profile scratch
    assert bwd[0] not in (0, out.data_ptr()) and bwd[0] % 16 == 0  # the copied gradient
    assert bwd[1:3] == [out.data_ptr(), lse_address]
    assert bwd[4:6] == [k.grad.data_ptr(), v.grad.data_ptr()]  # autograd kept dK and dV themselves
    if not accum:
        assert bwd[6] == q.grad.data_ptr()
    row_buffers = bwd[7:9]
    if row_stats:  # two fresh buffers of L's size, apart from every other tensor of the launch
        assert 0 not in row_buffers and len(set(row_buffers) | set(bwd[:7])) == 9
    else:
        assert row_buffers == [0, 0]
    assert q.grad.shape == q.shape and q.grad.dtype == q.dtype


@pytest.mark.parametrize("accum", [0, 2])
def test_native_operator_entry_points_run_a_plan_half_by_half(accum):
    """`forward` and `backward` (the registered operators' CUDA implementations under torch.compile) on CPU
    tensors with launches recorded: the forward hands its kernel q, k, v and fresh O and L and returns them; the
    backward takes O, L and the gradient it is given (in O's layout: no copy), allocates D, dK, dV and dQ (or the
    accumulator, cast and scaled into dQ) and returns them; no plan for another signature gives None."""
    from cs336_systems.kernels.flash_attention import native_launch

    module = native_launch.load_module()
    if module is None:
        pytest.skip("the native extension did not build here")
    q, k, v = (torch.randn(2, 3, 24, 16) for _ in range(3))
    forward = _dry_spec("q", "k", "v", "out", "lse", 5)
    dq_slot = "dq_accum" if accum else "dq"
    backward = _dry_spec("grad_out", "out", "lse", "delta", "dk", "dv", dq_slot)
    module.register_plan(q, k, v, False, 2, [forward], [backward], accum, 0.5, 32, 16, False)
    module.set_recording(True)
    try:
        assert module.forward(q, k, v, True, 2) is None and module.forward(q, k.transpose(-1, -2), v, False, 2) is None
        out, lse = module.forward(q, k, v, False, 2)
        grad_out = torch.randn_like(out)
        assert module.backward(q, k, v, out, lse, grad_out, True, 2) is None
        dq, dk, dv = module.backward(q, k, v, out, lse, grad_out, False, 2)
        launches = module.recorded_launches()
    finally:
        module.set_recording(False)
    assert out.shape == q.shape and out.stride() == q.stride() and lse.shape == q.shape[:-1]
    assert lse.dtype == torch.float32
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and dq.dtype == q.dtype
    assert len(launches) == 2
    fwd, bwd = launches
    assert fwd[:5] == [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()] and fwd[5] == 5
    assert bwd[:3] == [grad_out.data_ptr(), out.data_ptr(), lse.data_ptr()]
    assert bwd[4:6] == [dk.data_ptr(), dv.data_ptr()]
    if not accum:
        assert bwd[6] == dq.data_ptr()
    else:  # the accumulator (never written in a dry run) is its own buffer, not dQ
        assert bwd[6] not in (0, dq.data_ptr())


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_registered_operators_replay_native_plans(dtype, monkeypatch):
    """The operators torch.compile's graphs call take the native plans on CUDA: after the first call of a
    signature (which makes the plan) neither the forward nor the backward reaches the Python launch path, and the
    results are the Python path's, bit for bit."""
    from cs336_systems.kernels.flash_attention import dispatch, function

    _native_module()
    q, k, v = (t.detach() for t in _fresh_inputs(2, 3, 300, 300, 64, dtype, seed=0))
    grad_out = torch.randn_like(q)
    forward_op, backward_op = torch.ops.cs336.flash_attention_forward, torch.ops.cs336.flash_attention_backward
    out, lse = forward_op(q, k, v, True, "triton")  # makes the plan
    expected_out, expected_lse = dispatch.flash_forward(q, k, v, True)
    expected = function._attention_backward(q, k, v, expected_out, expected_lse, grad_out, True, "triton",
                                            function.dot_precision(dtype))

    def refuse(*args, **kwargs):
        raise AssertionError("the operator took the Python launch path")

    monkeypatch.setattr(dispatch, "flash_forward", refuse)
    monkeypatch.setattr(dispatch, "flash_backward", refuse)
    out, lse = forward_op(q, k, v, True, "triton")
    grads = backward_op(q, k, v, out, lse, grad_out, True, "triton")
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    for mine, theirs in zip(grads, expected):
        assert torch.equal(mine, theirs)


@requires_cuda
@pytest.mark.parametrize("backward", ["triton", "two-pass", "tl", "fused"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", PLAN_CASES)
def test_native_replay_matches_the_python_path(case, causal, backward):
    *shape, dtype = case
    _native_module()
    q, k, v = _fresh_inputs(*shape, dtype, seed=0)
    _attend(q, k, v, causal, backward, torch.randn_like(q), launcher="native")  # makes the native plan
    q, k, v = _fresh_inputs(*shape, dtype, seed=1)
    grad_out = torch.randn_like(q)
    from cs336_systems.kernels.flash_attention.function import flash_attention

    assert "FlashAttentionNative" in flash_attention(q, k, v, causal, backward=backward,
                                                     launcher="native").grad_fn.name()
    native = _attend(q, k, v, causal, backward, grad_out, launcher="native")
    _assert_same_results(native, _attend(q, k, v, causal, backward, grad_out, launcher="python"), backward)


@requires_cuda
def test_native_replay_on_head_views_and_a_broadcast_gradient():
    """The model's strided head views; `out.sum()`'s gradient has stride 0, so the C++ backward copies it into
    O's layout before its plan runs."""
    from cs336_systems.kernels.flash_attention.function import flash_attention

    _native_module()
    torch.manual_seed(0)
    qkv = torch.randn(2, 300, 3, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def attend(launcher):
        qkv.grad = None
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        out = flash_attention(q, k, v, True, launcher=launcher)
        out.float().sum().backward()
        return out.detach().clone(), qkv.grad.clone()

    attend("native")  # makes the plan
    native, python = attend("native"), attend("python")
    assert torch.equal(native[0], python[0]) and torch.equal(native[1], python[1])  # d 64: two passes


@requires_hopper
@pytest.mark.parametrize("launcher", ["native", "python"])
@pytest.mark.parametrize("layout", ["contiguous", "head-views"])
def test_plans_replay_host_descriptors_over_new_tensors(launcher, layout, monkeypatch):
    """With the Gluon passes on the host's tensor descriptors (CS336_FLASH_HOST_DESCRIPTORS=1), a replayed plan
    (the Python replay rebuilds each descriptor over its tensor's new address; the C++ one encodes a CUtensorMap per
    call) gives bit for bit what the normal launch path gives with the passes making their own descriptors. Shapes
    of their own: native plans outlive the test and do not know the switch."""
    from cs336_systems.kernels.flash_attention.function import flash_attention

    if launcher == "native":
        _native_module()
    heads, d = (3, 64) if layout == "contiguous" else (5, 128)

    def inputs(seed):
        torch.manual_seed(seed)
        if layout == "contiguous":
            return _fresh_inputs(2, heads, 333, 333, d, torch.bfloat16, seed)
        qkv = torch.randn(2, 331 if launcher == "native" else 329, 3, heads, d, device="cuda", dtype=torch.bfloat16,
                          requires_grad=True)
        return [qkv[:, :, i].transpose(1, 2) for i in range(3)], qkv

    def attend(seed, grad_seed):
        made = inputs(seed)
        q, k, v = made[0] if layout == "head-views" else made
        leaves = [made[1]] if layout == "head-views" else made
        out = flash_attention(q, k, v, True, backward="two-pass", launcher=launcher)
        torch.manual_seed(grad_seed)
        out.backward(torch.randn_like(out))
        return [out.detach().clone(), *(leaf.grad.clone() for leaf in leaves)]

    launch_plan.clear_plans()
    monkeypatch.setenv("CS336_FLASH_HOST_DESCRIPTORS", "1")
    try:
        attend(0, 10)  # makes the plans
        before = launch_plan.plan_count()
        replayed = attend(1, 11)  # new addresses and values
        assert launch_plan.plan_count() == before
    finally:
        launch_plan.clear_plans()
    monkeypatch.setenv("CS336_FLASH_HOST_DESCRIPTORS", "0")
    launch_plan.use_plans(False)
    try:
        direct = attend(1, 11)
    finally:
        launch_plan.use_plans(True)
    assert len(replayed) == len(direct)
    for mine, theirs in zip(replayed, direct):
        assert torch.equal(mine, theirs)


class _CountingMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Any dispatch mode: under one, attention takes the Python path (its op must be visible)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@requires_cuda
@pytest.mark.parametrize("mode_in_backward", [False, True])
def test_native_forward_under_checkpoint_recomputes_on_either_path(mode_in_backward):
    """A checkpointed region whose forward ran natively may be recomputed natively or, under a dispatch mode (a
    profiler, an op counter), through the Python Function. torch.utils.checkpoint matches saved tensors by
    position, so both save alike; the gradients are those of the uncheckpointed call."""
    from torch.utils.checkpoint import checkpoint

    from cs336_systems.kernels.flash_attention.function import flash_attention

    _native_module()
    q, k, v = _fresh_inputs(2, 4, 20, 20, 16, torch.float32, seed=0)
    grad_out = torch.randn_like(q)

    def region(q, k, v):
        return flash_attention(q * 1.5, k, v, True, backward="two-pass", launcher="native") * 2

    flash_attention(q.detach(), k.detach(), v.detach(), True, backward="two-pass", launcher="native")  # the plan
    expected = torch.autograd.grad(region(q, k, v), (q, k, v), grad_out)
    out = checkpoint(region, q, k, v, use_reentrant=False)
    with _CountingMode() if mode_in_backward else contextlib.nullcontext():
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
    for mine, theirs in zip(grads, expected):
        assert torch.equal(mine, theirs)


@requires_cuda
def test_making_a_native_plan_leaves_the_random_stream_alone():
    """The first call of a signature runs the Python path once to make its plan; it must not draw random numbers
    (it once drew a random gradient, so a test's next torch.randn differed with the launcher)."""
    from cs336_systems.kernels.flash_attention import native_launch

    _native_module()
    q, k, v = (t.detach() for t in _fresh_inputs(2, None, 1, 19, 16, torch.float32, seed=0))
    state = torch.cuda.get_rng_state(), torch.get_rng_state()
    assert native_launch.make_plan(q, k, v, True, "two-pass")
    assert torch.equal(torch.cuda.get_rng_state(), state[0]) and torch.equal(torch.get_rng_state(), state[1])


@requires_cuda
def test_native_launches_go_to_the_current_stream():
    module = _native_module()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert module.current_stream(torch.cuda.current_device()) == side.cuda_stream
    assert module.current_stream(torch.cuda.current_device()) == torch.cuda.current_stream().cuda_stream


@requires_cuda
def test_native_falls_back_for_aliased_inputs():
    from cs336_systems.kernels.flash_attention.function import flash_attention

    _native_module()
    x = torch.randn(1, 2, 170, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = flash_attention(x, x, x, True, launcher="native")
    assert "FlashAttentionNative" not in out.grad_fn.name()  # the Python path took it
    assert torch.equal(out, flash_attention(x, x, x, True, launcher="python"))


# Run in a fresh interpreter: in this test process earlier tests have run kernels on autograd's device thread,
# which hides the case this pins (the first backward of a process, whose device thread has run nothing yet).
FIRST_BACKWARD_SCRIPT = """
import sys, torch
from cs336_systems.kernels.flash_attention.function import flash_attention
torch.manual_seed(0)
shape = (4, 128, 64) if sys.argv[1] == "3d" else (2, 3, 200, 64)
q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
out = flash_attention(q, k, v, True, launcher="native")
assert "FlashAttentionNative" in out.grad_fn.name(), out.grad_fn.name()
grad_out = torch.randn_like(out)  # in O's layout: the backward launches on the device thread at once
dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
expected = torch.autograd.grad(flash_attention(q, k, v, True, launcher="python"), (q, k, v), grad_out)
torch.cuda.synchronize()
assert torch.equal(dk, expected[1]) and torch.equal(dv, expected[2])
assert (dq.float() - expected[0].float()).abs().max() < 1e-2
print("ok")
"""


@requires_cuda
@pytest.mark.parametrize("layout", ["3d", "4d"])
def test_native_first_backward_in_a_fresh_process(layout):
    """On the H200 this crashed the process (SIGSEGV on autograd's device thread) before the C++ launcher bound
    a CUDA context on threads that had none."""
    import subprocess
    import sys

    _native_module()  # built (and cached) here, so the child process only loads it
    result = subprocess.run([sys.executable, "-c", FIRST_BACKWARD_SCRIPT, layout], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        f"exit {result.returncode}: {result.stderr[-2000:]}")


def test_native_plans_stop_at_their_cap(monkeypatch):
    """Past MAX_NATIVE_PLANS no plan is made (nor the Python path run to make one): such calls take the Python
    path, whose plans are dropped oldest first."""
    from cs336_systems.kernels.flash_attention import dispatch, native_launch

    module = native_launch.load_module()
    if module is None:
        pytest.skip("the native extension does not build here")
    monkeypatch.setattr(native_launch, "MAX_NATIVE_PLANS", module.plan_count())

    def must_not_run(*args, **kwargs):
        raise AssertionError("make_plan ran the Python path past the cap")

    monkeypatch.setattr(dispatch, "flash_forward", must_not_run)
    x = torch.zeros(1, 1, 16, 16)
    assert native_launch.make_plan(x, x, x, True, "triton") is False


def test_native_takes_no_plan_with_launch_plans_off(monkeypatch):
    """Native plans are made from the Python ones: with plans off a call takes the normal path, and its signature
    is not marked unplannable for when plans are turned back on."""
    from cs336_systems.kernels.flash_attention import native_launch

    def must_not_run(*args, **kwargs):
        raise AssertionError("a native plan was looked up or made with launch plans off")

    monkeypatch.setattr(native_launch, "load_module", must_not_run)
    monkeypatch.setattr(native_launch, "make_plan", must_not_run)
    refused, was_enabled = set(native_launch._refused), launch_plan.plans_enabled()
    launch_plan.use_plans(False)
    try:
        x = torch.zeros(1, 1, 16, 16)
        assert native_launch.attention(x, x, x, True, "triton") is None
    finally:
        launch_plan.use_plans(was_enabled)
    assert native_launch._refused == refused


def test_unknown_launcher_is_rejected():
    from cs336_systems.kernels.flash_attention.function import flash_attention

    x = torch.zeros(1, 4, 16)
    with pytest.raises(ValueError, match="launcher must be one of python, native"):
        flash_attention(x, x, x, launcher="cuda-graph")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_small_kernels_replayed_equal_their_normal_launches(dtype):
    """RMSNorm, the SwiGLU gate (in place too), RoPE and the fused cross-entropy launch through
    `launch_plan.launch`: the third call of a signature (replayed) gives bit for bit what the normal path gives,
    at two shapes each (the second's plans made after the first's)."""
    from cs336_systems.kernels.cross_entropy import lm_head_cross_entropy
    from cs336_systems.kernels.rmsnorm import rmsnorm
    from cs336_systems.kernels.rope import rope
    from cs336_systems.kernels.swiglu import silu_mul

    def run_all(tokens: int, width: int):
        torch.manual_seed(tokens)
        x = torch.randn(2, tokens, width, device="cuda", dtype=dtype, requires_grad=True)
        w = torch.randn(width, device="cuda", dtype=dtype, requires_grad=True)
        a, b = (torch.randn(2, tokens, 3 * width, device="cuda", dtype=dtype) for _ in range(2))
        heads = torch.randn(2, 4, tokens, 32, device="cuda", dtype=dtype, requires_grad=True)
        angles = torch.arange(tokens, device="cuda")[:, None] / 10 ** torch.arange(16, device="cuda")
        cache = torch.stack((angles.cos(), angles.sin())).float()
        pos = torch.arange(tokens, device="cuda")
        head_w = torch.randn(1000, width, device="cuda", dtype=dtype, requires_grad=True)
        targets = torch.randint(0, 1000, (2, tokens), device="cuda")
        outs = [rmsnorm(x, w), rope(heads, pos, cache)]
        for in_place in (False, True):
            a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
            gate = silu_mul(a_ * 1, b_ * 1, backward_in_place=in_place)  # (non-leaf inputs, as in the model)
            gate.backward(torch.ones_like(gate))
            outs += [gate, a_.grad, b_.grad]
        loss = lm_head_cross_entropy(x, head_w, targets)
        (outs[0].sum() + outs[1].sum() + loss).backward()
        return [t.detach().clone() for t in (*outs, loss, x.grad, w.grad, heads.grad, head_w.grad)]

    launch_plan.use_plans(False)
    try:
        normal = [run_all(tokens, width) for tokens, width in ((64, 256), (37, 96))]
    finally:
        launch_plan.use_plans(True)
    launch_plan.clear_plans()
    for _ in range(3):
        replayed = [run_all(tokens, width) for tokens, width in ((64, 256), (37, 96))]
    assert launch_plan.plan_count() > 0
    for want_set, got_set in zip(normal, replayed):
        for want, got in zip(want_set, got_set):
            assert torch.equal(want, got)
