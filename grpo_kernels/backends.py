"""The two backends behind one interface: the Triton launchers and the chunked torch path answer the same
calls with the same result types, so nothing above this module branches on which one runs.

No autograd here: the autograd Functions (``functions.py``, ``vocab_parallel.py``) call these with plain
tensors. Per-token values are fp32 [N]. Every call computes log softmax(cap(x) / temperature) of raw logits x,
cap(x) = softcap * tanh(x / softcap) with a head's soft-cap, x itself with ``softcap`` None (the default). The
fused loss kernels (the per-token loss math inside the logits pass) exist on Triton only: ``fuses_loss`` says
whether a backend has them, and the sources (``sources.py``) call them through ``launch`` / ``lm_head_launch``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from . import ops, torch_path
from .kernels.contracts import TokenInputs, launch_module, lm_head_launch_module


class LogprobResult(NamedTuple):
    logp: torch.Tensor  # fp32 [N], 0 at masked tokens
    entropy: Optional[torch.Tensor]  # fp32 [N] (0 at masked tokens) or None
    lse: torch.Tensor  # fp32 [N], what the backward reads
    ids: torch.Tensor  # the ids the backward reads: masked ones may be replaced (any id is allowed there)


class TorchBackend:
    """The chunked torch path (CPU, or CUDA without triton)."""

    name = "torch"
    fuses_loss = False

    def logprobs(self, logits, ids, temperature: float, mask: Optional[torch.Tensor],
                 compute_entropy: bool, softcap: Optional[float] = None) -> LogprobResult:
        """log softmax(cap(logits) / temperature)[ids] (and entropy) of logits [B, T, V]; ``mask`` fp32 [N] or None."""
        B, T, _ = logits.shape
        active = None if mask is None else (mask != 0).view(B, T)
        if active is not None:  # masked ids may be anything (-100): gather and scatter get 0 there
            ids = torch.where(active, ids, 0)
        if torch.compiler.is_compiling():  # one opaque op in the graph (ops.py): no unrolled chunk loop
            logp, entropy, lse = ops.torch_logprobs(logits, ids, temperature, softcap, compute_entropy)
            entropy = ops.present(entropy, compute_entropy)
        else:
            logp, entropy, lse = torch_path.forward(logits, ids, temperature, compute_entropy, softcap)
        if active is not None:
            logp = torch.where(active, logp, 0.0)
            entropy = None if entropy is None else torch.where(active, entropy, 0.0)
        flat = lambda t: None if t is None else t.reshape(-1)  # noqa: E731
        return LogprobResult(flat(logp), flat(entropy), flat(lse), ids)

    def logprobs_backward(self, logits, ids, lse, g, temperature: float, *, out: torch.Tensor,
                          grad_entropy: Optional[torch.Tensor] = None, entropy: Optional[torch.Tensor] = None,
                          softcap: Optional[float] = None):
        """dlogits of g = dLoss/dlogp (and h = dLoss/dH) written into ``out`` [B, T, V]."""
        B, T, _ = logits.shape
        as_bt = lambda t: None if t is None else t.to(lse.dtype).reshape(B, T)  # noqa: E731  (fp32, or fp64)
        if torch.compiler.is_compiling():
            return out.copy_(ops.torch_logprobs_backward(logits, ids, lse.reshape(B, T), as_bt(g), temperature,
                                                         softcap, as_bt(grad_entropy), as_bt(entropy)))
        return torch_path.backward(logits, ids, lse.reshape(B, T), as_bt(g), temperature, out=out,
                                   grad_entropy=as_bt(grad_entropy), entropy=as_bt(entropy), softcap=softcap)

    def linear_logprobs(self, hidden, weight, bias, ids, temperature: float, compute_entropy: bool,
                        softcap: Optional[float] = None) -> LogprobResult:
        """The same from hidden [N, H] and the lm_head weight [V, H] (bias [V] or None), a chunk at a time."""
        if torch.compiler.is_compiling():
            lse, logp, entropy = ops.torch_linear_logprobs(hidden, weight, bias, ids, temperature, softcap,
                                                           compute_entropy)
            return LogprobResult(logp, ops.present(entropy, compute_entropy), lse, ids)
        lse, logp, entropy = torch_path.linear_forward(hidden, weight, bias, ids, temperature, compute_entropy, softcap)
        return LogprobResult(logp, entropy, lse, ids)

    def linear_backward(self, hidden, weight, bias, ids, lse, g, temperature: float, compute_weight_grad: bool,
                        grad_entropy=None, entropy=None, softcap: Optional[float] = None):
        """(d hidden, d weight or None, d bias or None), fp32."""
        if torch.compiler.is_compiling():
            dh, dw, db = ops.torch_linear_backward(hidden, weight, bias, ids, lse, g, temperature, softcap,
                                                   compute_weight_grad, grad_entropy, entropy)
            return dh, ops.present(dw, compute_weight_grad), ops.present(db, compute_weight_grad and bias is not None)
        return torch_path.linear_backward(hidden, weight, bias, ids, lse, g, temperature, compute_weight_grad,
                                          grad_entropy=grad_entropy, entropy=entropy, softcap=softcap)


class TritonBackend:
    """The Triton kernels (CUDA, or CPU tensors in Triton's interpreter)."""

    name = "triton"
    fuses_loss = True

    # the launcher modules, imported on first use (they need triton; the CPU path does not), then plain
    # attributes of the one instance: a call reads them without entering this module
    @functools.cached_property
    def launch(self):
        return launch_module()

    @functools.cached_property
    def lm_head_launch(self):
        return lm_head_launch_module()

    def logprobs(self, logits, ids, temperature: float, mask: Optional[torch.Tensor],
                 compute_entropy: bool, softcap: Optional[float] = None) -> LogprobResult:
        if torch.compiler.is_compiling():  # one opaque op in the graph (ops.py)
            logp, entropy, lse = ops.triton_logprobs(logits, ids, temperature, softcap, mask, compute_entropy)
            return LogprobResult(logp, ops.present(entropy, compute_entropy), lse, ids)
        r = self.launch.forward(logits, ids, temperature=temperature, softcap=softcap, tokens=TokenInputs(mask=mask),
                                compute_entropy=compute_entropy)
        return LogprobResult(r.logp, r.entropy, r.lse, ids)  # the kernels never read a masked row's id

    def logprobs_backward(self, logits, ids, lse, g, temperature: float, *, out: torch.Tensor,
                          grad_entropy: Optional[torch.Tensor] = None, entropy: Optional[torch.Tensor] = None,
                          softcap: Optional[float] = None):
        flat = lambda t: None if t is None else t.reshape(-1).float().contiguous()  # noqa: E731
        if torch.compiler.is_compiling():
            ops.triton_logprobs_backward(logits, ids, lse.reshape(-1), flat(g), temperature, softcap, out,
                                         flat(grad_entropy), flat(entropy) if grad_entropy is not None else None)
            return out
        return self.launch.backward(logits, ids, lse.reshape(-1), flat(g), temperature, softcap=softcap, out=out,
                                    grad_entropy=flat(grad_entropy),
                                    entropy=flat(entropy) if grad_entropy is not None else None)

    def linear_logprobs(self, hidden, weight, bias, ids, temperature: float, compute_entropy: bool,
                        softcap: Optional[float] = None) -> LogprobResult:
        if torch.compiler.is_compiling():
            lse, logp, entropy = ops.triton_linear_logprobs(hidden, weight, bias, ids, temperature, softcap,
                                                            compute_entropy)
            return LogprobResult(logp, ops.present(entropy, compute_entropy), lse, ids)
        r = self.lm_head_launch.linear_forward(hidden, weight, bias, ids, temperature=temperature, softcap=softcap,
                                               compute_entropy=compute_entropy)
        return LogprobResult(r.logp, r.entropy, r.lse, ids)

    def linear_backward(self, hidden, weight, bias, ids, lse, g, temperature: float, compute_weight_grad: bool,
                        grad_entropy=None, entropy=None, softcap: Optional[float] = None):
        if torch.compiler.is_compiling():
            dh, dw, db = ops.triton_linear_backward(hidden, weight, bias, ids, lse, g, temperature, softcap,
                                                    compute_weight_grad, grad_entropy, entropy)
            return dh, ops.present(dw, compute_weight_grad), ops.present(db, compute_weight_grad and bias is not None)
        return self.lm_head_launch.linear_backward(hidden, weight, bias, ids, lse, g, temperature,
                                                   compute_weight_grad, grad_entropy=grad_entropy, entropy=entropy,
                                                   softcap=softcap)


_BACKENDS = {"torch": TorchBackend(), "triton": TritonBackend()}


# The backend object of a resolved backend name ('triton' or 'torch'; see ``validation.resolve_backend``): the
# dict's own lookup, asked on every call, so that it runs no Python.
get_backend = _BACKENDS.__getitem__
