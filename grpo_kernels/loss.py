"""The public API: ``grpo_loss`` (functional), ``GRPOLoss`` (nn.Module), ``token_logprobs``."""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch
from torch import nn

from . import objective
from .functions import (FusedLinearThreeProducts, FusedLinearTokenLoss, FusedTokenLoss, FusedTokenLossOnePass,
                        LinearTokenLogprobs, TokenLogprobs, aligned)
from .kernels import contracts as K
from .kernels.contracts import launch_module, lm_head_launch_module
from .options import BACKENDS, GRPOOptions
from .packing import Rows
from .objective import GRPOLossOutput
from .validation import check_in_place, check_inputs, check_logits, check_per_token, check_token_ids, resolve_backend


def _per_token_kernel_inputs(rows: Rows, mask, advantages, old_logps, ref_logps, importance_weights,
                             opts: GRPOOptions):
    """mask, advantages, old, ref (only with a KL term) and importance weights as the kernels read them:
    contiguous fp32 [N] (O(N), negligible)."""
    return (mask.reshape(-1).contiguous(), rows.tokens(advantages), rows.tokens(old_logps),
            rows.tokens(ref_logps) if opts.uses_kl else None, rows.tokens(importance_weights))


def _output_from_kernel(loss, loss_t, logp, entropy, kl, flags, mask, opts: GRPOOptions) -> GRPOLossOutput:
    """The output of a loss whose per-token terms came from a kernel (clip flags as FLAG_* bits)."""
    return GRPOLossOutput(loss, _kernel_metrics(entropy, kl, flags, mask, opts), logp.detach())


def _kernel_metrics(entropy, kl, flags, mask, opts: GRPOOptions) -> Dict[str, torch.Tensor]:
    """``objective.loss_metrics`` of a kernel path (token level: every metric a mean over active tokens).

    The same values in a handful of launches instead of five per metric: the metrics' rows are
    stacked and every masked sum is one matrix-vector product with the mask. A loss call is
    otherwise a few launches around one kernel, so these small ones are much of its host time.
    """
    rows = {}
    if kl is not None:
        rows["kl"] = kl.reshape(-1)
    if entropy is not None:
        rows["entropy"] = entropy.reshape(-1)
    if flags is not None:
        flags = flags.reshape(-1)
        low, high = torch.stack([flags & K.FLAG_LOW_CLIPPED, flags & K.FLAG_HIGH_CLIPPED]).ne_(0).float()
        rows.update(objective.clip_metric_values(opts, low, high))
    if not rows:
        return {}
    weights = mask.reshape(-1).float()
    means = (torch.stack(list(rows.values())).detach() @ weights) / weights.sum().clamp(min=1.0)
    return dict(zip(rows, means.unbind()))


def grpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: Optional[torch.Tensor] = None,
    ref_logps: Optional[torch.Tensor] = None,
    importance_weights: Optional[torch.Tensor] = None,
    normalizer=None,
    *,
    options: Optional[GRPOOptions] = None,
    backend: str = "auto",
    in_place_backward: bool = False,
    check_ids: bool = True,
    one_pass: Optional[bool] = None,
    loss_scale=1.0,
    drop_last_position: bool = False,
    sampling_logps: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    vocab_parallel_group=None,
    vocab_start_index: Optional[int] = None,
    **option_kwargs,
) -> GRPOLossOutput:
    """The GRPO loss from logits [B, T, V]; ``logits[:, t]`` predicts ``completion_ids[:, t]``.

    Vocabulary parallelism: with ``vocab_parallel_group`` (a torch.distributed ProcessGroup), the
    logits are this rank's contiguous slice of the vocabulary [B, T, V / P] (Megatron's equal
    partitions, or starting at ``vocab_start_index``); the ids stay global. The ranks exchange
    O(B * T) values, never logits; the loss, log-probs and metrics are the unsharded ones on every
    rank, and each rank's gradient is its slice of the unsharded gradient (``vocab_parallel.py``).

    A packed (padding-free) batch: ``cu_seqlens`` [S + 1] (int32 / int64, flash-attention's
    convention: sequence s is tokens cu_seqlens[s] to cu_seqlens[s + 1]) with logits [total, V] or
    [1, total, V]; ids, mask and the per-token inputs [total] or [1, total]; advantages and
    importance weights per sequence [S] or per token. The loss, gradient and metrics are those of
    the padded layout for the same sequences.

    ``sampling_logps`` [B, T] (the sampler's log-probs, e.g. vLLM's) feed the off-policy mask
    (``off_policy_mask_threshold``); without them it uses ``old_logps``, as TRL does.

    With ``drop_last_position=True``, ``logits`` is [B, T + 1, V], as a causal LM returns them
    with ``logits_to_keep = T + 1``: the last position predicts no completion token, is never
    read and gets a zero gradient. Passing that tensor rather than ``logits[:, :-1]`` lets the
    gradient be written at its full shape directly, where autograd would zero-fill a
    [B, T + 1, V] tensor and copy the view's [B, T, V] gradient into it (3 x S more bytes).

    Options come as ``options=GRPOOptions(...)`` or as keywords (TRL's names). See
    ``GRPOLoss`` for the arguments. ``loss_scale`` (a number or a 0-d tensor, e.g. 1 /
    gradient-accumulation steps) multiplies the returned loss; the one-pass kernel folds it
    into the gradient it writes, so ``out.loss.backward()`` then moves no extra byte.
    """
    if options is not None and option_kwargs:
        raise ValueError(f"pass options either as options= or as keywords, got both (keywords {sorted(option_kwargs)})")
    opts = options if options is not None else GRPOOptions(**option_kwargs)
    rows, user_shape = None, None
    if cu_seqlens is not None:  # a packed batch: one row of tokens to the kernels, sequences to the reductions
        if drop_last_position:
            raise ValueError("drop_last_position=True applies to padded [B, T + 1, V] logits, not to a packed batch "
                             "(cu_seqlens): give the packed logits of the completion tokens only")
        user_shape = completion_ids.shape if isinstance(completion_ids, torch.Tensor) else None
        rows, logits, completion_ids, completion_mask, old_logps, ref_logps, sampling_logps = _packed_inputs(
            cu_seqlens, logits, completion_ids, completion_mask, advantages, old_logps, ref_logps,
            importance_weights, sampling_logps)
    full, trailing = logits, _checked_drop_last_position(drop_last_position, logits, completion_ids)
    logits = aligned(full, trailing)  # [B, T, V]: what is checked, and what the kernels read
    sharded = vocab_parallel_group is not None
    check_inputs(logits, completion_ids, completion_mask, rows.tokens(advantages).view(1, -1) if rows else advantages,
                 old_logps, ref_logps, None if rows else importance_weights, normalizer, opts,
                 check_ids and not sharded)
    if sharded:  # the ids are global: checked against the whole vocabulary
        vocab_start = _sharded_vocab_start(logits, completion_ids, vocab_parallel_group, vocab_start_index,
                                           check_ids, mask=completion_mask, normalizer=normalizer)
        if in_place_backward:
            raise ValueError("in_place_backward=True is not supported with vocab_parallel_group")
    check_per_token("sampling_logps", sampling_logps, logits, allow_row=False)
    engine = resolve_backend(backend, logits)
    check_in_place(in_place_backward, full)
    loss_scale = _checked_loss_scale(loss_scale)
    normalizer = _detached(normalizer)  # a per-step constant, like every per-token input
    B, T, _ = logits.shape
    rows = rows or Rows(B, T)
    mask = completion_mask.float()  # the token layout: [B, T], or [1, total] packed
    mask_seq = rows.seq(mask)  # the sequence layout the reductions see: [B, T], or [S, T_max] packed
    bonus_mask, policy_mask = mask_seq, None  # the tokens the entropy bonus acts on; TRL's policy-term masks

    def logprob_pass(compute_entropy: bool, in_place: bool = False):
        """This call's (log-probs, entropy) in the token layout, differentiable, 0 at masked tokens."""
        if sharded:
            return _vocab_parallel_logprobs(logits, completion_ids, mask, opts.temperature, compute_entropy, engine,
                                            vocab_parallel_group, vocab_start)
        return TokenLogprobs.apply(full, completion_ids.contiguous(), mask.reshape(-1).contiguous(),
                                   opts.temperature, compute_entropy, engine, in_place, trailing)

    if opts.masks_tokens:  # the masks need this pass's log-probs / entropies first: one more read of the logits
        with torch.no_grad():
            first_pass = logprob_pass(opts.top_entropy_quantile < 1.0)
        importance_weights, policy_mask, bonus_mask = _with_policy_masks(
            rows, first_pass, mask_seq, advantages, old_logps if sampling_logps is None else sampling_logps,
            importance_weights, opts)

    if engine == "triton" and logits.stride(-1) != 1:
        raise ValueError(
            f"backend='triton' needs logits with a unit last stride, got strides {tuple(logits.stride())}; "
            "views that slice B or T are fine, a transposed vocabulary is not (call .contiguous())"
        )
    if engine == "triton" and opts.loss_in_kernel and not sharded:  # the per-token loss math runs in the kernel
        kernel_inputs = (full, completion_ids.contiguous(), *_per_token_kernel_inputs(
            rows, mask, advantages, old_logps, ref_logps, importance_weights, opts))
        wants_grad = torch.is_grad_enabled() and logits.requires_grad
        if one_pass is None:  # the device sweep's measured choice for this GPU and vocabulary, else one-pass
            one_pass = launch_module().default_one_pass(logits)
        if one_pass and wants_grad and not in_place_backward:  # dlogits written in the forward
            loss, loss_t, logp, entropy, kl, flags = FusedTokenLossOnePass.apply(
                *kernel_inputs, _grad_weight(mask_seq, opts, normalizer, loss_scale, rows), opts, trailing,
                _entropy_grad_weight(bonus_mask, opts, loss_scale, rows))
        else:  # two-pass: dLoss/dlogp (and dLoss/dH) applied by the backward kernel
            loss_t, logp, entropy, kl, flags = FusedTokenLoss.apply(*kernel_inputs, opts, in_place_backward,
                                                                    trailing)
            loss = _reduced(rows.seq(loss_t), mask_seq, opts, normalizer, loss_scale, rows.seq(entropy), bonus_mask)
        return _as_called(_output_from_kernel(loss, loss_t, logp, entropy, kl, flags, mask, opts), rows, user_shape)
    logp, entropy = logprob_pass(opts.compute_entropy, in_place_backward)
    return _loss_in_torch(rows, user_shape, logp, entropy, mask_seq, advantages, old_logps, ref_logps,
                          importance_weights, normalizer, opts, loss_scale, bonus_mask, policy_mask)


def _loss_in_torch(rows: Rows, user_shape, logp, entropy, mask_seq, advantages, old_logps, ref_logps,
                   importance_weights, normalizer, opts, loss_scale, bonus_mask, policy_mask) -> GRPOLossOutput:
    """The loss math in torch on differentiable log-probs (and entropy) of the token layout: every
    per-token input taken to the sequence layout, the output given back as the caller shaped it."""
    return _as_called(_loss_from_logps(rows.seq(logp), rows.seq(entropy), mask_seq, rows.seq(advantages),
                                       rows.seq(old_logps), rows.seq(ref_logps), rows.seq(importance_weights),
                                       normalizer, opts, loss_scale, bonus_mask, policy_mask),
                      rows, user_shape, seq_layout=True)


