"""Fused AdamW in Triton: one pass over each parameter reads p, g, m, v once and writes p, m, v once.

Two update rules, chosen by `maths`:
* "cs336": the staff/cs336_basics AdamW: p -= lr*wd*p; p -= lr*sqrt(1-b2^t)/(1-b1^t) * m/(sqrt(v)+eps).
* "torch": torch.optim.AdamW: the same decay, then p -= lr/(1-b1^t) * m/(sqrt(v)/sqrt(1-b2^t) + eps).
State (m, v) is fp32 or bf16 (`state_dtype`); arithmetic is fp32 in registers either way. A parameter with a
`compute_copy` (`cs336_systems.weight_copies`: its bf16 or fp16 twin that the products read) has it written in the
same pass, from the updated value (2 bytes more written an element).

Memory-bound: 16 bytes read and 12 written per fp32 element, BLOCK=1024 elements per program, in 16-byte loads
and stores where the tensors' addresses allow (`_adamw_triton`).
Two launch schemes (`multi_tensor`):
* multi-tensor (default): one launch per (parameter dtype, step count) over *all* parameters
  of a param group. Each program looks up which tensor it works on from a block table
  (tensor index, first element), and that tensor's p/g/m/v addresses from pointer tables
  (int64 addresses, cast to pointers in the kernel). The block table and the p/m/v tables are
  cached (keyed by the tensors' addresses), and so is the gradient table, for the gradients' addresses
  (zero_grad(set_to_none) gives new gradient tensors, mostly at the addresses of the last step's). A model
  with hundreds of small tensors then costs one launch, not hundreds.
* per tensor: the same kernel launched once per parameter (for comparison and tests).
Runs under TRITON_INTERPRET=1 on CPU tensors for the tests; on the CPU otherwise the same update in torch.

`capturable=True` makes `step()` something a CUDA graph can hold (`cs336_systems.step_graph`): each parameter's step
count is a device tensor (state "t"), advanced on the device, and the kernel forms the bias corrections from it, where
the default passes them as host numbers that a graph would freeze at their capture-time values. The launch tables
are device tensors built from host lists, which a capture cannot copy: `prepare_capture()` builds them for the
gradients the captured backward left (outside the capture), and a capture that would need a new one is refused.
The learning rate and weight decay are read on the host at capture, as torch's capturable AdamW reads a float lr.
"""

from __future__ import annotations

import math

import torch

from cs336_systems.kernels._triton_utils import check_operator_device, runs_kernel

MATHS = ("cs336", "torch")
BLOCK = 1024  # elements per program
NUM_WARPS = 4
VECTORISE = True  # 16-byte loads and stores where the addresses allow (False: the masked 4-byte form everywhere)
GRADIENT_TABLES = 8  # gradient address tables kept (per optimizer): several groups and dtype batches each have one


def _kernel():
    from cs336_systems.kernels import _adamw_triton  # (Triton imported only when a kernel runs)

    return _adamw_triton.adamw_multi_tensor_kernel


def _check_copy(p: torch.Tensor, copy: torch.Tensor | None) -> None:
    """A parameter's compute-dtype copy (`weight_copies`) must match it: where the kernel writes it, it is the
    parameter's twin element for element."""
    if copy is not None and (copy.shape != p.shape or copy.device != p.device or not copy.is_contiguous()):
        raise ValueError(f"FusedAdamW: a parameter's compute_copy must match it (shape {tuple(p.shape)}, device "
                         f"{p.device}, contiguous), got shape {tuple(copy.shape)} on {copy.device}")


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _aligned(addresses) -> bool:
    """Whether every address is a multiple of 16 bytes, as the kernel's 16-byte loads need (a fresh tensor's is;
    a view's need not be)."""
    return all(address % 16 == 0 for address in addresses)


def _addresses(tensors, device) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


