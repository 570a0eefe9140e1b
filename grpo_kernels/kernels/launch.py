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
    block = min(max_block, triton.next_power_of_2(vocab_size))
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


def default_lm_head_mode(hidden: torch.Tensor, vocab_size: int) -> str:
    """"recompute" unless the device sweep measured the 3-product mode faster for this GPU and vocabulary."""
    entry = tuned.fused_linear_entry(hidden.device, hidden.dtype, vocab_size)
    return "recompute" if entry is None else entry.get("mode", "recompute")


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


def _allocate_outputs(N: int, device, opts: Optional[GRPOOptions], compute_entropy: bool) -> ForwardResult:
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


def _loss_pointer_args(out: ForwardResult, mask, advantages, old_logps, ref_logps, importance_weights):
    """(per-token inputs, outputs, placeholder) as the forward kernels' keyword arguments; an absent one is
    the placeholder, which the constexprs (HAS_MASK, HAS_OLD, ...) keep unread."""
    dummy = out.logp
    either = lambda t: dummy if t is None else t  # noqa: E731
    inputs = dict(mask_ptr=either(mask), adv_ptr=either(advantages), old_ptr=either(old_logps),
                  ref_ptr=either(ref_logps), iw_ptr=either(importance_weights))
    outputs = dict(logp_out=out.logp, entropy_out=either(out.entropy), lse_out=out.lse, loss_out=either(out.loss),
                   dloss_out=either(out.dloss_dlogp), kl_out=either(out.kl), flags_out=either(out.flags))
    return inputs, outputs, dummy


def _loss_scalar_args(opts: Optional[GRPOOptions], temperature: Optional[float] = None) -> Dict[str, float]:
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
    out = _allocate_outputs(N, logits.device, opts, compute_entropy)
    inputs, outputs, dummy = _loss_pointer_args(out, mask, advantages, old_logps, ref_logps, importance_weights)
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
            entropy_grad_ptr=entropy_grad_weight if entropy_grad else dummy, **_loss_scalar_args(opts, temperature),
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


# The backward's only V-sized buffer, [chunk, V] in the input dtype, is at most this big
# (at least one token block). 1 GiB is 3,530 tokens of a 151,936 vocabulary in bf16: few
# enough chunks that re-reading the fp32 d weight per chunk (2 x V x H x 4 bytes) stays a
# small part of the products. Lower it to trade speed for memory.
LINEAR_WORKSPACE_BYTES = 1 << 30


def linear_block_config(dtype: torch.dtype) -> Dict[str, Dict[str, object]]:
    """Tiles of the fused lm_head kernels, per kernel: "logits" (forward and dlogits) and "matmul".

    logits: 64 x 128 output tiles over 64-wide H slices, 8 warps: a [64, 128] fp32 tile is
    32 registers a thread, and the online log-sum-exp needs a few of those live.
    matmul: 128 x 128 tiles over 64-wide (16-bit) or 32-wide (fp32) K slices, 8 warps, in
    groups of 8 row blocks. tests/test_aot_compile.py checks every one for spills. fp32
    inputs use exact ("ieee") products so that fp32 matches the reference; 16-bit inputs
    the tensor cores.
    """
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return {
        "logits": {"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_H": 64, "num_warps": 8, "DOT_PRECISION": precision},
        "matmul": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32 if dtype == torch.float32 else 64, "GROUP_M": 8,
                   "num_warps": 8, "DOT_PRECISION": precision},
    }


def _shrink(block: int, extent: int) -> int:
    """Small problems (tests, the interpreter): a tile no bigger than the problem; tl.dot needs 16."""
    return max(16, min(block, triton.next_power_of_2(max(extent, 1))))


def _interpreted_bf16(dtype) -> bool:
    """True under TRITON_INTERPRET with bf16 inputs, where tl.dot operands must be upcast (see fused_linear.py)."""
    from triton.runtime.interpreter import InterpretedFunction

    from . import fused_linear as FL

    return dtype == torch.bfloat16 and isinstance(FL.linear_grpo_forward_kernel, InterpretedFunction)