def _sharded_vocab_start(logits_like, ids, group, vocab_start_index, check_ids, *, mask=None, normalizer=None) -> int:
    """This rank's first vocabulary id (``vocab_parallel.vocab_range``), after checking the ids, which are
    global, against the whole vocabulary (with ``check_ids``: one host sync, as unsharded)."""
    from .vocab_parallel import vocab_range

    start, vocab_size = vocab_range(logits_like, group, vocab_start_index)
    whole = logits_like.new_empty(()).expand(*logits_like.shape[:2], vocab_size)  # shape checks only, no memory
    check_token_ids(ids, whole, check_ids, mask=mask, normalizer=normalizer)
    return start


def _as_called(out: GRPOLossOutput, rows: Rows, user_shape, seq_layout: bool = False) -> GRPOLossOutput:
    """A packed call's output with its per-token log-probs in the token layout, shaped as its ids (from the
    sequence layout with ``seq_layout``); a padded call's as it is."""
    if user_shape is None:
        return out
    logps = rows.from_seq(out.per_token_logps) if seq_layout else out.per_token_logps
    return GRPOLossOutput(out.loss, out.metrics, logps.reshape(user_shape))


def _vocab_parallel_logprobs(logits, ids, mask, temperature, compute_entropy, engine, group, start):
    """Global (log-probs, entropy) [B, T] from this rank's vocabulary slice (``vocab_parallel.py``); no mask
    reads every token."""
    from .vocab_parallel import VocabParallelLogprobs

    flat_mask = None if mask is None else mask.reshape(-1).contiguous()
    return VocabParallelLogprobs.apply(logits, ids.contiguous(), flat_mask, float(temperature), compute_entropy, engine,
                                       group, start)


def _vocab_parallel_linear_logprobs(flat, temperature, compute_entropy, engine, group, start):
    """Global (log-probs, entropy) [N] from this rank's lm_head shard (``vocab_parallel.py``)."""
    from .vocab_parallel import VocabParallelLinearLogprobs

    return VocabParallelLinearLogprobs.apply(*flat, float(temperature), compute_entropy, engine, group, start)


