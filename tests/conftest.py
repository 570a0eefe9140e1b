"""Test set-up: without a GPU the Triton kernels run in Triton's interpreter.

TRITON_INTERPRET must be set before triton is imported, so it is set here, at collection.
On a machine with CUDA the kernels are compiled and run natively instead.
"""

import os

# Torch's OpenMP threads wait passively: set before torch loads (OpenMP reads it once), so that a test run sharing
# the machine with another busy process does not spin against it (the CLI does the same: training.cli)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

# Triton 3.9 warns that this default will change; keep today's (fused multiply-add on).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE
