"""The vocabulary-parallel loss: each process holds a contiguous slice of the vocabulary's logits.

Megatron's layout (a column-parallel lm_head): rank r of the group holds logits [B, T, V / P]
for token ids [start, start + V / P); the ids stay global. Each rank runs the logits kernel on
its slice (a log-sum-exp, the entropy's sums and, where it owns the target, the target's logit),
then three all-reduces of O(B * T) values combine them, never a logit:

  m = max over ranks of lse_r                       (the global max, for stability)
  W = sum_r exp(lse_r - m),  lse = m + log W        (the global log-sum-exp)
  E = sum_r exp(lse_r - m) (lse_r - H_r)            (sum over V of p x, in each rank's share)
  H = lse - E / W                                   (the global entropy)
  x_t = the target's logit / tau, from its owner    (0 elsewhere; summed)

The loss math runs on the global log-probs (and entropy) in torch, identical on every rank.
The backward writes each rank's slice of dlogits with the global lse and H in the same
kernel as the single-device path; the target's one-hot term belongs to its owner only.

A vocabulary-parallel call's source is one of this module's (``sharded_source``, chosen by
``inputs.prepare_inputs``): the input forms know nothing of sharding, and the imports run one way,
``inputs`` -> ``vocab_parallel`` -> ``from_logits`` / ``from_hidden_states``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import kept_set
from .from_hidden_states import (
    HiddenStatesSource,
    as_input_grads,
    flat_f32,
    flat_mask,
    kept_entries,
    linear_kept_terms,
    linear_logprobs_bwd,
    linear_logprobs_fwd,
)
from .from_logits import (
    LogitsSource,
    LogprobResult,
    logprobs_bwd,
    logprobs_fwd,
    zero_at_masked,
)
from .kernels.contracts import rounds_head_logits
from .sparse_entries import (
    at_ids_terms,
    at_ids_tokens,
    entry_logits,
    kept_gradient,
    kept_terms,
    summed_over_repeats,
    with_kept_set,
)
from .torch_path import capped
from .validation import check_token_ids


def owned_ids(ids: torch.Tensor, start: int, width: int) -> tuple:
    """(which ids this rank's slice [start, start + width) holds, each id as a column of the slice: its local id
    where owned, 0 elsewhere, contiguous): every sharded pass reads its target (or first top-k id) this way."""
    owned = (ids >= start) & (ids < start + width)
    return owned, torch.where(owned, ids - start, 0).contiguous()


def vocab_range(local: int, device, group, vocab_start_index: int | None) -> tuple:
    """(this rank's first id, the global vocabulary size) of a slice of ``local`` ids on ``device``: Megatron's
    equal partitions unless ``vocab_start_index`` says where this rank's slice starts. One all-reduce of one
    integer."""
    size = torch.tensor([local], device=device, dtype=torch.int64)
    dist.all_reduce(size, group=group)
    start = dist.get_rank(group) * local if vocab_start_index is None else int(vocab_start_index)
    total = int(size.item())
    if not 0 <= start <= total - local:
        raise ValueError(
            f"vocab_start_index {start} with {local} local logits does not fit the global vocabulary "
            f"of {total} (the sum of the ranks' slices)"
        )
    return start, total


class VocabParallelLogprobs(torch.autograd.Function):
    """Global log softmax(cap(logits) / tau)[ids] and entropy from this rank's vocabulary slice; both
    differentiable (cap: the head's soft-cap, none with ``softcap`` None)."""

    @staticmethod
    def forward(
        ctx,
        logits,
        ids,
        mask: torch.Tensor | None,
        temperature: float,
        softcap: float | None,
        compute_entropy: bool,
        backend: str,
        group,
        start: int,
        kept=None,
    ):
        ctx.set_materialize_grads(False)
        B, T, V_local = logits.shape
        owned, local_ids = owned_ids(ids, start, V_local)
        terms = kept_terms(logits, ids, kept, mask, temperature, softcap, backend, col0=start, group=group)
        r = logprobs_fwd(logits, local_ids, temperature, mask, compute_entropy, softcap, backend)
        as_bt = lambda t: None if t is None else t.view(B, T)  # noqa: E731
        lse_r, logp_r, entropy_r = as_bt(r.lse), as_bt(r.logp), as_bt(r.entropy)
        lse, logp, entropy, _ = _combine(lse_r, logp_r, entropy_r if compute_entropy else None, owned, group)
        logp, entropy, _ = over_sets(terms, logp, entropy)
        logp, entropy = zero_at_masked(mask, logp, entropy)  # the kernels never read masked rows: 0, as everywhere
        ctx.save_for_backward(logits, ids, local_ids, owned, lse, entropy)
        ctx.backend, ctx.temperature, ctx.softcap, ctx.start = backend, temperature, softcap, start
        ctx.kept, ctx.terms = kept, terms
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, ids, local_ids, owned, lse, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (grad_logp is None and grad_entropy is None):
            return (None,) * len(ctx.needs_input_grad)
        g_full = torch.zeros_like(lse) if grad_logp is None else grad_logp.float()
        h_full = None if grad_entropy is None else grad_entropy.float()
        g, h = kept_set.dense_share(ctx.terms, ctx.kept, g_full, h_full)  # a set's token's share: its entries'
        grad = slice_gradient(logits, local_ids, owned, lse, g, h, entropy, ctx.temperature, ctx.softcap, ctx.backend)
        if ctx.terms is not None:  # the sets' entries in this slice, written over the dense gradient
            kept_gradient(
                grad, ids, ctx.kept, ctx.terms, g_full, h_full, lse, entropy, ctx.temperature, ctx.softcap, ctx.backend,
                col0=ctx.start,
            )  # fmt: skip
        return (grad,) + (None,) * (len(ctx.needs_input_grad) - 1)


def slice_gradient(logits, local_ids, owned, lse, g, h, entropy, temperature: float, softcap, backend: str):
    """This rank's slice of dlogits of g = dLoss/dlogp (and h = dLoss/dH with the global ``entropy``), the global
    ``lse``: the single-device kernel on the slice, then, where this rank does not own the target (the kernel's
    one-hot landed on local column 0), that column rewritten without it, from its own logit (O(B * T), no host
    sync)."""
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    grad = logprobs_bwd(
        logits,
        local_ids,
        lse,
        g,
        temperature,
        softcap,
        False,
        backend,
        out=out,
        grad_entropy=h,
        entropy=entropy if h is not None else None,
    )
    inv_t = 1.0 / temperature
    x0, slope0 = capped(logits[..., 0].float(), softcap)
    log_p0 = x0 * inv_t - lse
    p0 = torch.exp(log_p0)
    column = -g * inv_t * p0
    if h is not None:
        column = column - h * inv_t * p0 * (torch.where(p0 > 0, log_p0, 0.0) + entropy)
    if slope0 is not None:
        column = column * slope0
    live = (g != 0) if h is None else (g != 0) | (h != 0)  # a masked row stays all zero
    grad[..., 0] = torch.where(~owned & live, column, grad[..., 0].float()).to(grad.dtype)
    return grad


def over_sets(terms, logp, entropy, squares=None) -> tuple:
    """The global (log-probs, entropy, Σπ²) [B, T] with each kept set's token's taken over its set
    (``sparse_entries.with_kept_set``; ``terms`` merged across the group), unchanged without sets."""
    if terms is None:
        return logp, entropy, squares
    flat = lambda t: None if t is None else t.reshape(-1)  # noqa: E731
    r = with_kept_set(LogprobResult(flat(logp), flat(entropy), None, flat(squares)), terms)
    as_shape = lambda t: None if t is None else t.view(logp.shape)  # noqa: E731
    return as_shape(r.logp), as_shape(r.entropy), as_shape(r.sum_squares)


def _combine(lse_r, logp_r, entropy_r, owned, group, squares_r=None):
    """The global (lse, log-probs, entropy, and with ``squares_r`` Σπ²) from each rank's slice: three all-reduces of
    O(N) values. A rank's Σπ² is its slice's own distribution's; the global one is sum_r exp(2 (lse_r - lse)) of
    them."""
    m = lse_r.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    w = torch.exp(lse_r - m)
    parts = [w, torch.where(owned, logp_r + lse_r, 0.0)]
    if entropy_r is not None:
        parts.append(w * (lse_r - entropy_r))
    if squares_r is not None:
        parts.append(w * w * squares_r)
    stats = torch.stack(parts)
    dist.all_reduce(stats, group=group)
    lse = m + torch.log(stats[0])
    entropy = (lse - stats[2] / stats[0]) if entropy_r is not None else None
    squares = stats[-1] / (stats[0] * stats[0]) if squares_r is not None else None
    return lse, stats[1] - lse, entropy, squares


class VocabParallelLinearLogprobs(torch.autograd.Function):
    """``VocabParallelLogprobs`` from hidden states [N, H] and this rank's lm_head weight shard [V / P, H]
    (Megatron's column-parallel head): no logits kept on any rank.

    The gradient of the hidden states sums every rank's share of the vocabulary. Who sums it is the caller's
    layout (``reduce_hidden_grad``): True, hidden states replicated over the group and nothing else reducing them,
    it is all-reduced here (O(N * H)), so every rank gets the unsharded d hidden; False, the caller's own mapping
    sums it (Megatron's ``gather_from_sequence_parallel_region``, whose backward reduce-scatters, or
    ``copy_to_tensor_model_parallel_region``, whose backward all-reduces), so this rank's share is returned. The
    weight and bias shards get their slices of the unsharded d weight and d bias either way.
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        ids,
        temperature: float,
        softcap: float | None,
        compute_entropy: bool,
        backend: str,
        group,
        start: int,
        mask=None,
        kept=None,
        reduce_hidden_grad: bool = True,
        fp32_logits: bool = False,
    ):
        ctx.set_materialize_grads(False)
        V_local = weight.shape[0]
        owned, local_ids = owned_ids(ids, start, V_local)
        terms = linear_kept_terms(
            hidden, weight, bias, ids, kept, mask, temperature, softcap, backend, col0=start, group=group,
            fp32_logits=fp32_logits,
        )  # fmt: skip
        r = linear_logprobs_fwd(
            hidden, weight, bias, local_ids, temperature, compute_entropy, softcap, backend, fp32_logits=fp32_logits
        )
        lse, logp, entropy, _ = _combine(r.lse, r.logp, r.entropy, owned, group)
        logp, entropy, _ = over_sets(terms, logp, entropy)
        ctx.save_for_backward(hidden, weight, bias, ids, local_ids, owned, lse, entropy)
        ctx.backend, ctx.temperature, ctx.softcap, ctx.group = backend, temperature, softcap, group
        ctx.start, ctx.kept, ctx.terms, ctx.reduce_hidden_grad = start, kept, terms, reduce_hidden_grad
        ctx.fp32_logits = fp32_logits
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, ids, local_ids, owned, lse, entropy = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return (None,) * len(ctx.needs_input_grad)
        g_full = torch.zeros_like(lse) if grad_logp is None else flat_f32(grad_logp)
        h_full = flat_f32(grad_entropy)
        g, h = kept_set.dense_share(ctx.terms, ctx.kept, g_full, h_full)  # a set's token's share: its entries'
        wants_weight = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
        dh, dw, db = linear_logprobs_bwd(
            hidden,
            weight,
            bias,
            local_ids,
            lse,
            g,
            ctx.temperature,
            ctx.softcap,
            ctx.backend,
            wants_weight,
            grad_entropy=h,
            entropy=entropy if h is not None else None,
            write_entries=kept_entries(
                ids, ctx.kept, ctx.terms, g_full, h_full, lse, entropy, ctx.temperature, ctx.softcap, ctx.backend,
                col0=ctx.start,
            ),
            fp32_logits=ctx.fp32_logits,
        )  # fmt: skip
        without_column_0_one_hot(
            dh, dw, db, hidden, weight, bias, owned, g, ctx.temperature, ctx.softcap, ctx.fp32_logits
        )
        summed_over_shards(dh, ctx)
        return as_input_grads(ctx, (dh, dw, db), (hidden, weight, bias)) + (None,) * (len(ctx.needs_input_grad) - 3)


def summed_over_shards(dh, ctx) -> None:
    """d hidden summed over every rank's share of the vocabulary, in place, where this op owns that sum
    (``ctx.reduce_hidden_grad``); else left as this rank's share, for the caller's mapping to sum."""
    if ctx.reduce_hidden_grad:
        dist.all_reduce(dh, group=ctx.group)


def without_column_0_one_hot(
    dh, dw, db, hidden, weight, bias, kept_column_0, g, temperature: float, softcap, fp32_logits: bool = False
):
    """Where this rank does not own the target (nor wrote column 0 over: ``kept_column_0``), the head's backward added
    the one-hot term g / tau at local column 0 (times the cap's chain factor there): taken out of d hidden,
    d weight[0] and d bias[0] (O(N * H)), in place."""
    spurious = torch.where(kept_column_0, 0.0, g / temperature)  # [N]
    if softcap is not None:
        x0 = hidden.float() @ weight[0].float() + (0.0 if bias is None else bias[0].float())
        if rounds_head_logits(hidden.dtype, fp32_logits):  # the head's logits are rounded to 16 bits first
            x0 = x0.to(hidden.dtype).float()
        spurious = spurious * capped(x0, softcap)[1]
    dh -= spurious.unsqueeze(1) * weight[0].float()
    if dw is not None:
        dw[0] -= spurious @ hidden.float()
    if db is not None:
        db[0] -= spurious.sum()


# ---- Log-probs at several ids a token (a teacher's top-k: ``distillation.py``) ------------------------------------


def _global_entry_logits(x, ids_k, start: int, width: int, group) -> torch.Tensor:
    """Each entry's x [N, K] from the rank whose slice holds its id (one all-reduce of N K values)."""
    here = owned_ids(ids_k.reshape(x.shape), start, width)[0]
    x = torch.where(here, x, 0.0)
    dist.all_reduce(x, group=group)
    return x


class VocabParallelLogprobsAtIds(torch.autograd.Function):
    """``from_logits.LogprobsAtIds`` from this rank's vocabulary slice [B, T, V / P], the ids global: the global
    log-sum-exp (``_combine``), each entry's logit from the rank that holds it; the backward writes this slice's
    gradient (``slice_gradient`` with g = sum_k G_k, then the entries in the slice)."""

    @staticmethod
    def forward(ctx, logits, ids_k, mask, temperature, softcap, backend, group, start: int):
        ctx.set_materialize_grads(False)
        B, T, V_local = logits.shape
        if mask is not None:
            ids_k = torch.where(mask.view(B, T, 1) != 0, ids_k, start)
        first = ids_k[..., 0].contiguous()
        owned, local_first = owned_ids(first, start, V_local)
        tokens = at_ids_tokens(ids_k)
        r = logprobs_fwd(logits, local_first, temperature, mask, False, softcap, backend)
        lse, _, _, _ = _combine(r.lse.view(B, T), r.logp.view(B, T), None, owned, group)
        x = entry_logits(logits, first, tokens, mask, temperature, softcap, backend, col0=start)
        x = _global_entry_logits(x.view(B * T, -1), ids_k, start, V_local, group)
        (logq,) = zero_at_masked(mask, x - lse.reshape(-1, 1))
        ctx.save_for_backward(logits, first, local_first, owned, lse, x, mask)
        ctx.tokens, ctx.backend, ctx.temperature, ctx.softcap, ctx.start = tokens, backend, temperature, softcap, start
        return logq.view(ids_k.shape)

    @staticmethod
    def backward(ctx, grad_logq):
        logits, first, local_first, owned, lse, x, mask = ctx.saved_tensors
        if grad_logq is None or not ctx.needs_input_grad[0]:
            return (None,) * len(ctx.needs_input_grad)
        G = grad_logq.reshape(x.shape).float()
        if mask is not None:
            G = torch.where(mask.reshape(-1, 1) != 0, G, 0.0)
        g = G.sum(-1).view(lse.shape)
        grad = slice_gradient(logits, local_first, owned, lse, g, None, None, ctx.temperature, ctx.softcap, ctx.backend)
        kept_gradient(
            grad, first, ctx.tokens, at_ids_terms(x, lse, mask), g, None, None, None, ctx.temperature, ctx.softcap,
            ctx.backend, col0=ctx.start, lead=summed_over_repeats(ctx.tokens.ids.long(), G),
        )  # fmt: skip
        return (grad,) + (None,) * (len(ctx.needs_input_grad) - 1)


class VocabParallelLinearLogprobsAtIds(torch.autograd.Function):
    """``VocabParallelLogprobsAtIds`` from hidden states [N, H] and this rank's head shard [V / P, H]: each entry's
    logit the dot product on the rank that holds its id; d hidden all-reduced, the shard's d weight and d bias its
    slice."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        ids_k,
        mask,
        temperature,
        softcap,
        backend,
        group,
        start: int,
        reduce_hidden_grad,
        fp32_logits: bool = False,
    ):
        ctx.set_materialize_grads(False)
        V_local = weight.shape[0]
        if mask is not None:
            ids_k = torch.where(mask.reshape(-1, 1) != 0, ids_k, start)
        first = ids_k[:, 0].contiguous()
        owned, local_first = owned_ids(first, start, V_local)
        tokens = at_ids_tokens(ids_k)
        r = linear_logprobs_fwd(
            hidden, weight, bias, local_first, temperature, False, softcap, backend, fp32_logits=fp32_logits
        )
        lse, _, _, _ = _combine(r.lse, r.logp, None, owned, group)
        x = linear_kept_terms(
            hidden, weight, bias, first, tokens, mask, temperature, softcap, backend, col0=start,
            fp32_logits=fp32_logits,
        ).x  # fmt: skip
        x = _global_entry_logits(x.view(first.numel(), -1), ids_k, start, V_local, group)
        (logq,) = zero_at_masked(mask, x - lse.reshape(-1, 1))
        ctx.save_for_backward(hidden, weight, bias, first, local_first, owned, lse, x, mask, ids_k)
        ctx.tokens, ctx.backend, ctx.temperature, ctx.softcap = tokens, backend, temperature, softcap
        ctx.group, ctx.start, ctx.reduce_hidden_grad = group, start, reduce_hidden_grad
        ctx.fp32_logits = fp32_logits
        return logq

    @staticmethod
    def backward(ctx, grad_logq):
        hidden, weight, bias, first, local_first, owned, lse, x, mask, ids_k = ctx.saved_tensors
        if grad_logq is None:
            return (None,) * len(ctx.needs_input_grad)
        G = grad_logq.reshape(x.shape).float()
        if mask is not None:
            G = torch.where(mask.reshape(-1, 1) != 0, G, 0.0)
        g = G.sum(-1)
        wants_weight = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
        entries = kept_entries(
            first, ctx.tokens, at_ids_terms(x, lse, mask), g, None, lse, None, ctx.temperature, ctx.softcap,
            ctx.backend, col0=ctx.start, lead=summed_over_repeats(ctx.tokens.ids.long(), G),
        )  # fmt: skip
        dh, dw, db = linear_logprobs_bwd(
            hidden, weight, bias, local_first, lse, g, ctx.temperature, ctx.softcap, ctx.backend, wants_weight,
            write_entries=entries, fp32_logits=ctx.fp32_logits,
        )  # fmt: skip
        # column 0 holds an entry's final value where one of the token's ids is this slice's first: no one-hot left
        kept_column_0 = owned | (ids_k == ctx.start).any(-1)
        without_column_0_one_hot(
            dh, dw, db, hidden, weight, bias, kept_column_0, g, ctx.temperature, ctx.softcap, ctx.fp32_logits
        )
        summed_over_shards(dh, ctx)
        return as_input_grads(ctx, (dh, dw, db), (hidden, weight, bias)) + (None,) * (len(ctx.needs_input_grad) - 3)


def sharded_vocab_start(
    shape, device, ids, group, vocab_start_index, check_ids, *, mask=None, normalizer=None
) -> tuple:
    """(this rank's first vocabulary id, the global vocabulary size) of its logits' ``shape`` (B, T, V / P) on
    ``device`` (``vocab_range``), after checking the ids, which are global, against the whole vocabulary (with
    ``check_ids``: one host sync, as unsharded)."""
    start, vocab_size = vocab_range(shape[-1], device, group, vocab_start_index)
    check_token_ids(ids, (shape[0], shape[1], vocab_size), device, check_ids, mask=mask, normalizer=normalizer)
    return start, vocab_size


class ShardedLogitsSource(LogitsSource):
    """This rank's vocabulary slice of the logits [B, T, V / P]: the global log-probs and entropy."""

    __slots__ = ()

    def logprobs(self, inputs, compute_entropy: bool, final: bool = False):
        """(global log-probs, entropy or None) [B, T], differentiable, 0 at masked tokens (``inputs.vocab_shard``:
        this rank's group and first id)."""
        options, shard = inputs.options, inputs.vocab_shard
        return VocabParallelLogprobs.apply(
            self.predicting(),
            inputs.ids.contiguous(),
            inputs.mask,
            float(options.kernel_temperature),
            options.kernel_softcap,
            compute_entropy,
            inputs.backend,
            shard.group,
            shard.start,
            inputs.kept,
        )

    def logprobs_at_ids(self, inputs, ids_k: torch.Tensor) -> torch.Tensor:
        """The global log-probs at K ids a token (global ids_k [B, T, K]), differentiable
        (``VocabParallelLogprobsAtIds``)."""
        options, shard = inputs.options, inputs.vocab_shard
        return VocabParallelLogprobsAtIds.apply(
            self.predicting(),
            ids_k,
            inputs.mask,
            float(options.kernel_temperature),
            options.kernel_softcap,
            inputs.backend,
            shard.group,
            shard.start,
        )

    def sum_squares(self, inputs, compute_entropy: bool) -> tuple:
        """(global log-probs, entropy or None, Σπ²) [B, T] of a no-grad pass over this rank's slice."""
        options, shard = inputs.options, inputs.vocab_shard
        logits, ids = self.predicting(), inputs.ids
        B, T, V_local = logits.shape
        owned, local_ids = owned_ids(ids, shard.start, V_local)
        r = logprobs_fwd(
            logits,
            local_ids,
            float(options.kernel_temperature),
            inputs.mask,
            compute_entropy,
            options.kernel_softcap,
            inputs.backend,
            compute_sum_squares=True,
        )
        parts = (r.lse, r.logp, r.entropy, r.sum_squares)
        lse, logp, entropy, squares = _combine(
            *(None if t is None else t.view(B, T) for t in parts[:3]),
            owned.view(B, T),
            shard.group,
            parts[3].view(B, T),
        )
        terms = kept_terms(
            logits,
            ids,
            inputs.kept,
            inputs.mask,
            float(options.kernel_temperature),
            options.kernel_softcap,
            inputs.backend,
            col0=shard.start,
            group=shard.group,
            compute_sum_squares=True,
        )
        return zero_at_masked(inputs.mask, *over_sets(terms, logp, entropy, squares))


class ShardedHiddenStatesSource(HiddenStatesSource):
    """Hidden states with this rank's lm_head weight shard [V / P, H]: the global log-probs and entropy."""

    def logprobs(self, inputs, compute_entropy: bool, final: bool = False):
        options, shard = inputs.options, inputs.vocab_shard
        pair = VocabParallelLinearLogprobs.apply(
            *self.flat(inputs),
            float(options.kernel_temperature),
            options.kernel_softcap,
            compute_entropy,
            inputs.backend,
            shard.group,
            shard.start,
            flat_mask(inputs.mask),
            inputs.kept,
            shard.reduce_hidden_grad,
            self.fp32_logits,
        )
        return self.as_rows(inputs, pair)

    def logprobs_at_ids(self, inputs, ids_k: torch.Tensor) -> torch.Tensor:
        """The global log-probs at K ids a token from this rank's head shard (``VocabParallelLinearLogprobsAtIds``)."""
        options, shard = inputs.options, inputs.vocab_shard
        hidden, weight, bias, _ = self.flat(inputs)
        logq = VocabParallelLinearLogprobsAtIds.apply(
            hidden,
            weight,
            bias,
            ids_k.reshape(-1, ids_k.shape[-1]),
            flat_mask(inputs.mask),
            float(options.kernel_temperature),
            options.kernel_softcap,
            inputs.backend,
            shard.group,
            shard.start,
            shard.reduce_hidden_grad,
            self.fp32_logits,
        )
        return logq.view(ids_k.shape)

    def sum_squares(self, inputs, compute_entropy: bool) -> tuple:
        """(global log-probs, entropy or None, Σπ²) [B, T] of a no-grad pass over this rank's weight shard."""
        options, shard = inputs.options, inputs.vocab_shard
        hidden, weight, bias, ids = self.flat(inputs)
        owned, local_ids = owned_ids(ids, shard.start, weight.shape[0])
        r = linear_logprobs_fwd(
            hidden,
            weight,
            bias,
            local_ids,
            float(options.kernel_temperature),
            compute_entropy,
            options.kernel_softcap,
            inputs.backend,
            compute_sum_squares=True,
            fp32_logits=self.fp32_logits,
        )
        lse, logp, entropy, squares = _combine(r.lse, r.logp, r.entropy, owned, shard.group, r.sum_squares)
        terms = linear_kept_terms(
            hidden,
            weight,
            bias,
            ids,
            inputs.kept,
            flat_mask(inputs.mask),
            float(options.kernel_temperature),
            options.kernel_softcap,
            inputs.backend,
            col0=shard.start,
            group=shard.group,
            compute_sum_squares=True,
            fp32_logits=self.fp32_logits,
        )
        return self.as_rows(inputs, over_sets(terms, logp, entropy, squares))


def sharded_source(source):
    """The vocabulary-parallel form of an input form's source (its settings kept)."""
    if isinstance(source, LogitsSource):
        return ShardedLogitsSource(
            source.tensor,
            drop_last_position=source.drop_last_position,
            in_place_backward=source.in_place_backward,
            one_pass=source.one_pass,
        )
    return ShardedHiddenStatesSource(
        source.tensor, source.weight, source.bias, source.lm_head_mode, source.operands_precision
    )