def _packed_inputs(cu_seqlens, logits, ids, mask, advantages, old_logps, ref_logps, importance_weights,
                   sampling_logps, what: str = "logits"):
    """Check a packed call and give its tensors as one row: (Rows, logits [1, total, V], and ids, mask,
    old, ref, sampling log-probs as [1, total]); advantages and importance weights stay as given
    (per sequence [S] or per token [total]), read through the Rows."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or \
            cu_seqlens.dtype not in (torch.int32, torch.int64):
        got = (f"shape {tuple(cu_seqlens.shape)}, dtype {cu_seqlens.dtype}" if isinstance(cu_seqlens, torch.Tensor)
               else type(cu_seqlens).__name__)
        raise ValueError(f"cu_seqlens must be an int32 / int64 tensor [S + 1] (flash-attention's convention), "
                         f"got {got}")
    if what == "logits":
        check_logits(logits if logits.dim() == 3 else logits.unsqueeze(0))
    if not isinstance(logits, torch.Tensor) or logits.dim() not in (2, 3) or (
            logits.dim() == 3 and logits.shape[0] != 1):
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        last = "V" if what == "logits" else "H"
        raise ValueError(f"packed {what} must be [total, {last}] or [1, total, {last}], got {got}")
    rows3 = logits if logits.dim() == 3 else logits.unsqueeze(0)
    total = rows3.shape[1]
    if cu_seqlens.device != logits.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but logits is on {logits.device}")
    bounds = cu_seqlens.detach().cpu()
    if int(bounds[0]) != 0 or int(bounds[-1]) != total or bool((bounds[1:] < bounds[:-1]).any()):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the packed token count {total}, "
                         f"got {bounds.tolist()[:8]}{' ...' if bounds.numel() > 8 else ''}")
    rows = Rows(1, total, cu_seqlens)

    def one_row(name, t):
        if t is None:
            return None
        if not isinstance(t, torch.Tensor) or t.numel() != total or t.dim() not in (1, 2) or t.shape[-1] != total:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} of a packed batch must be [total] or [1, total] with total = {total}, got {got}")
        return t.reshape(1, total)

    for name, t in (("advantages", advantages), ("importance_weights", importance_weights)):
        if t is None:
            continue
        per_sequence = isinstance(t, torch.Tensor) and t.dim() in (1, 2) and t.numel() == rows.S and \
            (t.dim() == 1 or t.shape[1] == 1)
        if not per_sequence:
            one_row(f"{name} (per token; or per sequence [S] = [{rows.S}])", t)
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    return (rows, rows3, one_row("completion_ids", ids), one_row("completion_mask", mask),
            one_row("old_logps", old_logps), one_row("ref_logps", ref_logps), one_row("sampling_logps", sampling_logps))


def _with_policy_masks(rows: Rows, first_pass, mask_seq, advantages, sampling_logps, importance_weights,
                       opts: GRPOOptions):
    """TRL's policy-term masks from a first, gradient-free pass's (log-probs, entropy) in the token layout
    (0 at masked tokens): the masks need every token's entropy (the top-entropy quantile, gathered across
    processes) or each row's mean log-prob gap (the off-policy mask) before any gradient is final. They
    are computed in the sequence layout (``mask_seq``).

    Returns (importance weights, policy mask, the entropy bonus's tokens). Where the kernels compute
    the loss, the masks are folded into the importance weights (sequence layout), which multiply the
    policy term only, as TRL's masks do: so the one-pass kernel still writes the gradient in its single
    pass. Where the loss math runs in torch, the mask stays separate (vespo takes the importance
    weights into its sequence weight instead of the loss)."""
    logp, entropy = (rows.seq(t) for t in first_pass)
    policy_mask, entropy_mask = objective.policy_masks(logp, entropy, mask_seq, rows.seq(advantages).detach().float(),
                                                 rows.seq(sampling_logps), opts)
    bonus_mask = mask_seq if entropy_mask is None else mask_seq * entropy_mask
    importance_weights = rows.seq(importance_weights)
    if not opts.loss_in_kernel:
        return importance_weights, policy_mask, bonus_mask
    if importance_weights is not None:
        policy_mask = importance_weights.detach().float() * policy_mask
    return policy_mask.expand_as(mask_seq), None, bonus_mask


def _checked_drop_last_position(drop_last_position, logits, completion_ids) -> bool:
    """``drop_last_position`` after checking that the logits carry exactly one position more than the ids."""
    if not isinstance(drop_last_position, bool):
        raise TypeError(f"drop_last_position must be a bool, got {drop_last_position!r}")
    if drop_last_position:
        check_logits(logits)
        T = completion_ids.shape[-1] if isinstance(completion_ids, torch.Tensor) and completion_ids.dim() == 2 else None
        if T is None or logits.shape[1] != T + 1:
            got = tuple(completion_ids.shape) if isinstance(completion_ids, torch.Tensor) else None
            raise ValueError(f"drop_last_position=True needs logits [B, T + 1, V] for completion_ids [B, T], got "
                             f"logits {tuple(logits.shape)} and completion_ids {got}")
    return drop_last_position


def _checked_loss_scale(loss_scale):
    if isinstance(loss_scale, torch.Tensor):
        if loss_scale.numel() != 1 or not loss_scale.dtype.is_floating_point:
            raise ValueError(f"loss_scale must be a number or a one-element float tensor, got shape "
                             f"{tuple(loss_scale.shape)} and dtype {loss_scale.dtype}")
        return loss_scale.detach().reshape(())
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not math.isfinite(loss_scale):
        raise ValueError(f"loss_scale must be a finite number (e.g. 1 / gradient-accumulation steps), got "
                         f"{loss_scale!r}")
    return float(loss_scale)


def _reduced(per_token_loss, mask, opts: GRPOOptions, normalizer, loss_scale, entropy=None, bonus_mask=None):
    """TRL's reduction of the per-token loss, less the entropy bonus (with ``entropy_coef``, over
    ``bonus_mask``'s tokens), times ``loss_scale`` (an O(1) op whose backward only scales the
    O(B * T) per-token gradients)."""
    loss = objective.reduce_loss(per_token_loss, mask, opts, normalizer)
    if opts.entropy_coef != 0.0:
        loss = loss - objective.entropy_bonus(entropy, mask if bonus_mask is None else bonus_mask, opts)
    return _scaled(loss, loss_scale)


def _scaled(x, loss_scale):
    """``x * loss_scale``, with no op at all for a plain 1.0 (a Python float)."""
    return x if isinstance(loss_scale, float) and loss_scale == 1.0 else x * loss_scale


def _kernel_weights(weights: torch.Tensor, loss_scale, rows: Optional[Rows]) -> torch.Tensor:
    """Per-token weights of the sequence layout ([B, T], or a packed batch's [S, T_max] with ``rows``),
    scaled, as the one-pass kernels read them: fp32 [N]."""
    weights = _scaled(weights, loss_scale)
    weights = weights if rows is None else rows.from_seq(weights)
    return weights.float().reshape(-1).contiguous()


def _grad_weight(mask, opts: GRPOOptions, normalizer, loss_scale, rows: Optional[Rows] = None) -> torch.Tensor:
    """Each token's weight in the reduced, scaled loss (``mask`` in the sequence layout)."""
    return _kernel_weights(objective.reduction_weights(mask, opts, normalizer), loss_scale, rows)


def _entropy_grad_weight(mask, opts: GRPOOptions, loss_scale, rows: Optional[Rows] = None) -> Optional[torch.Tensor]:
    """Each token's dLoss/dH (the entropy bonus, scaled), or None without one."""
    if opts.entropy_coef == 0.0:
        return None
    return _kernel_weights(objective.entropy_bonus_weights(mask, opts), loss_scale, rows)


def _neutral_at_masked(t: Optional[torch.Tensor], active: torch.Tensor, fill: float) -> Optional[torch.Tensor]:
    """A detached fp32 per-token input with ``fill`` wherever no token counts.

    [B, T] inputs are replaced at masked tokens, per-row ([B] / [B, 1]) inputs on rows with
    no active token, so that whatever a caller pads with (-100, NaN, inf) never enters the
    arithmetic: a 0 weight cannot cancel a NaN (NaN * 0 is NaN, and so is its gradient).
    """
    if t is None:
        return None
    t = objective.as_row_column(t.detach().float())
    where = active if t.shape[1] == active.shape[1] else active.any(-1, keepdim=True)  # [B, T] or per row
    return torch.where(where, t, fill)


def _loss_from_logps(logp, entropy, mask, advantages, old_logps, ref_logps, importance_weights, normalizer,
                     opts: GRPOOptions, loss_scale=1.0, bonus_mask=None, policy_mask=None) -> GRPOLossOutput:
    """The O(B * T) part on differentiable log-probs: per-token terms, reduction, metrics.

    ``logp`` (and ``entropy``) are 0 at masked tokens; the per-token inputs get neutral
    values there (ratio 1, KL 0, advantage 0) and are detached: no gradient reaches them.
    """
    active = mask != 0
    terms = objective.per_token_terms(
        logp, mask, _neutral_at_masked(advantages, active, 0.0), _neutral_at_masked(old_logps, active, 0.0),
        _neutral_at_masked(ref_logps, active, 0.0), _neutral_at_masked(importance_weights, active, 1.0), opts,
        policy_mask,
    )
    loss = _reduced(terms.per_token_loss, mask, opts, normalizer, loss_scale, entropy, bonus_mask)
    return GRPOLossOutput(loss, objective.loss_metrics(terms, entropy, mask, opts), logp.detach())


def _detached(normalizer):
    return normalizer.detach() if isinstance(normalizer, torch.Tensor) else normalizer


@torch.no_grad()
def token_logprobs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    backend: str = "auto",
    check_ids: bool = True,
    drop_last_position: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    vocab_parallel_group=None,
    vocab_start_index: Optional[int] = None,
):
    """Per-token log softmax(logits / temperature)[ids] in fp32 [B, T], without gradient.

    For a trainer's old and reference log-probs; the same kernel as the loss, one read of
    the logits. logits [B, T, V] (or [B, T + 1, V] with ``drop_last_position``, as in
    ``grpo_loss``), or a packed batch's [total, V] with ``cu_seqlens`` (the result is then [total]:
    log-probs are per token, the sequences only need to be valid). With ``return_entropy`` returns
    ``(logps, entropy)``. With ``vocab_parallel_group``, ``logits`` is this rank's vocabulary slice
    and the ids are global, as in ``grpo_loss``.
    """
    if cu_seqlens is not None:
        rows3 = _packed_inputs(cu_seqlens, logits, ids, None, None, None, None, None, None)
        flat = token_logprobs(rows3[1], rows3[2], temperature, return_entropy, backend=backend, check_ids=check_ids,
                              vocab_parallel_group=vocab_parallel_group, vocab_start_index=vocab_start_index)
        return tuple(t.reshape(-1) for t in flat) if return_entropy else flat.reshape(-1)
    check_logits(logits)
    logits = aligned(logits, _checked_drop_last_position(drop_last_position, logits, ids))  # a view, no copy
    GRPOOptions(temperature=temperature)  # validates the temperature
    engine = resolve_backend(backend, logits)
    if vocab_parallel_group is not None:
        start = _sharded_vocab_start(logits, ids, vocab_parallel_group, vocab_start_index, check_ids)
        logp, entropy = _vocab_parallel_logprobs(logits, ids, None,
                                                 temperature, return_entropy, engine, vocab_parallel_group, start)
        return (logp, entropy) if return_entropy else logp
    check_token_ids(ids, logits, check_ids)
    logp, entropy = TokenLogprobs.apply(logits, ids.contiguous(), None, float(temperature), return_entropy,
                                        engine, False)
    return (logp, entropy) if return_entropy else logp


