"""Host launchers for the Triton kernels: tensor layout, block size, grid, constexprs.

No autograd here: ``forward``, ``loss_forward`` and ``backward`` take and return plain tensors; the front end's
host functions (``grpo_kernels.from_logits``, ``from_hidden_states``) call them. Every launcher reads the logits
in place: [B, T, V], or a model's [B, T + 1, V] whose first T positions predict the ids [B, T] (T is the ids').
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch
import triton

from . import logits as logits_kernels  # (as a module: the tests' spies replace its kernels)
from . import split_row_launch, tuned
from .contracts import NO_LOSS_ARGS, NO_TOKEN_INPUTS, KernelLoss, LossTokens, OnePassGradient, TokenInputs, TokenWeights
from .reduce_launch import fp32_rows, loss_metrics, rows_needed, weighted_tokens


def block_config(vocab_size: int, element_size: int) -> dict[str, int]:
    """``_block_config`` (a new dict each call: callers update it)."""
    return dict(_block_config(vocab_size, element_size))


# The share of L2 the persistent one-pass schedule lets the rows in flight fill (one row a program): the rest holds
# the gradient's stores on their way out (streaming) and the per-token arrays.
L2_ROWS_FRACTION = 0.8


def l2_programs_per_sm(l2_bytes: int, sms: int, row_bytes: int, fraction: float = L2_ROWS_FRACTION) -> int:
    """Programs per SM of the persistent one-pass schedule (``programs_per_sm: "l2"``) so that the rows in flight,
    one a program, fill at most ``fraction`` of L2, at least 1: the gradient loop's second read of a row then finds
    it in L2 (2 S) instead of HBM (3 S). 132 SMs x 297 KiB (V = 151,936 in bf16) are 38.3 MiB: 1 a SM in a 50 MiB
    L2; at V = 32,000, 4. A row so wide that one program a SM overflows L2 (V = 262,144 in bf16: 66 MiB on 132 SMs)
    still gets 1: the fewest rows the grid can keep every SM busy with."""
    return max(1, int(fraction * l2_bytes) // max(1, sms * row_bytes))


@functools.lru_cache(maxsize=256)  # a pure function of two ints, called on every launch
def _block_config(vocab_size: int, element_size: int) -> dict[str, int]:
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


def logits_launch_config(
    logits: torch.Tensor, override: dict[str, int] | None = None, kind: str = "logits"
) -> dict[str, int]:
    """BLOCK_V, num_warps, loop_stages, l2_hints (and num_stages, programs_per_sm, split_row where set) of a
    logits-kernel launch; a new dict (the caller pops from it).

    In order: ``override`` (the device sweep's candidates), the measured winner for this GPU, dtype and vocabulary
    (``tuned.json``'s ``kind``: "logits" for the loss's launches, "logprobs" for a log-prob pass, which reads each
    row once and never shares the loss's config: see ``tuned.py``), the heuristic of ``block_config``. The heuristic
    pipelines nothing (loop_stages 1) and sets the L2 hints; a measured entry without "l2_hints" was measured
    before they existed, and runs without them, as measured.
    """
    config = dict(_measured_config(logits, kind))
    if override:
        config.update({k: v for k, v in override.items() if k in tuned.LOGITS_KEYS and v is not None})
    return config


_MEASURED_CONFIGS: dict[tuple, tuple] = {}  # (V, element size, device, dtype, kind) -> (read with, config)


def _measured_config(logits: torch.Tensor, kind: str) -> dict:
    """The heuristic with the measured entry's keys on top (``logits_launch_config`` without an override). Asked
    on every launch, so each answer is kept with what it was read with (the table and its lookup: the device
    sweep's tests read other tables in and swap the lookup), and used only while those are still the ones."""
    key = (logits.shape[-1], logits.element_size(), logits.device, logits.dtype, kind)
    source = (tuned.table(), tuned.logits_entry, tuned._nearest)
    found = _MEASURED_CONFIGS.get(key)
    if found is None or found[0] != source:  # (a tuple compares its items by identity first: the same ones)
        config = {**block_config(key[0], key[1]), "loop_stages": 1, "l2_hints": True}
        entry = tuned.logits_entry(logits.device, logits.dtype, key[0], kind)
        if entry is not None:
            config.update({k: entry[k] for k in tuned.LOGITS_KEYS if entry.get(k) is not None})
            config["l2_hints"] = bool(entry.get("l2_hints", False))
        found = _MEASURED_CONFIGS[key] = (source, config)
    return found[1]


class LoopConfig(NamedTuple):
    """The row loops' compile-time settings of a launch (the kernels' LOOP_STAGES and L2_HINTS)."""

    stages: int
    hints: bool


def loop_config(config: dict[str, int]) -> LoopConfig:
    """The row loops' settings from a launch config (``logits_launch_config``), popping its own keys."""
    return LoopConfig(int(config.pop("loop_stages", None) or 1), bool(config.pop("l2_hints", True)))


def default_one_pass(logits: torch.Tensor) -> bool:
    """One-pass (dlogits written by the forward) unless the device sweep measured two-pass faster here."""
    entry = tuned.logits_entry(logits.device, logits.dtype, logits.shape[-1])
    return True if entry is None else bool(entry.get("one_pass", True))


@functools.cache
def _sm_count(device_index: int | None) -> int:
    """The streaming multiprocessors of a CUDA device (its index; None: the current one), asked once."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _l2_bytes(device_index: int | None) -> int:
    """The L2 cache of a CUDA device in bytes, asked once (a torch without the property: an H100's 50 MiB)."""
    return int(getattr(torch.cuda.get_device_properties(device_index), "L2_cache_size", 0) or CPU_L2_BYTES)


# What the persistent schedule assumes of a device without one (the interpreter on a CPU): 2 "SMs", a 50 MiB L2
CPU_SMS, CPU_L2_BYTES = 2, 50 << 20


def _forward_grid(N: int, device, programs_per_sm, row_bytes: int = 0):
    """(grid, persistent) of the forward kernel: one program per token, or, with ``programs_per_sm``,
    a persistent grid of that many programs per SM (each takes every grid-th token); "l2": as many as keep
    the rows in flight within L2 (``l2_programs_per_sm`` of ``row_bytes``, a row's logits).

    The persistent grid bounds the rows in flight, and with them the one-pass kernel's working set
    (the rows it re-reads for the gradient): programs_per_sm x SMs x V x bytes, 132 x 297 KiB =
    38 MiB a program per SM at V = 151,936 in bf16.
    """
    if not programs_per_sm:
        return (N,), False
    cuda = device.type == "cuda"
    sms = _sm_count(device.index) if cuda else CPU_SMS
    if programs_per_sm == "l2":
        programs_per_sm = l2_programs_per_sm(_l2_bytes(device.index) if cuda else CPU_L2_BYTES, sms, row_bytes)
    return (max(1, min(N, sms * int(programs_per_sm))),), True


@dataclasses.dataclass
class ForwardResult:
    logp: torch.Tensor  # fp32 [N]
    entropy: torch.Tensor | None  # fp32 [N] or None
    lse: torch.Tensor  # fp32 [N], saved for the backward
    loss: torch.Tensor | None  # fp32 [N] per-token loss (None when LOSS_KIND == 0)
    dloss_dlogp: torch.Tensor | None  # fp32 [N]
    kl: torch.Tensor | None  # fp32 [N] or None
    flags: torch.Tensor | None  # int8 [N]
    grad_logits: torch.Tensor | None = None  # [B, T, V] in the logits' dtype (one-pass mode)
    split_row_error: torch.Tensor | None = None  # int32 [1], 1 if a split-row wait timed out (a GPU launch)
    sum_squares: torch.Tensor | None = None  # fp32 [N]: sum of the squared probabilities (a log-prob pass's, Σπ²)


def row_alignment(*tensors: torch.Tensor) -> int:
    """Elements per 16 bytes if every row of every tensor starts 16-byte aligned, else 1.

    True for the common vocabularies (32000, 128256, 151936 are multiples of 8), whatever
    T is, so it does not change (and recompile) from step to step.
    """
    size = tensors[0].element_size()
    for t in tensors:  # (a loop, not all() over generators: this runs on every launch)
        if t.data_ptr() % 16:
            return 1
        for stride in t.stride()[:-1]:
            if (stride * size) % 16:
                return 1
    return 16 // size


def resolved_head(kernel_loss: KernelLoss | None, temperature: float | None, softcap: float | None) -> tuple:
    """(temperature, softcap) of a launch: the kernels compute log softmax(cap(x) / temperature) of the raw logits x,
    cap(x) = softcap * tanh(x / softcap) (softcap None: no cap). From one source: the loss when there is one
    (``KernelLoss.kernel_temperature`` and ``kernel_softcap``, the head's scale folded in; a ``temperature``
    beside it must agree with the options' own, and a ``softcap`` may not be given), else the arguments
    (default 1 and None)."""
    if kernel_loss is None:
        return (1.0 if temperature is None else float(temperature)), (None if softcap is None else float(softcap))
    if temperature is not None and float(temperature) != kernel_loss.temperature:
        raise ValueError(
            f"temperature={temperature!r} disagrees with the options' "
            f"temperature={kernel_loss.temperature!r}: pass it once, in the options"
        )
    if softcap is not None:
        raise ValueError(
            f"softcap={softcap!r} beside options: the options carry the head's soft-cap (logit_softcap, logit_scale)"
        )
    return kernel_loss.kernel_temperature, kernel_loss.kernel_softcap


@functools.cache
def _output_names(with_loss: bool, with_kl: bool, compute_entropy: bool) -> tuple:
    wanted = dict(
        logp=True, entropy=compute_entropy, lse=True, loss=with_loss, dloss_dlogp=with_loss, kl=with_loss and with_kl
    )
    return tuple(name for name, on in wanted.items() if on)


def output_names(kernel_loss: KernelLoss | None, compute_entropy: bool) -> tuple:
    """The fp32 [N] outputs a forward launch writes (``ForwardResult``'s names, in its order)."""
    return _output_names(kernel_loss is not None, kernel_loss is not None and kernel_loss.with_kl, compute_entropy)


def allocate_outputs(
    N: int, device, kernel_loss: KernelLoss | None, compute_entropy: bool, rows: tuple | None = None
) -> ForwardResult:
    """The fp32 [N] outputs of a forward kernel (int8 flags); None where the loss asks for none. The fp32
    ones are rows of one buffer (``reduce_launch.fp32_rows``), or the given ``rows`` (one per ``output_names``)."""
    names = output_names(kernel_loss, compute_entropy)
    return _outputs(names, rows if rows is not None else fp32_rows(len(names), N, device), N, device)


def _outputs(names: tuple, rows: tuple, N: int, device) -> ForwardResult:
    """``ForwardResult`` of the fp32 rows named ``names`` (``output_names``; ``rows`` may hold more, for others),
    with int8 flags where there is a loss."""
    named = dict(zip(names, rows[: len(names)], strict=True))
    with_loss = "loss" in named
    return ForwardResult(
        named["logp"],
        named.get("entropy"),
        named["lse"],
        named.get("loss"),
        named.get("dloss_dlogp"),
        named.get("kl"),
        torch.empty(N, device=device, dtype=torch.int8) if with_loss else None,
    )


def loss_pointer_args(out: ForwardResult, tokens: TokenInputs) -> dict[str, torch.Tensor | None]:
    """The per-token inputs and outputs as the forward kernels' keyword arguments, None where absent: the
    kernels derive from that what they read and write. Without a loss (``out.loss`` None) only the mask is
    read; the reference log-probs only where the loss has a KL term (``out.kl``)."""
    return dict(zip(_POINTER_NAMES, loss_pointers(out, tokens), strict=True))


_POINTER_NAMES = (
    "mask_ptr",
    "adv_ptr",
    "old_ptr",
    "ref_ptr",
    "iw_ptr",
    "logp_out",
    "entropy_out",
    "lse_out",
    "loss_out",
    "dloss_out",
    "kl_out",
    "flags_out",
    "sum_squares_out",
    "kept_lse_ptr",
    "kept_entropy_ptr",
)


def loss_args(kernel_loss: KernelLoss | None) -> dict[str, object]:
    """The loss kernels' arguments that come from the options alone (``KernelLoss.args``: the run-time scalars and
    the constexprs), or the placeholders of a launch without a loss."""
    return NO_LOSS_ARGS if kernel_loss is None else kernel_loss.args


def forward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    kernel_loss: KernelLoss | None = None,
    temperature: float | None = None,
    softcap: float | None = None,
    tokens: TokenInputs = NO_TOKEN_INPUTS,
    compute_entropy: bool = False,
    gradient: OnePassGradient | None = None,
    config: dict[str, int] | None = None,
    compute_sum_squares: bool = False,
) -> ForwardResult:
    """Run the forward kernel on log softmax(cap(logits) / temperature) (``resolved_head``).

    logits [B, T, V] with a unit last stride; ids [B, T]; the per-token inputs (``tokens``) are
    contiguous fp32 [N] (N = B * T), None where absent. With ``kernel_loss`` None only log-probs (and
    entropy) are computed. With ``gradient`` (a loss only) the kernel also writes dlogits of the
    reduced loss in the same pass (one-pass mode; see ``OnePassGradient``): in place, each row is read
    in full for its log-sum-exp before any of it is written. ``config`` overrides the launch
    configuration (see ``logits_launch_config``). ``compute_sum_squares``: also each token's sum of squared
    probabilities, Σπ² (``ForwardResult.sum_squares``), from the same pass.
    """
    temperature, softcap = resolved_head(kernel_loss, temperature, softcap)
    out = allocate_outputs(ids.numel(), logits.device, kernel_loss, compute_entropy)
    if compute_sum_squares:
        out.sum_squares = torch.empty(ids.numel(), device=logits.device, dtype=torch.float32)
    return _run_forward(logits, ids, out, kernel_loss, temperature, softcap, tokens, compute_entropy, gradient, config)


class LossForward(NamedTuple):
    """What ``loss_forward`` returns: the forward kernel's per-token results, the token weights, the reduced
    loss (0-d) and the metrics (fp32 [k], ``objective.metric_names`` order)."""

    result: ForwardResult
    weights: TokenWeights
    loss: torch.Tensor
    metrics: torch.Tensor


def loss_forward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    kernel_loss: KernelLoss,
    loss_tokens: LossTokens,
    gradient_out: torch.Tensor | None = None,
    dropped_gradient: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> LossForward:
    """A loss's launches over logits [B, T, V]: the token-weights kernel (each token's inputs and weight),
    the forward kernel (with ``gradient_out``, a [B, T, V] tensor with a unit last stride, or any tensor whose
    first T positions are that, it also writes dlogits of the reduced loss there: one pass) and the loss-metrics
    kernel. Every O(N) fp32 output is a row of one buffer. ``dropped_gradient``: the [B, T + 1, V] gradient
    ``gradient_out`` is the first T positions of, whose position T the token-weights kernel zeroes."""
    N, device, t, reduction = ids.numel(), logits.device, loss_tokens.tokens, loss_tokens.reduction
    names = _output_names(True, kernel_loss.with_kl, kernel_loss.compute_entropy)  # (output_names of a loss)
    outputs = len(names)
    rows = fp32_rows(
        outputs + rows_needed(t.advantages, t.importance_weights, reduction), N, device, ids.shape
    )  # (as the ids where that is free)
    tokens, weights = weighted_tokens(loss_tokens, dropped_gradient=dropped_gradient, out=rows[outputs:])
    gradient = (
        None if gradient_out is None else OnePassGradient(weights.weight, weights.entropy_weight, out=gradient_out)
    )
    result = _run_forward(
        logits,
        ids,
        _outputs(names, rows, N, device),
        kernel_loss,
        kernel_loss.kernel_temperature,
        kernel_loss.kernel_softcap,
        tokens,
        kernel_loss.compute_entropy,
        gradient,
        config,
    )
    return LossForward(
        result,
        weights,
        *loss_metrics(
            t.mask,
            kernel_loss,
            loss=result.loss,
            entropy=result.entropy,
            kl=result.kl,
            flags=result.flags,
            weights=weights,
        ),
    )


def _run_forward(
    logits,
    ids,
    out: ForwardResult,
    kernel_loss: KernelLoss | None,
    temperature: float,
    softcap: float | None,
    tokens: TokenInputs,
    compute_entropy: bool,
    gradient: OnePassGradient | None,
    config,
) -> ForwardResult:
    """The forward kernel's launch (or the split-row kernel's) into ``out``."""
    (B, T), V = ids.shape, logits.shape[-1]
    N = B * T
    write_grad = gradient is not None and out.loss is not None
    if write_grad and gradient.entropy_weight is not None and not compute_entropy:
        raise ValueError("gradient.entropy_weight needs compute_entropy=True (the gradient uses each token's entropy)")
    grad = grad_weight = entropy_grad = None
    grad_stride_b = grad_stride_t = 0
    if write_grad:
        grad = (
            logits
            if gradient.in_place
            else gradient.out
            if gradient.out is not None
            else torch.empty((B, T, V), device=logits.device, dtype=logits.dtype)
        )
        grad_weight, entropy_grad, grad_stride_b, grad_stride_t = (
            gradient.weight,
            gradient.entropy_weight,
            grad.stride(0),
            grad.stride(1),
        )
    out.grad_logits = grad
    pointers = loss_pointers(out, tokens)
    loss = NO_LOSS_ARGS if kernel_loss is None else kernel_loss.args
    launch_config = logits_launch_config(logits, config, "logprobs" if kernel_loss is None else "logits")
    # positional, in the kernel's signature order (logits_kernels.grpo_forward_kernel): Triton's launcher takes a
    # keyword argument at about ten times a positional one's host time, and this launch has 36
    args = (
        logits,
        logits.stride(0),
        logits.stride(1),
        ids,
        T,
        V,
        N,
        *pointers,
        grad_weight,
        grad,
        grad_stride_b,
        grad_stride_t,
        entropy_grad,
        1.0 / temperature,
        softcap,
        loss["loss_scalars"],
        loss["LOSS_KIND"],
        loss["KL_KIND"],
        loss["LOSS_FLAGS"],
        row_alignment(logits, grad) if write_grad else row_alignment(logits),
    )
    chunks = launch_config.pop("split_row", None) or split_row_launch.SPLIT_ROW_CHUNKS
    if write_grad and not gradient.in_place and chunks and tokens.kept_lse is None:  # (no kept set in split rows)
        # the leading parameters, by name (the constexprs after them come as keywords)
        kwargs = dict(zip(logits_kernels.grpo_forward_kernel.arg_names, args, strict=False))
        for name in ("sum_squares_out", "kept_lse_ptr", "kept_entropy_ptr"):  # (None here: see the condition)
            del kwargs[name]
        if split_row_launch.SPLIT_ROW_BLOCK:  # a block for the split-row kernel alone (the tests' small vocabularies)
            launch_config = {**launch_config, **block_config(split_row_launch.SPLIT_ROW_BLOCK, logits.element_size())}
        ran, out.split_row_error = split_row_launch.split_row_forward(logits, kwargs, launch_config, int(chunks))
        if ran:
            return out
    programs_per_sm = launch_config.pop("programs_per_sm", None)
    grid, persistent = (
        ((N,), False)
        if not programs_per_sm
        else _forward_grid(N, logits.device, programs_per_sm, V * logits.element_size())
    )
    loops = loop_config(launch_config)
    if N > 0:
        logits_kernels.grpo_forward_kernel[grid](
            *args, launch_config.pop("BLOCK_V"), persistent, *loops, **launch_config
        )
    return out


def loss_pointers(out: ForwardResult, tokens: TokenInputs) -> tuple:
    """The per-token inputs and outputs of a forward launch in the kernels' order (``loss_pointer_args``' values,
    positional: see ``_run_forward``)."""
    with_loss = out.loss is not None
    if not with_loss:
        return (
            tokens.mask,
            None,
            None,
            None,
            None,
            out.logp,
            out.entropy,
            out.lse,
            None,
            None,
            None,
            None,
            out.sum_squares,
            tokens.kept_lse,
            tokens.kept_entropy,
        )
    if tokens.advantages is None:
        raise ValueError("advantages=None: a loss launch needs each token's advantage (fp32 [N])")
    if out.kl is not None and tokens.ref_logps is None:
        raise ValueError(
            "ref_logps=None: the options have a KL term (beta != 0), which needs the reference log-probs (fp32 [N])"
        )
    return (
        tokens.mask,
        tokens.advantages,
        tokens.old_logps,
        tokens.ref_logps if out.kl is not None else None,
        tokens.importance_weights,
        out.logp,
        out.entropy,
        out.lse,
        out.loss,
        out.dloss_dlogp,
        out.kl,
        out.flags,
        None,  # (Σπ² is a log-prob pass's)
        tokens.kept_lse,
        tokens.kept_entropy,
    )


def backward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    temperature: float,
    *,
    softcap: float | None = None,
    in_place: bool = False,
    config: dict[str, int] | None = None,
    out: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """dlogits [B, T, V] in the logits' dtype from g = dLoss/dlogp (fp32 [N]), of log softmax(cap(logits) /
    temperature) (``resolved_head``: ``softcap`` None, no cap).

    ``in_place`` writes into ``logits`` itself (same strides) and returns it; ``out`` (a
    [B, T, V] tensor with a unit last stride) is written and returned instead of a new tensor.
    ``grad_entropy`` (dLoss/dH, fp32 [N]) with the forward's ``entropy`` (fp32 [N]) adds the
    entropy's gradient in the same pass. The per-token tensors any shape and float dtype (read as fp32 [N]).
    """
    flat = lambda t: None if t is None else t.reshape(-1).float().contiguous()  # noqa: E731
    lse, grad_logp, grad_entropy = lse.reshape(-1), flat(grad_logp), flat(grad_entropy)
    entropy = flat(entropy) if grad_entropy is not None else None
    (B, T), V = ids.shape, logits.shape[-1]
    grad = (
        logits
        if in_place
        else out
        if out is not None
        else torch.empty((B, T, V), device=logits.device, dtype=logits.dtype)
    )
    launch_config = logits_launch_config(logits, config)
    # the forward's schedules (a persistent grid, split rows); the backward reads each row once, a program a row
    launch_config.pop("programs_per_sm", None)
    launch_config.pop("split_row", None)
    loops = loop_config(launch_config)
    if B * T > 0:
        with_entropy = grad_entropy is not None
        logits_kernels.logprob_backward_kernel[(B * T,)](
            logits_ptr=logits,
            stride_b=logits.stride(0),
            stride_t=logits.stride(1),
            ids_ptr=ids,
            T=T,
            V=V,
            grad_logp_ptr=grad_logp,
            lse_ptr=lse,
            grad_logits_ptr=grad,
            grad_stride_b=grad.stride(0),
            grad_stride_t=grad.stride(1),
            grad_entropy_ptr=grad_entropy if with_entropy else None,
            entropy_ptr=entropy if with_entropy else None,
            inv_temperature=1.0 / temperature,
            softcap=softcap,
            ROW_ALIGN=row_alignment(logits, grad),
            LOOP_STAGES=loops.stages,
            L2_HINTS=loops.hints,
            **launch_config,
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
    blocks = -(-numel // SCALE_BLOCK)
    blocks = min(blocks, 8 * _sm_count(x.device.index) if x.is_cuda else 16)
    scale = scale if scale.dtype == torch.float32 else scale.float()  # one element, 0-d or not: read at its pointer
    logits_kernels.scale_in_place_kernel[(blocks,)](
        x, scale, numel, SCALE_BLOCK, num_warps=8
    )  # (x_ptr, scale_ptr, numel, BLOCK)
    return x