class FusedAdamW(torch.optim.Optimizer):
    """AdamW with the update in one Triton kernel over a group's parameters. State keys: m, v, t (as cs336_basics)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 *, maths: str = "cs336", state_dtype: torch.dtype = torch.float32, multi_tensor: bool = True,
                 capturable: bool = False):
        if maths not in MATHS:
            raise ValueError(f"FusedAdamW: maths must be one of {', '.join(MATHS)}, got {maths!r}")
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"FusedAdamW: state_dtype must be float32 or bfloat16, got {state_dtype}")
        if lr < 0 or eps <= 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"FusedAdamW: invalid hyper-parameters lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        self.maths, self.state_dtype, self.multi_tensor = maths, state_dtype, multi_tensor
        self.capturable = capturable  # step counts on the device: step() can be captured in a CUDA graph
        self._tables_cache: dict[tuple, tuple[torch.Tensor, ...]] = {}  # tensor addresses -> launch tables
        self._gradient_tables: dict[tuple, tuple] = {}  # gradient addresses -> (their table, aligned), newest last
        self._captured_gradient_tables: list[torch.Tensor] = []  # those a captured step reads (prepare_capture)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.capturable and _capturing():
            raise RuntimeError("FusedAdamW: step() is being captured in a CUDA graph, but this optimizer passes its "
                               "bias corrections as host numbers that the graph would freeze: make it with "
                               "capturable=True")
        for group, batches in self._batches(initialise=True):
            for params, states, copies in batches.values():
                if self.capturable:
                    torch._foreach_add_([state["t"] for state in states], 1.0)
                else:
                    for state in states:
                        state["t"] += 1
                self._launch(params, states, copies, group)
        return loss

    @torch.no_grad()
    def prepare_capture(self) -> None:
        """Build the launch tables for the parameters' current gradients, outside a CUDA graph's capture (which
        cannot copy them to the device): call it after the captured backward, before capturing `step()`."""
        if not self.capturable:
            raise RuntimeError("FusedAdamW.prepare_capture: make the optimizer with capturable=True")
        for _group, batches in self._batches(initialise=False):
            for params, states, copies in batches.values():
                if runs_kernel(params[0]):
                    self._tables(params, states, copies)
                    # held here for good: a graph reads this table's memory at every replay, so the gradient
                    # tables' eviction (GRADIENT_TABLES) must never free it
                    self._captured_gradient_tables.append(self._gradient_table(params)[0])

    def _batches(self, initialise: bool):
        """(group, {launch key: (params, states, copies)}) per param group, over the parameters with gradients;
        their state made where it is missing (`initialise`) or refused.

        Host time matters here: a small model's CUDA-graph step is about 9 ms, and this loop visits every parameter
        each step. So each parameter's state is looked up once, its device checked on its first step (and again
        only if its gradient's device differs), its copy validated where the launch tables are built."""
        for group in self.param_groups:
            batches: dict[tuple, tuple[list, list, list]] = {}
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if not (p.is_contiguous() and grad.is_contiguous()):
                    raise ValueError("FusedAdamW: parameters and gradients must be contiguous")
                state = self.state[p]
                if not state:
                    if not initialise:
                        raise RuntimeError("FusedAdamW.prepare_capture: run a step first (the state a graph updates "
                                           "must exist before its capture)")
                    check_operator_device("FusedAdamW", p, grad)
                    state["m"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["v"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["t"] = torch.zeros((), dtype=torch.float32, device=p.device) if self.capturable else 0
                elif grad.device != p.device:
                    check_operator_device("FusedAdamW", p, grad)
                if self.capturable and not isinstance(state["t"], torch.Tensor):  # (made capturable after steps)
                    state["t"] = torch.tensor(float(state["t"]), dtype=torch.float32, device=p.device)
                copy = getattr(p, "compute_copy", None)
                # One launch per (device, dtypes, step count): the scalars are shared. Capturable: the step counts
                # are read on the device, each tensor its own, so they need not match.
                key = (p.device, p.dtype, grad.dtype, None if copy is None else copy.dtype,
                       None if self.capturable else state["t"] + 1)
                if not self.multi_tensor:
                    key += (len(batches),)
                params, states, copies = batches.setdefault(key, ([], [], []))
                params.append(p)
                states.append(state)
                copies.append(copy)
            yield group, batches

    def _update_eagerly(self, params, states, copies, group) -> None:
        """The kernel's update in torch, fp32 in between (the CPU without Triton's interpreter)."""
        for p, state, copy in zip(params, states, copies):
            decay, beta1, beta2, eps, step_size, bias2_sqrt = self._scalars(group, int(state["t"]))
            g = p.grad.float()
            m = state["m"].float().mul_(beta1).add_(g, alpha=1 - beta1)
            v = state["v"].float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denominator = v.sqrt().div_(bias2_sqrt).add_(eps) if self.maths == "torch" else v.sqrt().add_(eps)
            p.copy_(p.float().mul_(decay).addcdiv_(m, denominator, value=-step_size))
            if copy is not None:
                copy.copy_(p)
            state["m"].copy_(m)
            state["v"].copy_(v)

    def _scalars(self, group, t: int):
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        bias1, bias2 = 1 - beta1**t, 1 - beta2**t
        step_size = lr / bias1 if self.maths == "torch" else lr * math.sqrt(bias2) / bias1
        return 1 - lr * wd, beta1, beta2, eps, step_size, math.sqrt(bias2)

    def _tables(self, params, states, copies) -> tuple:
        """(sizes, block tensor index, block start, p/m/v/copy/step-count addresses, whether all of p/m/v/copy are
        16-byte aligned) of `params`, built once per set of tensors (the copies checked against their parameters
        then)."""
        key = tuple((p.data_ptr(), s["m"].data_ptr(), s["v"].data_ptr(), p.numel(), 0 if c is None else c.data_ptr(),
                     s["t"].data_ptr() if self.capturable else 0)
                    for p, s, c in zip(params, states, copies))
        if key not in self._tables_cache:
            _refuse_while_capturing("its launch tables")
            for p, copy in zip(params, copies):
                _check_copy(p, copy)
            device = params[0].device
            tensor_of_block, start_of_block = [], []
            for i, p in enumerate(params):
                starts = range(0, p.numel(), BLOCK)
                tensor_of_block += [i] * len(starts)
                start_of_block += starts
            self._tables_cache[key] = (
                torch.tensor([p.numel() for p in params], dtype=torch.int64, device=device),
                torch.tensor(tensor_of_block, dtype=torch.int32, device=device),
                torch.tensor(start_of_block, dtype=torch.int64, device=device),
                _addresses(params, device), _addresses([s["m"] for s in states], device),
                _addresses([s["v"] for s in states], device),
                torch.tensor([0 if c is None else c.data_ptr() for c in copies], dtype=torch.int64, device=device),
                torch.tensor([s["t"].data_ptr() if self.capturable else 0 for s in states], dtype=torch.int64,
                             device=device),
                _aligned(address for entry in key for address in entry[:3] + entry[4:5]))  # (p, m, v, copy)
        return self._tables_cache[key]

    def _gradient_table(self, params) -> tuple[torch.Tensor, bool]:
        """The gradients' addresses on the device, and whether all are 16-byte aligned. zero_grad(set_to_none=True)
        makes new gradient tensors each step, but the caching allocator mostly hands back the same addresses: a table
        is reused for the same addresses (its content is exactly them), so most steps copy nothing to the device and
        never wait on it."""
        key = tuple(p.grad.data_ptr() for p in params)
        entry = self._gradient_tables.pop(key, None)
        if entry is None:
            _refuse_while_capturing("the gradients' address table")
            entry = _addresses([p.grad for p in params], params[0].device), _aligned(key)
        self._gradient_tables[key] = entry  # most recent last
        while len(self._gradient_tables) > GRADIENT_TABLES:
            self._gradient_tables.pop(next(iter(self._gradient_tables)))
        return entry

    def _launch(self, params, states, copies, group) -> None:
        if not runs_kernel(params[0]):
            for p, copy in zip(params, copies):
                _check_copy(p, copy)
            self._update_eagerly(params, states, copies, group)
            return
        sizes, block_tensor, block_start, p_addr, m_addr, v_addr, c_addr, t_addr, aligned = self._tables(
            params, states, copies)
        copy = next((c for c in copies if c is not None), None)  # (one batch: one copy dtype)
        if not block_tensor.numel():
            return
        # Capturable: the step size and bias2_sqrt arguments are unused (the kernel forms them from the step count)
        scalars = self._scalars(group, 1 if self.capturable else states[0]["t"])
        g_addr, gradients_aligned = self._gradient_table(params)
        _kernel()[(block_tensor.numel(),)](
            p_addr, g_addr, m_addr, v_addr, c_addr, t_addr,
            sizes, block_tensor, block_start, *scalars, group["lr"],
            P_DTYPE=_tl_dtype(params[0].dtype), G_DTYPE=_tl_dtype(params[0].grad.dtype),
            S_DTYPE=_tl_dtype(self.state_dtype), C_DTYPE=_tl_dtype(copy.dtype if copy is not None else torch.float32),
            HAS_COPIES=copy is not None, TORCH_MATHS=self.maths == "torch", CAPTURABLE=self.capturable,
            ALIGNED=VECTORISE and aligned and gradients_aligned, BLOCK=BLOCK, num_warps=NUM_WARPS)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _refuse_while_capturing(what: str) -> None:
    if _capturing():
        raise RuntimeError(f"FusedAdamW: a CUDA graph capture of step() needs {what} built first, and a capture "
                           "cannot copy it to the device: call optimizer.prepare_capture() after the captured "
                           "backward, before capturing step()")