LM_HEAD_MODES = ("recompute", "three_products")


def _check_linear_inputs(hidden_states, weight, bias) -> None:
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        got = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
        raise ValueError(f"hidden_states must be [B, T, H], got {got}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden_states.shape[-1]:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be the lm_head weight [V, H] with H = {hidden_states.shape[-1]}, got {got}")
    for name, t in (("hidden_states", hidden_states), ("weight", weight)):
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if weight.dtype != hidden_states.dtype or weight.device != hidden_states.device:
        raise ValueError(f"weight ({weight.dtype}, {weight.device}) must match hidden_states "
                         f"({hidden_states.dtype}, {hidden_states.device})")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.device != weight.device):
        raise ValueError(f"bias must be [V] = ({weight.shape[0]},) on {weight.device}, got {tuple(bias.shape)} "
                         f"on {bias.device}")


def fused_linear_grpo_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: Optional[torch.Tensor] = None,
    ref_logps: Optional[torch.Tensor] = None,
    importance_weights: Optional[torch.Tensor] = None,
    normalizer=None,
    *,
    bias: Optional[torch.Tensor] = None,
    options: Optional[GRPOOptions] = None,
    backend: str = "auto",
    check_ids: bool = True,
    loss_scale=1.0,
    lm_head_mode: Optional[str] = None,
    sampling_logps: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    vocab_parallel_group=None,
    vocab_start_index: Optional[int] = None,
    **option_kwargs,
) -> GRPOLossOutput:
    """The GRPO loss from hidden states [B, T, H] and the lm_head weight [V, H], never holding [N, V] logits.

    ``hidden_states[:, t]`` is the state whose logits predict ``completion_ids[:, t]``. Every
    option, output and metric is that of ``grpo_loss`` on ``hidden_states @ weight.T + bias``.
    A weight that does not require grad (a frozen lm_head, LoRA) gets no gradient pass.

    ``lm_head_mode`` (Triton, token level): "recompute" (4 products: the backward recomputes
    each chunk's logits inside the kernels) or "three_products" (each chunk's logits computed
    once by cuBLAS, turned into dlogits in place by the one-pass kernel, both gradient products
    in the same loop; the backward only scales). Both keep one [chunk, V] workspace. None, the
    default, takes the device sweep's measured choice (``kernels/tuned.json``), else "recompute".
    """
    if options is not None and option_kwargs:
        raise ValueError(f"pass options either as options= or as keywords, got both (keywords {sorted(option_kwargs)})")
    opts = options if options is not None else GRPOOptions(**option_kwargs)
    rows, user_shape = None, None
    if cu_seqlens is not None:  # a packed batch: see grpo_loss
        user_shape = completion_ids.shape if isinstance(completion_ids, torch.Tensor) else None
        rows, hidden_states, completion_ids, completion_mask, old_logps, ref_logps, sampling_logps = _packed_inputs(
            cu_seqlens, hidden_states, completion_ids, completion_mask, advantages, old_logps, ref_logps,
            importance_weights, sampling_logps, what="hidden_states")
    _check_linear_inputs(hidden_states, weight, bias)
    B, T, H = hidden_states.shape
    logits_like = hidden_states.new_empty(()).expand(B, T, weight.shape[0])  # shape checks only, no memory
    sharded = vocab_parallel_group is not None
    check_inputs(logits_like, completion_ids, completion_mask,
                 rows.tokens(advantages).view(1, -1) if rows else advantages, old_logps, ref_logps,
                 None if rows else importance_weights, normalizer, opts, check_ids and not sharded)
    if sharded:  # weight is this rank's shard [V / P, H]; the ids are global (see grpo_loss)
        vocab_start = _sharded_vocab_start(logits_like, completion_ids, vocab_parallel_group, vocab_start_index,
                                           check_ids, mask=completion_mask, normalizer=normalizer)
    rows = rows or Rows(B, T)
    check_per_token("sampling_logps", sampling_logps, logits_like, allow_row=False)
    engine = resolve_backend(backend, hidden_states)
    loss_scale = _checked_loss_scale(loss_scale)
    normalizer = _detached(normalizer)
    mask = completion_mask.float()
    # Masked tokens are never read: their hidden states become 0 and their ids 0 (one O(N * H)
    # copy, which also makes a sliced view contiguous). Padding garbage (NaN, inf) would
    # otherwise reach d weight, a sum over every token's hidden state.
    active = (mask != 0).reshape(B * T, 1)
    flat = (torch.where(active, hidden_states.reshape(B * T, H), 0.0), weight.contiguous(),
            None if bias is None else bias.contiguous(),
            torch.where(active.squeeze(1), completion_ids.reshape(-1), 0).contiguous())
    if lm_head_mode is None:
        lm_head_mode = ("recompute" if engine != "triton"
                        else lm_head_launch_module().default_lm_head_mode(hidden_states, weight.shape[0]))
    if lm_head_mode not in LM_HEAD_MODES:
        raise ValueError(f"lm_head_mode must be one of {list(LM_HEAD_MODES)}, got {lm_head_mode!r}")
    wants_grad = torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad)
    mask_seq = rows.seq(mask)  # the sequence layout of the reductions (see grpo_loss)
    bonus_mask, policy_mask = mask_seq, None

    def logprob_pass(compute_entropy: bool):
        """This call's (log-probs, entropy) [B, T], differentiable, 0 at masked tokens, as in the logits path."""
        pair = (_vocab_parallel_linear_logprobs(flat, opts.temperature, compute_entropy, engine,
                                                vocab_parallel_group, vocab_start) if sharded
                else LinearTokenLogprobs.apply(*flat, opts.temperature, compute_entropy, engine))
        return tuple(None if t is None else torch.where(active.view(B, T), t.view(B, T), 0.0) for t in pair)

    if opts.masks_tokens:  # a first, gradient-free pass for the masks (see _with_policy_masks)
        with torch.no_grad():
            first_pass = logprob_pass(opts.top_entropy_quantile < 1.0)
        importance_weights, policy_mask, bonus_mask = _with_policy_masks(
            rows, first_pass, mask_seq, advantages, old_logps if sampling_logps is None else sampling_logps,
            importance_weights, opts)
    if engine == "triton" and opts.loss_in_kernel and lm_head_mode == "three_products" and not sharded:
        per_token = _per_token_kernel_inputs(rows, mask, advantages, old_logps, ref_logps, importance_weights, opts)
        if wants_grad:
            loss, loss_t, logp, entropy, kl, flags = FusedLinearThreeProducts.apply(
                *flat, *per_token, _grad_weight(mask_seq, opts, normalizer, loss_scale, rows), opts, (B, T),
                _entropy_grad_weight(bonus_mask, opts, loss_scale, rows))
        else:  # no gradient wanted: cuBLAS logits and the logits kernel, a chunk at a time
            r = lm_head_launch_module().linear_three_products(
                *flat, opts=opts, mask=per_token[0], advantages=per_token[1],
                old_logps=per_token[2], ref_logps=per_token[3], importance_weights=per_token[4],
                compute_entropy=opts.compute_entropy, grad_weight=None, compute_weight_grad=False)[0]
            view = lambda t: None if t is None else t.view(B, T)  # noqa: E731
            loss_t, logp, entropy, kl, flags = (view(r.loss), view(r.logp), view(r.entropy), view(r.kl),
                                                view(r.flags))
            loss = _reduced(rows.seq(loss_t), mask_seq, opts, normalizer, loss_scale, rows.seq(entropy), bonus_mask)
        out = _output_from_kernel(loss, loss_t, logp, entropy, kl, flags, mask, opts)
    elif engine == "triton" and opts.loss_in_kernel and not sharded:  # the per-token loss math runs in the kernel
        loss_t, logp, entropy, kl, flags = FusedLinearTokenLoss.apply(
            *flat, *_per_token_kernel_inputs(rows, mask, advantages, old_logps, ref_logps, importance_weights, opts),
            opts, (B, T),
        )
        loss = _reduced(rows.seq(loss_t), mask_seq, opts, normalizer, loss_scale, rows.seq(entropy), bonus_mask)
        out = _output_from_kernel(loss, loss_t, logp, entropy, kl, flags, mask, opts)
    else:
        logp, entropy = logprob_pass(opts.compute_entropy)
        return _loss_in_torch(rows, user_shape, logp, entropy, mask_seq, advantages, old_logps, ref_logps,
                              importance_weights, normalizer, opts, loss_scale, bonus_mask, policy_mask)
    return _as_called(out, rows, user_shape)