def _logits_config(N: int, V: int, H: int, dtype, device=None, override=None) -> Dict[str, object]:
    """The lm_head logits tiles: ``override`` (the sweep), else the measured winner, else the defaults."""
    cfg = dict(linear_block_config(dtype)["logits"])
    entry = None if device is None else tuned.fused_linear_entry(device, dtype, V)
    for source in (entry, override):
        if source:
            cfg.update({k: source[k] for k in tuned.FUSED_LINEAR_KEYS if source.get(k) is not None})
    cfg["UPCAST"] = _interpreted_bf16(dtype)
    if cfg["UPCAST"]:
        cfg["DOT_PRECISION"] = "ieee"
    for key, extent in (("BLOCK_N", N), ("BLOCK_V", V), ("BLOCK_H", H)):
        cfg[key] = _shrink(cfg[key], extent)
    return cfg


def linear_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
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
    config: Optional[Dict[str, int]] = None,
) -> ForwardResult:
    """The forward kernel on (hidden [N, H] @ weight[V, H]^T + bias) / temperature, logits never stored.

    Per-token inputs and outputs as in ``forward`` (fp32 [N]); with ``opts`` None only
    log-probs (and entropy) are computed.
    """
    from . import fused_linear as FL

    temperature = resolved_temperature(opts, temperature)
    N, H = hidden.shape
    V = weight.shape[0]
    out = _allocate_outputs(N, hidden.device, opts, compute_entropy)
    inputs, outputs, _ = _loss_pointer_args(out, mask, advantages, old_logps, ref_logps, importance_weights)
    constexprs = forward_constexprs(
        opts, has_old=old_logps is not None, has_iw=importance_weights is not None,
        has_mask=mask is not None, compute_entropy=compute_entropy,
    )
    del constexprs["WRITE_GRAD"]  # the lm_head gradient needs the full log-sum-exp first: see linear_backward
    cfg = _logits_config(N, V, H, hidden.dtype, hidden.device, config)
    if N == 0:
        return out
    blocks_n = triton.cdiv(N, cfg["BLOCK_N"])
    splits, v_per_split = linear_vocab_splits(blocks_n, V, cfg["BLOCK_V"], hidden.device)
    partials = torch.empty(4, splits, N, device=hidden.device, dtype=torch.float32) if splits > 1 else out.logp
    FL.linear_grpo_forward_kernel[(blocks_n, splits)](
        h_ptr=hidden, w_ptr=weight, b_ptr=weight if bias is None else bias, ids_ptr=ids, N=N, V=V, H=H,
        v_per_split=v_per_split, partials_ptr=partials, **inputs, **outputs, **_loss_scalar_args(opts, temperature),
        **constexprs, HAS_BIAS=bias is not None, SPLIT_V=splits > 1, **cfg,
    )
    if splits > 1:
        FL.linear_grpo_combine_kernel[(triton.cdiv(N, COMBINE_BLOCK),)](
            partials_ptr=partials, N=N, splits=splits, **inputs, **outputs, **_loss_scalar_args(opts), **constexprs,
            BLOCK_N=COMBINE_BLOCK,
        )
    return out


# Vocabulary splits of the lm_head forward: None picks them from the GPU's size (below);
# tests set a number to run the split path in the interpreter.
LINEAR_FORWARD_SPLITS: Optional[int] = None
COMBINE_BLOCK = 128


def linear_vocab_splits(blocks_n: int, V: int, block_v: int, device) -> tuple:
    """(splits, vocabulary columns per split) of the forward grid.

    One program per token block streams all of V, which fills an H200's 132 SMs only from
    about 2 x 132 blocks (17k tokens at 64 a block). With fewer blocks the vocabulary is
    cut into splits so that the grid has about two programs per SM; each split is whole
    BLOCK_V tiles. The price is a [4, splits, N] fp32 buffer and one small combine kernel.
    """
    tiles = triton.cdiv(V, block_v)
    if LINEAR_FORWARD_SPLITS is not None:
        wanted = LINEAR_FORWARD_SPLITS
    elif device.type == "cuda":
        wanted = triton.cdiv(2 * torch.cuda.get_device_properties(device).multi_processor_count, blocks_n)
    else:
        wanted = 1
    tiles_per_split = triton.cdiv(tiles, max(1, min(wanted, tiles)))
    splits = triton.cdiv(tiles, tiles_per_split)  # every split has at least one tile
    return splits, tiles_per_split * block_v


