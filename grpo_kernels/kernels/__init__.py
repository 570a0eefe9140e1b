"""The kernel tier: the Triton kernels (``x.py``), beside each its launchers (``x_launch.py``: ``logits_launch.py``,
``reduce_launch.py``, ``fused_linear_launch.py``, ``split_row_launch.py``, ``kept_launch.py``), the ``@triton.jit``
functions they share (``token_math.py``, ``logsumexp.py``) and the host-kernel contracts (``contracts.py``, which
needs no Triton). Nothing here imports the front end.

The front end reaches the launchers through the four names below, plain imports where triton is installed. Where it
is absent (macOS, Windows) the package still imports and the torch path runs: each name then stands for its module
and says, when the Triton backend is asked for, what to install.
"""

from __future__ import annotations


class TritonMissing:
    """A launcher module's stand-in where triton is not installed: any attribute names what to install."""

    def __init__(self, module: str, missing: ImportError):
        self._module, self._missing = module, missing

    def error(self, name: str = "") -> ImportError:
        what = f"grpo_kernels.kernels.{self._module}{'.' + name if name else ''}"
        error = ImportError(
            "the Triton backend needs the triton package (pip install triton: Linux, with a CUDA GPU, or "
            "TRITON_INTERPRET=1 for its CPU interpreter); backend='torch' (the default for CPU tensors) works "
            f"without it ({what}: {self._missing})"
        )
        error.__cause__ = self._missing
        return error

    def __getattr__(self, name: str):
        raise self.error(name)


def _triton_is_missing(error: ModuleNotFoundError) -> bool:
    return error.name is not None and (error.name == "triton" or error.name.startswith("triton."))


try:
    from . import fused_linear_launch, kept_launch, logits_launch, reduce_launch
except ModuleNotFoundError as missing:  # only triton's absence; any other import error is a bug, raised
    if not _triton_is_missing(missing):
        raise
    fused_linear_launch = TritonMissing("fused_linear_launch", missing)
    kept_launch = TritonMissing("kept_launch", missing)
    logits_launch = TritonMissing("logits_launch", missing)
    reduce_launch = TritonMissing("reduce_launch", missing)