def _differentiable_logprobs(logits, index, temperature, backend, compute_entropy, in_place_backward,
                             vocab_parallel_group, vocab_start_index):
    """(log-probs, entropy or None) with gradients, shaped like ``index`` (``logits`` without V); index None:
    the entropy alone. The one body of ``selective_log_softmax``, ``token_entropy`` and both at once."""
    as_3d, lead = _last_dim_rows(logits)
    if index is not None and tuple(index.shape) != tuple(lead):
        raise ValueError(f"index must have shape {tuple(lead)} (logits without V), got {tuple(index.shape)}")
    GRPOOptions(temperature=temperature)  # validates the temperature
    check_in_place(in_place_backward, logits)
    engine = resolve_backend(backend, logits)
    ids = (torch.zeros(as_3d.shape[:2], dtype=torch.long, device=logits.device) if index is None  # no target
           else index.reshape(as_3d.shape[:2]))
    if vocab_parallel_group is not None:
        if in_place_backward:
            raise ValueError("in_place_backward=True is not supported with vocab_parallel_group")
        start = _sharded_vocab_start(as_3d, ids, vocab_parallel_group, vocab_start_index, index is not None)
        logp, entropy = _vocab_parallel_logprobs(as_3d, ids, None, temperature, compute_entropy, engine,
                                                 vocab_parallel_group, start)
    else:
        if index is not None:
            check_token_ids(ids, as_3d, True)
        logp, entropy = TokenLogprobs.apply(as_3d, ids.contiguous(), None, float(temperature), compute_entropy,
                                            engine, in_place_backward)
    return logp.reshape(lead), None if entropy is None else entropy.reshape(lead)


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0, *, backend: str = "auto",
    in_place_backward: bool = False, vocab_parallel_group=None, vocab_start_index: Optional[int] = None,
) -> torch.Tensor:
    """Differentiable ``log_softmax(logits / temperature).gather(-1, index)`` in fp32, on the fused kernel.

    logits [..., V] (any leading dims, e.g. verl's packed [N, V]); index [...]. The gradient
    is written in the logits' dtype without materializing the log-softmax: a drop-in for
    TRL's ``selective_log_softmax`` and verl's ``logprobs_from_logits``. With ``vocab_parallel_group``
    the logits are this rank's vocabulary slice and the index global (Megatron's layout, as in
    ``grpo_loss``): a drop-in for verl's ``vocab_parallel_log_probs_from_logits``.
    """
    return _differentiable_logprobs(logits, index, temperature, backend, False, in_place_backward,
                                    vocab_parallel_group, vocab_start_index)[0]


