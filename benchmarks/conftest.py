"""The benchmarks run the compiled kernels on a GPU; on a CPU they compare the CPU paths only."""

import os

import torch

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # only the kernels' import needs it; CPU cases use the torch path
