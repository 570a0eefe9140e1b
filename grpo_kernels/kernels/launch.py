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
from . import tuned


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
    # at least 2: the kernels fold each block as two halves (V = 1 then runs as one masked half block)
    block = max(2, min(max_block, triton.next_power_of_2(vocab_size)))
    elements_per_128_bits = 16 // element_size
    num_warps = max(1, min(8, block // (32 * elements_per_128_bits * 2)))
    return {"BLOCK_V": block, "num_warps": num_warps}


def logits_launch_config(logits: torch.Tensor, override: Optional[Dict[str, int]] = None) -> Dict[str, int]:
    """BLOCK_V, num_warps (and num_stages where set) of a logits-kernel launch.

    In order: ``override`` (the device sweep's candidates), the measured winner for this GPU,
    dtype and vocabulary (``tuned.json``), the heuristic of ``block_config``.
    """
    V = logits.shape[-1]
    config = block_config(V, logits.element_size())
    entry = tuned.logits_entry(logits.device, logits.dtype, V)
    if entry is not None:
        config.update({k: entry[k] for k in tuned.LOGITS_KEYS if entry.get(k) is not None})
    if override:
        config.update({k: v for k, v in override.items() if k in tuned.LOGITS_KEYS and v is not None})
    return config


def _forward_grid(N: int, device, programs_per_sm: Optional[int]):
    """(grid, persistent) of the forward kernel: one program per token, or, with ``programs_per_sm``,
    a persistent grid of that many programs per SM (each takes every grid-th token).

    The persistent grid bounds the rows in flight, and with them the one-pass kernel's working set
    (the rows it re-reads for the gradient): programs_per_sm x SMs x V x bytes, 132 x 297 KiB =
    39 MB a program per SM at V = 151,936 in bf16, inside the H200's 60 MB L2.
    """
    if not programs_per_sm:
        return (N,), False
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return (max(1, min(N, sms * int(programs_per_sm))),), True


def default_one_pass(logits: torch.Tensor) -> bool:
    """One-pass (dlogits written by the forward) unless the device sweep measured two-pass faster here."""
    entry = tuned.logits_entry(logits.device, logits.dtype, logits.shape[-1])
    return True if entry is None else bool(entry.get("one_pass", True))


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


def resolved_temperature(opts: Optional[GRPOOptions], temperature: Optional[float]) -> float:
    """The temperature of a launch, from one source: the options when there are any (a ``temperature``
    beside them must agree), else the argument (default 1)."""
    if opts is None:
        return 1.0 if temperature is None else float(temperature)
    if temperature is not None and float(temperature) != opts.temperature:
        raise ValueError(f"temperature={temperature!r} disagrees with the options' temperature={opts.temperature!r}: "
                         "pass it once, in the options")
    return opts.temperature


def _zero_if_none(value: Optional[float]) -> float:
    return 0.0 if value is None else float(value)


def allocate_outputs(N: int, device, opts: Optional[GRPOOptions], compute_entropy: bool) -> ForwardResult:
    """The fp32 [N] outputs of a forward kernel (int8 flags); None where the options ask for none."""
    f32 = dict(device=device, dtype=torch.float32)
    with_loss = loss_kind(opts) != K.LOSS_NONE
    return ForwardResult(
        logp=torch.empty(N, **f32),
        entropy=torch.empty(N, **f32) if compute_entropy else None,
        lse=torch.empty(N, **f32),
        loss=torch.empty(N, **f32) if with_loss else None,
        dloss_dlogp=torch.empty(N, **f32) if with_loss else None,
        kl=torch.empty(N, **f32) if with_loss and opts.uses_kl else None,
        flags=torch.empty(N, device=device, dtype=torch.int8) if with_loss else None,
    )


def loss_pointer_args(out: ForwardResult, mask, advantages, old_logps, ref_logps, importance_weights):
    """(per-token inputs, outputs, placeholder) as the forward kernels' keyword arguments; an absent one is
    the placeholder, which the constexprs (HAS_MASK, HAS_OLD, ...) keep unread."""
    dummy = out.logp
    either = lambda t: dummy if t is None else t  # noqa: E731
    inputs = dict(mask_ptr=either(mask), adv_ptr=either(advantages), old_ptr=either(old_logps),
                  ref_ptr=either(ref_logps), iw_ptr=either(importance_weights))
    outputs = dict(logp_out=out.logp, entropy_out=either(out.entropy), lse_out=out.lse, loss_out=either(out.loss),
                   dloss_out=either(out.dloss_dlogp), kl_out=either(out.kl), flags_out=either(out.flags))
    return inputs, outputs, dummy


def loss_scalar_args(opts: Optional[GRPOOptions], temperature: Optional[float] = None) -> Dict[str, float]:
    """The loss's run-time scalars as the kernels' keyword arguments (and inv_temperature, with a temperature)."""
    o = opts or GRPOOptions()
    scalars = dict(eps_low=float(o.epsilon), eps_high=float(o.eps_high), delta=_zero_if_none(o.delta),
                   dual_clip=_zero_if_none(o.dual_clip), beta=float(o.beta),
                   log_ratio_clamp=_zero_if_none(o.log_ratio_clamp), kl_clamp=_zero_if_none(o.kl_clamp),
                   sapo_tau_pos=float(o.sapo_temperature_pos), sapo_tau_neg=float(o.sapo_temperature_neg))
    return scalars if temperature is None else dict(inv_temperature=1.0 / temperature, **scalars)


def forward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    opts: Optional[GRPOOptions] = None,
    temperature: Optional[float] = None,
    mask: Optional[torch.Tensor] = None,
    advantages: Optional[torch.Tensor] = None,
    old_logps: Optional[torch.Tensor] = None,
    ref_logps: Optional[torch.Tensor] = None,
    importance_weights: Optional[torch.Tensor] = None,
    compute_entropy: bool = False,
    grad_weight: Optional[torch.Tensor] = None,
    config: Optional[Dict[str, int]] = None,
    grad_in_place: bool = False,
    grad_out: Optional[torch.Tensor] = None,
    entropy_grad_weight: Optional[torch.Tensor] = None,
) -> ForwardResult:
    """Run the forward kernel.

    logits [B, T, V] with a unit last stride; ids [B, T]; every other per-token input is
    a contiguous fp32 [N] (N = B * T). With ``opts`` None only log-probs (and entropy)
    are computed. With ``grad_weight`` (fp32 [N], each token's weight in the reduced loss)
    the kernel also writes dlogits of that loss in the same pass (one-pass mode).
    ``config`` overrides the launch configuration (see ``logits_launch_config``).
    ``grad_in_place`` (one-pass) writes dlogits over the logits themselves: each row is read
    in full for its log-sum-exp before any of it is written. ``grad_out`` (one-pass) is a
    [B, T, V] tensor with a unit last stride to write dlogits into, e.g. the aligned view of a
    [B, T + 1, V] gradient, so that no copy into a bigger buffer follows. ``entropy_grad_weight``
    (one-pass, with ``compute_entropy``; fp32 [N]) is each token's dLoss/dH, the entropy bonus's
    weight: its gradient is written in the same pass.
    """
    temperature = resolved_temperature(opts, temperature)
    B, T, V = logits.shape
    N = B * T
    out = allocate_outputs(N, logits.device, opts, compute_entropy)
    inputs, outputs, dummy = loss_pointer_args(out, mask, advantages, old_logps, ref_logps, importance_weights)
    write_grad = grad_weight is not None and out.loss is not None
    entropy_grad = write_grad and entropy_grad_weight is not None
    if entropy_grad and not compute_entropy:
        raise ValueError("entropy_grad_weight needs compute_entropy=True (the gradient uses each token's entropy)")
    grad = None
    if write_grad:
        grad = logits if grad_in_place else grad_out if grad_out is not None else torch.empty(
            (B, T, V), device=logits.device, dtype=logits.dtype)
    constexprs = forward_constexprs(
        opts, has_old=old_logps is not None, has_iw=importance_weights is not None,
        has_mask=mask is not None, compute_entropy=compute_entropy, write_grad=write_grad,
    )
    launch_config = logits_launch_config(logits, config)
    grid, persistent = _forward_grid(N, logits.device, launch_config.pop("programs_per_sm", None))
    grad_target = grad if write_grad else logits  # unread without WRITE_GRAD
    if N > 0:
        K.grpo_forward_kernel[grid](
            logits_ptr=logits, stride_b=logits.stride(0), stride_t=logits.stride(1), ids_ptr=ids, T=T, V=V, N=N,
            **inputs, **outputs, grad_weight_ptr=grad_weight if write_grad else dummy, grad_logits_ptr=grad_target,
            grad_stride_b=grad_target.stride(0), grad_stride_t=grad_target.stride(1),
            entropy_grad_ptr=entropy_grad_weight if entropy_grad else dummy, **loss_scalar_args(opts, temperature),
            **constexprs, ROW_ALIGN=row_alignment(logits, *([grad] if write_grad else [])), PERSISTENT=persistent,
            HAS_ENTROPY_GRAD=entropy_grad, **launch_config,
        )
    out.grad_logits = grad
    return out


def backward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    temperature: float,
    *,
    in_place: bool = False,
    config: Optional[Dict[str, int]] = None,
    out: Optional[torch.Tensor] = None,
    grad_entropy: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """dlogits [B, T, V] in the logits' dtype from g = dLoss/dlogp (fp32 [N]).

    ``in_place`` writes into ``logits`` itself (same strides) and returns it; ``out`` (a
    [B, T, V] tensor with a unit last stride) is written and returned instead of a new tensor.
    ``grad_entropy`` (dLoss/dH, fp32 [N]) with the forward's ``entropy`` (fp32 [N]) adds the
    entropy's gradient in the same pass.
    """
    B, T, V = logits.shape
    grad = logits if in_place else out if out is not None else torch.empty(
        (B, T, V), device=logits.device, dtype=logits.dtype)
    launch_config = logits_launch_config(logits, config)
    launch_config.pop("programs_per_sm", None)  # the forward's schedule; the backward reads each row once
    if B * T > 0:
        with_entropy = grad_entropy is not None
        K.logprob_backward_kernel[(B * T,)](
            logits_ptr=logits, stride_b=logits.stride(0), stride_t=logits.stride(1), ids_ptr=ids, T=T, V=V,
            grad_logp_ptr=grad_logp, lse_ptr=lse, grad_logits_ptr=grad, grad_stride_b=grad.stride(0),
            grad_stride_t=grad.stride(1), grad_entropy_ptr=grad_entropy if with_entropy else grad_logp,
            entropy_ptr=entropy if with_entropy else grad_logp, inv_temperature=1.0 / temperature,
            ROW_ALIGN=row_alignment(logits, grad), HAS_ENTROPY_GRAD=with_entropy, **launch_config,
        )
    return grad


SCALE_BLOCK = 4096


def scale_in_place(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x *= scale (a one-element tensor on x's device), without a host sync; nothing moves when scale is 1.

    x must be contiguous (the one-pass gradient is). The grid is a few programs per SM, each
    striding over x, so that a scale of 1 costs a handful of programs that return at once.
    """
    numel = x.numel()
    if numel == 0:
        return x
    blocks = triton.cdiv(numel, SCALE_BLOCK)
    if x.is_cuda:
        blocks = min(blocks, 8 * torch.cuda.get_device_properties(x.device).multi_processor_count)
    else:
        blocks = min(blocks, 16)
    K.scale_in_place_kernel[(blocks,)](x_ptr=x, scale_ptr=scale.reshape(1).float(), numel=numel, BLOCK=SCALE_BLOCK,
                                       num_warps=8)
    return x