def linear_chunk_tokens(N: int, V: int, element_size: int, block_n: int) -> int:
    """Tokens per backward chunk: the [chunk, V] workspace within LINEAR_WORKSPACE_BYTES, whole token blocks."""
    fits = LINEAR_WORKSPACE_BYTES // max(V * element_size, 1)
    if fits >= N:
        return max(N, 1)
    return max(block_n, fits // block_n * block_n)


def _matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """out (fp32 [M, N], contiguous) = (out if accumulate) + a [M, K] @ b [K, N], any strides."""
    from . import fused_linear as FL

    M, K_ = a.shape
    N = b.shape[1]
    cfg = dict(linear_block_config(a.dtype)["matmul"])
    upcast = _interpreted_bf16(a.dtype)
    blocks = {"BLOCK_M": _shrink(cfg["BLOCK_M"], M), "BLOCK_N": _shrink(cfg["BLOCK_N"], N),
              "BLOCK_K": _shrink(cfg["BLOCK_K"], K_)}
    grid = (triton.cdiv(M, blocks["BLOCK_M"]) * triton.cdiv(N, blocks["BLOCK_N"]),)
    FL.matmul_kernel[grid](
        a_ptr=a, b_ptr=b, c_ptr=out, M=M, N=N, K=K_, stride_am=a.stride(0), stride_ak=a.stride(1),
        stride_bk=b.stride(0), stride_bn=b.stride(1),
        ACCUMULATE=accumulate, DOT_PRECISION="ieee" if upcast else cfg["DOT_PRECISION"], UPCAST=upcast,
        GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"], **blocks,
    )


# cuBLAS products with fp32 output (torch's mm / addmm with out_dtype, CUDA), per op: None = not
# tried yet; False = this torch lacks it, and the Triton product runs instead.
_CUBLAS_FP32_OUT: Dict[str, Optional[bool]] = {"mm": None, "addmm": None}


def product_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """out (fp32 [M, N]) = (out if accumulate) + a @ b with fp32 accumulation.

    On CUDA, cuBLAS (about 790 TFLOP/s in bf16 on an H200) writing fp32 directly, d weight
    accumulated in place across chunks (addmm's beta = 1); where torch has no fp32-output
    product (or on CPU, under the interpreter), the Triton tile product ``matmul_kernel``.
    """
    op = "addmm" if accumulate else "mm"
    if a.is_cuda and _CUBLAS_FP32_OUT[op] is not False:
        try:
            if accumulate:
                torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
            else:
                torch.mm(a, b, out_dtype=torch.float32, out=out)
            _CUBLAS_FP32_OUT[op] = True
            return
        except (TypeError, RuntimeError, NotImplementedError):
            if _CUBLAS_FP32_OUT[op]:  # it worked before: a real error
                raise
            _CUBLAS_FP32_OUT[op] = False
    _matmul(a, b, out, accumulate)


def _linear_gradient_buffers(hidden, weight, bias, compute_weight_grad: bool):
    """fp32 d hidden [N, H], d weight [V, H] (or None: a frozen head) and d bias [V] (or None).

    d weight is written by the first chunk's product and added to by the later ones.
    """
    N, H = hidden.shape
    f32 = dict(device=hidden.device, dtype=torch.float32)
    dw = torch.empty(weight.shape[0], H, **f32) if compute_weight_grad else None
    db = torch.zeros(weight.shape[0], **f32) if compute_weight_grad and bias is not None else None
    return torch.empty(N, H, **f32), dw, db


def _add_chunk_gradients(dx, weight, hidden_chunk, dh_chunk, dw, db, first: bool) -> None:
    """From one chunk's dlogits dx [chunk, V]: its d hidden, and its share of d weight and d bias."""
    product_into(dx, weight, dh_chunk, accumulate=False)
    if dw is not None:
        product_into(dx.T, hidden_chunk, dw, accumulate=not first)
    if db is not None:
        db += dx.sum(0, dtype=torch.float32)


def linear_three_products(hidden, weight, bias, ids, *, opts, mask, advantages, old_logps, ref_logps,
                          importance_weights, compute_entropy, grad_weight, compute_weight_grad,
                          entropy_grad_weight=None):
    """The fused lm_head with 3 products instead of 4: loss terms and every gradient in one chunk loop.

    Each chunk's logits are computed once (``hidden @ weight.T + bias``, in the input dtype, into
    one reused [chunk, V] workspace); the one-pass logits kernel turns them into the loss terms
    and, in place, into dlogits of the reduced loss (``grad_weight`` is each token's weight);
    then d hidden = dx @ W and d weight += dx^T @ h. The gradient is complete when the forward
    ends: the backward only scales it. Memory is bounded by the chunk, as in the recomputing mode.
    Returns (ForwardResult over the N tokens, d hidden, d weight or None, d bias or None), fp32.
    With ``grad_weight`` None only the forward runs (no gradient wanted: evaluation, old log-probs):
    cuBLAS logits and the logits kernel a chunk at a time, and the three gradients are None.
    """
    N, H = hidden.shape
    V = weight.shape[0]
    out = _allocate_outputs(N, hidden.device, opts, compute_entropy)
    with_grad = grad_weight is not None
    dh, dw, db = _linear_gradient_buffers(hidden, weight, bias, compute_weight_grad) if with_grad else (None,) * 3
    chunk = linear_chunk_tokens(N, V, hidden.element_size(), 1)
    workspace = torch.empty(min(chunk, max(N, 1)), V, device=hidden.device, dtype=hidden.dtype)
    pick = lambda t, n: None if t is None else t[n]  # noqa: E731
    for n0 in range(0, N, chunk):
        n = slice(n0, min(n0 + chunk, N))
        x = workspace[: n.stop - n0]
        if bias is None:
            torch.mm(hidden[n], weight.T, out=x)
        else:
            torch.addmm(bias, hidden[n], weight.T, out=x)
        r = forward(x.unsqueeze(0), ids[n].unsqueeze(0), opts=opts, mask=pick(mask, n),
                    advantages=pick(advantages, n), old_logps=pick(old_logps, n), ref_logps=pick(ref_logps, n),
                    importance_weights=pick(importance_weights, n), compute_entropy=compute_entropy,
                    grad_weight=pick(grad_weight, n), grad_in_place=with_grad,
                    entropy_grad_weight=pick(entropy_grad_weight, n) if with_grad else None)
        for name in ("logp", "entropy", "lse", "loss", "dloss_dlogp", "kl", "flags"):
            if getattr(out, name) is not None:
                getattr(out, name)[n] = getattr(r, name)
        if with_grad:
            _add_chunk_gradients(x, weight, hidden[n], dh[n], dw, db, first=n0 == 0)  # x now holds dlogits
    return out, dh, dw, db


def linear_backward(hidden, weight, bias, ids, lse, g, temperature: float, compute_weight_grad: bool, config=None,
                    grad_entropy=None, entropy=None):
    """d hidden [N, H], d weight [V, H] (or None), d bias [V] (or None), all fp32, from g = dLoss/dlogp (fp32 [N])
    and, when the loss uses the entropy, h = dLoss/dH (``grad_entropy``) with the forward's ``entropy``.

    A chunk of tokens at a time: the dlogits kernel writes the chunk's [chunk, V] gradient
    of the logits into one reused workspace, then two products give the chunk's d hidden
    and add its share of d weight (fp32, in place).
    """
    from . import fused_linear as FL

    N, H = hidden.shape
    V = weight.shape[0]
    cfg = _logits_config(N, V, H, hidden.dtype, hidden.device, config)
    dh, dw, db = _linear_gradient_buffers(hidden, weight, bias, compute_weight_grad)
    chunk = linear_chunk_tokens(N, V, hidden.element_size(), cfg["BLOCK_N"])
    workspace = torch.empty(min(chunk, N), V, device=hidden.device, dtype=hidden.dtype)
    for n0 in range(0, N, chunk):
        n1 = min(n0 + chunk, N)
        dx = workspace[: n1 - n0]
        grid = (triton.cdiv(n1 - n0, cfg["BLOCK_N"]) * triton.cdiv(V, cfg["BLOCK_V"]),)
        FL.linear_dlogits_kernel[grid](
            h_ptr=hidden[n0:n1], w_ptr=weight, b_ptr=weight if bias is None else bias, ids_ptr=ids[n0:n1], N=n1 - n0,
            V=V, H=H, lse_ptr=lse[n0:n1], g_ptr=g[n0:n1], dx_ptr=dx, inv_temperature=1.0 / temperature,
            grad_entropy_ptr=g if grad_entropy is None else grad_entropy[n0:n1],
            entropy_ptr=g if grad_entropy is None else entropy[n0:n1],
            HAS_BIAS=bias is not None, HAS_ENTROPY_GRAD=grad_entropy is not None, **cfg,
        )
        _add_chunk_gradients(dx, weight, hidden[n0:n1], dh[n0:n1], dw, db, first=n0 == 0)
    return dh, dw, db
