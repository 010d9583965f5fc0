"""Repository-level test set-up.

Triton decides between compiling and interpreting when a kernel is defined, so the interpreter switch has to be
set before anything imports ``flashlite.kernels``; doing it here covers every test module.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["pytester"]
