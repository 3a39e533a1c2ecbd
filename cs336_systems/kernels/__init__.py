"""Our kernels. Each op keeps four layers in one place: @triton.jit kernels -> a host launcher ->
a torch.autograd.Function -> a public function, with its PyTorch reference beside it.

Triton is imported lazily by the modules that launch kernels, so `cs336_systems` imports on a
machine without Triton; under TRITON_INTERPRET=1 the kernels also run on CPU tensors.
"""
