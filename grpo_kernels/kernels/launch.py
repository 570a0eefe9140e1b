"""Host launchers for the Triton kernels: tensor layout, block size, grid, constexprs.

No autograd here: ``forward`` and ``backward`` take and return plain tensors; the
autograd Functions in ``grpo_kernels.functions`` call them.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch
import triton

from ..options import PPO_CLIP_LOSS_TYPES, GRPOOptions
from . import grpo as K


def block_config(vocab_size: int, element_size: int) -> Dict[str, int]:
    """Block size over the vocabulary and warp count, from V and the logit width.

    Why: one program streams one row, so each loop iteration must keep enough bytes in
    flight. 8 KiB per iteration (4096 bf16/fp16 or 2048 fp32 logits) over 8 warps gives
    every thread two 128-bit loads (16 bf16 or 8 fp32 values) per iteration, which keeps
    the live registers of the fp32 math (x, exp, the where) well under the spill limit
    (checked by tests/test_aot_compile.py). A vocabulary smaller than the block gets one
    block covering the row, with the warps scaled down so that each thread still issues
    two 128-bit loads. The loop runs ceil(V / BLOCK_V) times: 38 at V = 151,936 in bf16.
    """
    max_block = 4096 if element_size <= 2 else 2048
    block = min(max_block, triton.next_power_of_2(vocab_size))
    elements_per_128_bits = 16 // element_size
    num_warps = max(1, min(8, block // (32 * elements_per_128_bits * 2)))
    return {"BLOCK_V": block, "num_warps": num_warps}


@dataclasses.dataclass
class ForwardResult:
    logp: torch.Tensor  # fp32 [N]
    entropy: Optional[torch.Tensor]  # fp32 [N] or None
    lse: torch.Tensor  # fp32 [N], saved for the backward
    loss: Optional[torch.Tensor]  # fp32 [N] per-token loss (None when LOSS_KIND == 0)
    dloss_dlogp: Optional[torch.Tensor]  # fp32 [N]
    kl: Optional[torch.Tensor]  # fp32 [N] or None
    flags: Optional[torch.Tensor]  # int8 [N]
    grad_logits: Optional[torch.Tensor] = None  # [B, T, V] in the logits' dtype (one-pass mode)


def loss_kind(opts: Optional[GRPOOptions]) -> int:
    if opts is None:
        return K.LOSS_NONE
    if opts.loss_type in PPO_CLIP_LOSS_TYPES:
        return K.LOSS_PPO_CLIP
    return K.LOSS_CISPO if opts.loss_type == "cispo" else K.LOSS_SAPO


def forward_constexprs(
    opts: Optional[GRPOOptions], *, has_old: bool, has_iw: bool, has_mask: bool, compute_entropy: bool,
    write_grad: bool = False,
) -> Dict[str, object]:
    """The compile-time flags of one forward specialization."""
    kind = loss_kind(opts)
    with_loss = kind != K.LOSS_NONE
    return {
        "LOSS_KIND": kind,
        "HAS_OLD": with_loss and has_old,
        "HAS_KL": with_loss and opts.uses_kl,
        "KL_KIND": {"k3": K.KL_K3, "k1": K.KL_K1, "k2": K.KL_K2}[opts.kl_estimator] if with_loss else 0,
        "HAS_DELTA": with_loss and opts.delta is not None,
        "HAS_DUAL_CLIP": with_loss and opts.dual_clip is not None,
        "HAS_LOG_RATIO_CLAMP": with_loss and opts.log_ratio_clamp is not None,
        "HAS_KL_CLAMP": with_loss and opts.kl_clamp is not None,
        "BIAS_CORRECTION_KL": with_loss and opts.use_bias_correction_kl,
        "HAS_IW": with_loss and has_iw,
        "HAS_MASK": has_mask,
        "COMPUTE_ENTROPY": compute_entropy,
        "WRITE_GRAD": with_loss and write_grad,
    }


def row_alignment(*tensors: torch.Tensor) -> int:
    """Elements per 16 bytes if every row of every tensor starts 16-byte aligned, else 1.

    True for the common vocabularies (32000, 128256, 151936 are multiples of 8), whatever
    T is, so it does not change (and recompile) from step to step.
    """
    size = tensors[0].element_size()
    aligned = all(t.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in t.stride()[:-1]) for t in tensors)
    return 16 // size if aligned else 1


def _zero_if_none(value: Optional[float]) -> float:
    return 0.0 if value is None else float(value)


def forward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    opts: Optional[GRPOOptions] = None,
    temperature: float = 1.0,
    mask: Optional[torch.Tensor] = None,
    advantages: Optional[torch.Tensor] = None,
    old_logps: Optional[torch.Tensor] = None,
    ref_logps: Optional[torch.Tensor] = None,
    importance_weights: Optional[torch.Tensor] = None,
    compute_entropy: bool = False,
    grad_weight: Optional[torch.Tensor] = None,
) -> ForwardResult:
    """Run the forward kernel.

    logits [B, T, V] with a unit last stride; ids [B, T]; every other per-token input is
    a contiguous fp32 [N] (N = B * T). With ``opts`` None only log-probs (and entropy)
    are computed. With ``grad_weight`` (fp32 [N], each token's weight in the reduced loss)
    the kernel also writes dlogits of that loss in the same pass (one-pass mode).
    """
    B, T, V = logits.shape
    N = B * T
    device = logits.device
    f32 = dict(device=device, dtype=torch.float32)
    kind = loss_kind(opts)
    logp = torch.empty(N, **f32)
    lse = torch.empty(N, **f32)
    entropy = torch.empty(N, **f32) if compute_entropy else None
    loss = dloss = kl = flags = None
    if kind != K.LOSS_NONE:
        loss = torch.empty(N, **f32)
        dloss = torch.empty(N, **f32)
        flags = torch.empty(N, device=device, dtype=torch.int8)
        if opts.uses_kl:
            kl = torch.empty(N, **f32)
    dummy = logp  # stands in for absent pointers; the constexprs keep it unread
    write_grad = grad_weight is not None and kind != K.LOSS_NONE
    grad = torch.empty((B, T, V), device=device, dtype=logits.dtype) if write_grad else None
    constexprs = forward_constexprs(
        opts, has_old=old_logps is not None, has_iw=importance_weights is not None,
        has_mask=mask is not None, compute_entropy=compute_entropy, write_grad=write_grad,
    )
    config = block_config(V, logits.element_size())
    if N > 0:
        o = opts or GRPOOptions()
        K.grpo_forward_kernel[(N,)](
            logits, logits.stride(0), logits.stride(1), ids, T, V,
            dummy if mask is None else mask,
            dummy if advantages is None else advantages,
            dummy if old_logps is None else old_logps,
            dummy if ref_logps is None else ref_logps,
            dummy if importance_weights is None else importance_weights,
            logp, dummy if entropy is None else entropy, lse,
            dummy if loss is None else loss, dummy if dloss is None else dloss,
            dummy if kl is None else kl, dummy if flags is None else flags,
            grad_weight if write_grad else dummy, grad if write_grad else logits,
            (grad if write_grad else logits).stride(0), (grad if write_grad else logits).stride(1),
            1.0 / temperature, float(o.epsilon), float(o.eps_high), _zero_if_none(o.delta),
            _zero_if_none(o.dual_clip), float(o.beta), _zero_if_none(o.log_ratio_clamp),
            _zero_if_none(o.kl_clamp), float(o.sapo_temperature_pos), float(o.sapo_temperature_neg),
            **constexprs, ROW_ALIGN=row_alignment(logits, *([grad] if write_grad else [])),
            BLOCK_V=config["BLOCK_V"], num_warps=config["num_warps"],
        )
    return ForwardResult(logp, entropy, lse, loss, dloss, kl, flags, grad)


def backward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    temperature: float,
    *,
    in_place: bool = False,
) -> torch.Tensor:
    """dlogits [B, T, V] in the logits' dtype from g = dLoss/dlogp (fp32 [N]).

    ``in_place`` writes into ``logits`` itself (same strides) and returns it.
    """
    B, T, V = logits.shape
    grad = logits if in_place else torch.empty((B, T, V), device=logits.device, dtype=logits.dtype)
    config = block_config(V, logits.element_size())
    if B * T > 0:
        K.logprob_backward_kernel[(B * T,)](
            logits, logits.stride(0), logits.stride(1), ids, T, V,
            grad_logp, lse, grad, grad.stride(0), grad.stride(1),
            1.0 / temperature, ROW_ALIGN=row_alignment(logits, grad),
            BLOCK_V=config["BLOCK_V"], num_warps=config["num_warps"],
        )
    return grad


def linear_block_config(dtype: torch.dtype) -> Dict[str, object]:
    """Tiles of the fused lm_head kernels: [BLOCK_N x BLOCK_H] @ [BLOCK_H x BLOCK_V] products.

    64 x 128 output tiles over 64-wide H slices keep the fp32 accumulator at 32 registers a
    thread with 8 warps (checked for spills by tests/test_aot_compile.py); fp32 inputs use
    exact ("ieee") products so that fp32 matches the reference, 16-bit inputs the tensor cores.
    """
    return {"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_H": 64, "num_warps": 8,
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def _linear_block_config_for(N: int, V: int, H: int, dtype) -> Dict[str, object]:
    from triton.runtime.interpreter import InterpretedFunction

    from . import fused_linear as FL

    config = linear_block_config(dtype)
    # the interpreter cannot multiply bf16 tl.dot operands (see kernels/fused_linear.py)
    config["UPCAST"] = dtype == torch.bfloat16 and isinstance(FL.linear_logprob_forward_kernel, InterpretedFunction)
    if config["UPCAST"]:
        config["DOT_PRECISION"] = "ieee"
    # small problems (tests, the interpreter): shrink the tiles, tl.dot needs 16 at least
    config["BLOCK_N"] = max(16, min(config["BLOCK_N"], triton.next_power_of_2(N)))
    config["BLOCK_V"] = max(16, min(config["BLOCK_V"], triton.next_power_of_2(V)))
    config["BLOCK_H"] = max(16, min(config["BLOCK_H"], triton.next_power_of_2(H)))
    return config


def linear_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], ids: torch.Tensor,
                   temperature: float, compute_entropy: bool):
    """lse, logp, entropy (fp32 [N]) of (hidden [N, H] @ weight[V, H]^T + bias) / temperature."""
    from . import fused_linear as FL

    N, H = hidden.shape
    V = weight.shape[0]
    f32 = dict(device=hidden.device, dtype=torch.float32)
    lse, logp = torch.empty(N, **f32), torch.empty(N, **f32)
    entropy = torch.empty(N, **f32) if compute_entropy else None
    cfg = _linear_block_config_for(N, V, H, hidden.dtype)
    if N > 0:
        FL.linear_logprob_forward_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
            hidden, weight, weight if bias is None else bias, ids, N, V, H, lse, logp,
            logp if entropy is None else entropy, 1.0 / temperature,
            HAS_BIAS=bias is not None, COMPUTE_ENTROPY=compute_entropy, DOT_PRECISION=cfg["DOT_PRECISION"],
            UPCAST=cfg["UPCAST"],
            BLOCK_N=cfg["BLOCK_N"], BLOCK_V=cfg["BLOCK_V"], BLOCK_H=cfg["BLOCK_H"], num_warps=cfg["num_warps"],
        )
    return lse, logp, entropy


def linear_backward(hidden, weight, bias, ids, lse, g, temperature: float, compute_weight_grad: bool):
    """d hidden [N, H], d weight [V, H] (or None), d bias [V] (or None) from g = dLoss/dlogp (fp32 [N])."""
    from . import fused_linear as FL

    N, H = hidden.shape
    V = weight.shape[0]
    cfg = _linear_block_config_for(N, V, H, hidden.dtype)
    dh = torch.zeros(N, H, device=hidden.device, dtype=torch.float32)
    dw = torch.zeros(V, H, device=hidden.device, dtype=torch.float32) if compute_weight_grad else None
    db = torch.zeros(V, device=hidden.device, dtype=torch.float32) if compute_weight_grad and bias is not None \
        else None
    if N > 0:
        grid = (triton.cdiv(N, cfg["BLOCK_N"]) * triton.cdiv(V, cfg["BLOCK_V"]),)
        FL.linear_logprob_backward_kernel[grid](
            hidden, weight, weight if bias is None else bias, ids, N, V, H, lse, g, dh,
            dh if dw is None else dw, dh if db is None else db, 1.0 / temperature,
            HAS_BIAS=bias is not None, COMPUTE_DW=compute_weight_grad, DOT_PRECISION=cfg["DOT_PRECISION"],
            UPCAST=cfg["UPCAST"],
            BLOCK_N=cfg["BLOCK_N"], BLOCK_V=cfg["BLOCK_V"], BLOCK_H=cfg["BLOCK_H"], num_warps=cfg["num_warps"],
        )
    return dh, dw, db
