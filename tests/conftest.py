"""Without a GPU, run our Triton kernels through Triton's interpreter on CPU tensors.

The flag must be set before any kernel module is imported (Triton reads it when a kernel
is decorated), hence here. Tests that need the interpreter skip cleanly if it is off.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
