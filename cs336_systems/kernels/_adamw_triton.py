"""The Triton kernel of `adamw.FusedAdamW` (imported when a kernel runs: the CPU install has no Triton).

One program updates BLOCK elements of one tensor, which it looks up in the block table. A whole block whose
tensors all sit at 16-byte aligned addresses (the host checks: `ALIGNED`) runs unmasked with the alignment said to
the compiler, so each thread moves its elements in 16-byte loads and stores; masked or unhinted, the compiler
emits 4-byte ones (PTX `ld.global.b32`), and this kernel is bound by memory.
"""

import triton
import triton.language as tl


@triton.jit
def update_block(p_ptr, g_ptr, m_ptr, v_ptr, c_address, offs, mask, decay, beta1, beta2, eps, step_size,
                 bias2_sqrt, P_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr, C_DTYPE: tl.constexpr,
                 HAS_COPIES: tl.constexpr, TORCH_MATHS: tl.constexpr):
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    p = p * decay
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    if TORCH_MATHS:
        p = p - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
    else:
        p = p - step_size * m / (tl.sqrt(v) + eps)
    tl.store(p_ptr + offs, p.to(P_DTYPE), mask=mask)
    tl.store(m_ptr + offs, m.to(S_DTYPE), mask=mask)
    tl.store(v_ptr + offs, v.to(S_DTYPE), mask=mask)
    if HAS_COPIES:  # the weight's compute-dtype copy (address 0: this tensor has none)
        if c_address != 0:
            c_ptr = c_address.to(tl.pointer_type(C_DTYPE))
            if mask is None:
                c_ptr = tl.multiple_of(c_ptr, 16)
            tl.store(c_ptr + offs, p.to(C_DTYPE), mask=mask)

@triton.jit
def adamw_multi_tensor_kernel(p_ptrs, g_ptrs, m_ptrs, v_ptrs, c_ptrs, t_ptrs, sizes, block_tensor, block_start,
                              decay, beta1, beta2, eps, step_size, bias2_sqrt, lr, P_DTYPE: tl.constexpr,
                              G_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr, C_DTYPE: tl.constexpr,
                              HAS_COPIES: tl.constexpr, TORCH_MATHS: tl.constexpr, CAPTURABLE: tl.constexpr,
                              ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    block = tl.program_id(0)
    tensor = tl.load(block_tensor + block)
    if CAPTURABLE:  # the bias corrections from the tensor's step count on the device (already advanced)
        t = tl.load(tl.load(t_ptrs + tensor).to(tl.pointer_type(tl.float32)))
        bias1 = 1.0 - tl.exp2(t * tl.log2(beta1))  # beta ** t; a beta of 0 gives log2 -inf, so 0
        bias2 = 1.0 - tl.exp2(t * tl.log2(beta2))
        bias2_sqrt = tl.sqrt(bias2)
        if TORCH_MATHS:
            step_size = lr / bias1
        else:
            step_size = lr * bias2_sqrt / bias1
    start = tl.multiple_of(tl.load(block_start + block), BLOCK)
    size = tl.load(sizes + tensor)
    offs = start + tl.arange(0, BLOCK)
    p_ptr = tl.load(p_ptrs + tensor).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(g_ptrs + tensor).to(tl.pointer_type(G_DTYPE))
    m_ptr = tl.load(m_ptrs + tensor).to(tl.pointer_type(S_DTYPE))
    v_ptr = tl.load(v_ptrs + tensor).to(tl.pointer_type(S_DTYPE))
    c_address = 0
    if HAS_COPIES:
        c_address = tl.load(c_ptrs + tensor)
    if ALIGNED and start + BLOCK <= size:
        # A whole block at 16-byte aligned addresses, said so to the compiler: no mask, so each thread moves its
        # elements in 16-byte loads and stores (masked or unhinted, they are 4-byte ones: PTX ld.global.b32).
        update_block(tl.multiple_of(p_ptr, 16), tl.multiple_of(g_ptr, 16), tl.multiple_of(m_ptr, 16),
                     tl.multiple_of(v_ptr, 16), c_address, offs, None, decay, beta1, beta2, eps, step_size,
                     bias2_sqrt, P_DTYPE, S_DTYPE, C_DTYPE, HAS_COPIES, TORCH_MATHS)
    else:  # a tensor's last, partial block, or addresses the host did not find aligned
        update_block(p_ptr, g_ptr, m_ptr, v_ptr, c_address, offs, offs < size, decay, beta1, beta2, eps,
                     step_size, bias2_sqrt, P_DTYPE, S_DTYPE, C_DTYPE, HAS_COPIES, TORCH_MATHS)

