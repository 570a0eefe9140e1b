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

This module holds the sharded steps as functions of plain tensors; each input form's one log-prob Function
(``from_logits.LogitsLogprobs``, ``from_hidden_states.HiddenStatesLogprobs``) takes the call's shard
(``inputs.VocabShard``) as a value and calls them where it is given one. The imports run one way: the forms and
``inputs`` import this module, which imports neither.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .kernels.contracts import rounds_head_logits
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


def sharded_vocab_start(
    shape, device, ids, group, vocab_start_index, check_ids, *, mask=None, normalizer=None
) -> tuple:
    """(this rank's first vocabulary id, the global vocabulary size) of its logits' ``shape`` (B, T, V / P) on
    ``device`` (``vocab_range``), after checking the ids, which are global, against the whole vocabulary (with
    ``check_ids``: one host sync, as unsharded)."""
    start, vocab_size = vocab_range(shape[-1], device, group, vocab_start_index)
    check_token_ids(ids, (shape[0], shape[1], vocab_size), device, check_ids, mask=mask, normalizer=normalizer)
    return start, vocab_size


def combined(lse_r, logp_r, entropy_r, owned, group, squares_r=None) -> tuple:
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


def combined_result(r, owned, group):
    """A pass's results over this rank's slice (a ``LogprobResult``) as the global ones, flat [N] (``combined``)."""
    flat = lambda t: None if t is None else t.reshape(-1)  # noqa: E731
    lse, logp, entropy, squares = combined(
        flat(r.lse), flat(r.logp), flat(r.entropy), flat(owned), group, flat(r.sum_squares)
    )
    return r._replace(logp=logp, entropy=entropy, lse=lse, sum_squares=squares)


def global_entry_logits(x, ids_k, start: int, width: int, group) -> torch.Tensor:
    """Each entry's x [N, K] from the rank whose slice holds its id (one all-reduce of N K values)."""
    here = owned_ids(ids_k.reshape(x.shape), start, width)[0]
    x = torch.where(here, x, 0.0)
    dist.all_reduce(x, group=group)
    return x


def unowned_column_0_in_logits_grad(grad, logits, owned, lse, g, h, entropy, temperature: float, softcap) -> None:
    """This rank's slice of dlogits, written by the single-device backward with the local ids of ``owned_ids``:
    where this rank does not own the target, the kernel's one-hot landed on local column 0, which is rewritten
    here without it, from its own logit (O(B * T), in place, no host sync). The per-token values any shape."""
    inv_t = 1.0 / temperature
    x0, slope0 = capped(logits[..., 0].float(), softcap)
    owned, lse, g = owned.view(x0.shape), lse.view(x0.shape), g.view(x0.shape)
    h, entropy = (None, None) if h is None else (h.view(x0.shape), entropy.view(x0.shape))
    log_p0 = x0 * inv_t - lse
    p0 = torch.exp(log_p0)
    column = -g * inv_t * p0
    if h is not None:
        column = column - h * inv_t * p0 * (torch.where(p0 > 0, log_p0, 0.0) + entropy)
    if slope0 is not None:
        column = column * slope0
    live = (g != 0) if h is None else (g != 0) | (h != 0)  # a masked row stays all zero
    grad[..., 0] = torch.where(~owned & live, column, grad[..., 0].float()).to(grad.dtype)


def unowned_column_0_in_head_grads(
    dh, dw, db, hidden, weight, bias, kept_column_0, g, temperature: float, softcap, fp32_logits: bool = False
) -> None:
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


def summed_over_shards(dh, shard) -> None:
    """d hidden summed over every rank's share of the vocabulary, in place, where this op owns that sum
    (``shard.reduce_hidden_grad``: hidden states replicated over the group and nothing else reducing them); else
    left as this rank's share, for the caller's mapping to sum (Megatron's ``gather_from_sequence_parallel_region``,
    whose backward reduce-scatters, or ``copy_to_tensor_model_parallel_region``, whose backward all-reduces). The
    weight and bias shards get their slices of the unsharded d weight and d bias either way."""
    if shard.reduce_hidden_grad:
        dist.all_reduce(dh, group=shard.group)