def _last_dim_rows(logits: torch.Tensor):
    """logits [..., V] as [B, T, V] (a view where possible) and the leading shape."""
    lead = logits.shape[:-1]
    as_3d = logits if logits.dim() == 3 else logits.reshape(1, -1, logits.shape[-1])
    check_logits(as_3d)
    return as_3d, lead


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, *, backend: str = "auto",
                  vocab_parallel_group=None, vocab_start_index: Optional[int] = None) -> torch.Tensor:
    """Differentiable entropy of softmax(logits / temperature) over the last dim, fp32 [...], on the fused kernel.

    One read of the logits in the forward, one more in the backward, which writes
    dH/dlogits = -p (log p + H) / tau scaled by the incoming gradient, in the logits' dtype; no
    fp32 [N, V] softmax is materialized. A drop-in for verl's ``entropy_from_logits`` (and, with
    ``vocab_parallel_group``, on this rank's vocabulary slice, for ``vocab_parallel_entropy``).
    """
    return _differentiable_logprobs(logits, None, temperature, backend, True, False,
                                    vocab_parallel_group, vocab_start_index)[1]


def selective_log_softmax_and_entropy(logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0, *,
                                      backend: str = "auto", vocab_parallel_group=None,
                                      vocab_start_index: Optional[int] = None):
    """``(selective_log_softmax(...), token_entropy(...))`` from one pass over the logits, both differentiable
    (the backward is one pass too, whichever of the two the loss uses). fp32, shapes ``index.shape``."""
    return _differentiable_logprobs(logits, index, temperature, backend, True, False,
                                    vocab_parallel_group, vocab_start_index)


