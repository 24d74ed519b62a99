"""Shared setup of the Triton kernel tests: the interpreter on CPU (conftest sets
TRITON_INTERPRET before anything imports triton), real shapes only with CUDA."""

import pytest
import torch

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
real = pytest.mark.skipif(not CUDA, reason="real shapes need CUDA")
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