class GRPOLoss(nn.Module):
    """Drop-in GRPO loss from logits, fused in Triton on CUDA (chunked torch on CPU).

    Options (TRL ``GRPOConfig`` names): loss_type, beta, epsilon, epsilon_high, delta,
    dual_clip, importance_sampling_level, temperature, max_completion_length,
    use_bias_correction_kl, sapo_temperature_pos, sapo_temperature_neg, kl_estimator,
    log_ratio_clamp, kl_clamp, compute_entropy; plus ``backend`` ("auto", "triton",
    "torch"), ``in_place_backward`` (write dlogits into the logits' storage) and
    ``check_ids`` (validate active token ids and a tensor normalizer, one host sync),
    ``one_pass`` (Triton, token level: write dlogits in the forward, 2 x S bytes instead of
    3 x S; None, the default, takes the device sweep's measured choice for the GPU and
    vocabulary from ``kernels/tuned.json``, and one-pass where nothing was measured),
    ``drop_last_position`` (logits are [B, T + 1, V]; see below).

    Call: ``loss_fn(logits, completion_ids, completion_mask, advantages, old_logps=None,
    ref_logps=None, importance_weights=None, normalizer=None)``

    - logits [B, T, V] (fp32 / bf16 / fp16; a view with unit last stride is read in place), or
      [B, T + 1, V] as the model returns them with ``drop_last_position=True`` (the last
      position is ignored; this saves the copy autograd makes of a ``logits[:, :-1]`` view's
      gradient)
    - completion_ids [B, T] integers in [0, V); completion_mask [B, T] bool / int / float
    - advantages [B] or [B, T]; old_logps [B, T] or None (on-policy, ratio 1);
      ref_logps [B, T] when beta > 0; importance_weights [B], [B, 1] or [B, T]
    - normalizer: token count for dapo / cispo / vespo (default: local active tokens)

    Returns ``GRPOLossOutput(loss, metrics, per_token_logps)``. Per-step values may change
    between calls (``loss_fn.update(beta=0.02)``) without recompiling a kernel.
    """

    def __init__(self, *, backend: str = "auto", in_place_backward: bool = False, check_ids: bool = True,
                 one_pass: Optional[bool] = None, options: Optional[GRPOOptions] = None, preset: Optional[str] = None,
                 drop_last_position: bool = False, vocab_parallel_group=None, vocab_start_index: Optional[int] = None,
                 **option_kwargs):
        super().__init__()
        if options is not None and (option_kwargs or preset is not None):
            raise ValueError("pass options either as options= or as keywords (with an optional preset=), got both")
        if options is None:
            options = (GRPOOptions.from_preset(preset, **option_kwargs) if preset is not None
                       else GRPOOptions(**option_kwargs))
        self.options = options
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
        self.backend = backend
        self.in_place_backward = in_place_backward
        self.check_ids = check_ids
        self.one_pass = one_pass
        self.drop_last_position = drop_last_position
        self.vocab_parallel_group, self.vocab_start_index = vocab_parallel_group, vocab_start_index

    @classmethod
    def from_trl_config(cls, config, **kwargs) -> "GRPOLoss":
        """A GRPOLoss with a TRL ``GRPOConfig``'s loss options (TRL's conventions)."""
        module_kwargs = {k: kwargs.pop(k) for k in ("backend", "in_place_backward", "check_ids", "one_pass",
                                                    "drop_last_position") if k in kwargs}
        return cls(options=GRPOOptions.from_trl_config(config, **kwargs), **module_kwargs)

    def update(self, **changes) -> "GRPOLoss":
        """Change options between steps (e.g. a beta or temperature schedule)."""
        self.options = self.options.replace(**changes)
        return self

    def extra_repr(self) -> str:
        return f"{self.options}, backend={self.backend!r}"

    def forward(self, logits, completion_ids, completion_mask, advantages, old_logps=None, ref_logps=None,
                importance_weights=None, normalizer=None, loss_scale=1.0, sampling_logps=None,
                cu_seqlens=None) -> GRPOLossOutput:
        return grpo_loss(
            logits, completion_ids, completion_mask, advantages, old_logps, ref_logps, importance_weights,
            normalizer, options=self.options, backend=self.backend, in_place_backward=self.in_place_backward,
            check_ids=self.check_ids, one_pass=self.one_pass, loss_scale=loss_scale,
            drop_last_position=self.drop_last_position, sampling_logps=sampling_logps, cu_seqlens=cu_seqlens,
            vocab_parallel_group=self.vocab_parallel_group, vocab_start_index=self.vocab_start_index,
        )


class FusedLinearGRPOLoss(GRPOLoss):
    """``GRPOLoss`` from hidden states and the lm_head weight: the [N, V] logits are never materialized.

    Same options and outputs as ``GRPOLoss``; call with
    ``(hidden_states [B, T, H], weight [V, H], completion_ids, completion_mask, advantages,
    old_logps=None, ref_logps=None, importance_weights=None, normalizer=None, bias=None)``.
    """

    def __init__(self, *, lm_head_mode: Optional[str] = None, **kwargs):
        for name in ("in_place_backward", "one_pass", "drop_last_position"):  # they concern logits only
            if kwargs.get(name):
                raise ValueError(f"{name}={kwargs[name]!r} applies to GRPOLoss on logits; FusedLinearGRPOLoss takes "
                                 "hidden states and never holds logits (its modes: lm_head_mode=)")
        super().__init__(**kwargs)
        if lm_head_mode is not None and lm_head_mode not in LM_HEAD_MODES:
            raise ValueError(f"lm_head_mode must be one of {list(LM_HEAD_MODES)}, got {lm_head_mode!r}")
        self.lm_head_mode = lm_head_mode

    def forward(self, hidden_states, weight, completion_ids, completion_mask, advantages, old_logps=None,
                ref_logps=None, importance_weights=None, normalizer=None, bias=None, loss_scale=1.0,
                sampling_logps=None, cu_seqlens=None) -> GRPOLossOutput:
        return fused_linear_grpo_loss(
            hidden_states, weight, completion_ids, completion_mask, advantages, old_logps, ref_logps,
            importance_weights, normalizer, bias=bias, options=self.options, backend=self.backend,
            check_ids=self.check_ids, loss_scale=loss_scale, lm_head_mode=self.lm_head_mode,
            sampling_logps=sampling_logps, cu_seqlens=cu_seqlens, vocab_parallel_group=self.vocab_parallel_group,
            vocab_start_index=self.vocab_start_index,
        )
