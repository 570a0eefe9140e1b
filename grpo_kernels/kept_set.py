"""The sampler's kept set: each generated token's log-prob over the vocabulary ids its sampler kept (top-k / top-p /
min-p truncation), so that the trainer's probability of a sampled token is the sampler's.

A rollout engine that truncates draws from softmax(z / T) renormalized over a set of ids; the trainer then computes
log softmax(z / T) over the whole vocabulary unless it is given the set. With ``kept_set=KeptSet(...)`` every
log-prob entry point and loss takes it: the current policy's log-prob of a token is z_y / T - logsumexp over the set
of z / T (the temperature before the set, as samplers apply it), its gradient g (onehot - softmax over the set) / T,
zero outside the set. Old and reference log-probs are the caller's (compute them with the same ``kept_set`` on the
no-grad ``token_logprobs`` / ``linear_token_logprobs``, as slime does for its old, reference and teacher passes).

``KeptSet`` holds the sets in either form a trainer has them: vLLM's CSR (``ids`` int32 [nnz], ascending within a
token; ``offsets`` int64 [N + 1]) or prime-rl's padded [..., K] (``offsets`` None, a negative id for no entry), and
two conventions by name:

- ``outside``: a target outside its set, or an empty set: ``"vocabulary"`` (prime-rl's: that token takes the whole
  vocabulary) or ``"add_target"`` (slime's: the set plus the target, kept ∪ {y}).
- ``entropy``: the entropy (the metric, the entropy bonus, ``return_entropy``) over ``"vocabulary"`` (the default,
  both trainers') or over the ``"set"``.

The kernels take the set beside the logits (``kernels/kept.py``): a token's set is O(K) gathers, never a mask over
the [N, V] logits; the fused lm_head computes each kept logit as its own dot product. ``finish`` turns their per-token
state into what a pass reads (``kernels.contracts.KeptTerms``), across a vocabulary split too.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .kernels.contracts import KeptTerms, KeptTokens

OUTSIDE = ("vocabulary", "add_target")
ENTROPY = ("vocabulary", "set")


@dataclasses.dataclass(frozen=True)
class KeptSet:
    """The sampler's kept set of each token (the module docstring). ``ids``: CSR int [nnz] with ``offsets`` [N + 1]
    over the call's tokens (row-major over [B, T], a packed batch's order), or padded [..., K] shaped as the
    completion ids plus K, a negative id for no entry; ids are global (a vocabulary shard reads those in its slice).
    ``outside``: "vocabulary" (prime-rl's) or "add_target" (slime's); ``entropy``: "vocabulary" or "set"."""

    ids: torch.Tensor
    offsets: torch.Tensor | None = None
    outside: str = "vocabulary"
    entropy: str = "vocabulary"

    @classmethod
    def from_vllm(cls, ids, offsets, **conventions) -> KeptSet:
        """vLLM's CSR: the kept ids of every token (int32, ascending within a token) and the offsets (int64, one more
        than the tokens)."""
        return cls(ids, offsets, **conventions)

    @classmethod
    def from_padded(cls, ids, **conventions) -> KeptSet:
        """prime-rl's form: [..., K] ids, -1 (any negative id) where a token keeps fewer than K."""
        return cls(ids, None, **conventions)

    def at_tokens(self, positions: torch.Tensor) -> KeptSet:
        """The sets of the call's tokens at ``positions`` [n] (their indices in the call's token order), as the sets
        of a packed call over those n tokens (a compacted call's, ``inputs.compacted``): padded [n, K], or CSR with
        its offsets rebuilt (one host sync: the entries' count). The conventions are kept."""
        if self.offsets is None:
            return dataclasses.replace(self, ids=self.ids.reshape(-1, self.ids.shape[-1])[positions])
        offsets = self.offsets.to(positions.device).long()
        starts, counts = offsets[:-1][positions], (offsets[1:] - offsets[:-1])[positions]
        new_offsets = torch.zeros(positions.numel() + 1, dtype=torch.int64, device=positions.device)
        new_offsets[1:] = torch.cumsum(counts, 0)
        total = int(new_offsets[-1])  # the host sync
        shift = torch.repeat_interleave(starts - new_offsets[:-1], counts, output_size=total)
        entries = torch.arange(total, device=positions.device) + shift
        return dataclasses.replace(self, ids=self.ids[entries], offsets=new_offsets)


def finish(state: torch.Tensor, kept: KeptTokens, x: torch.Tensor, mask: torch.Tensor | None, group=None,
           compute_sum_squares: bool = False) -> KeptTerms:  # fmt: skip
    """``KeptTerms`` of the kernels' [7, N] per-token state (``kernels/kept_launch.py``; ``torch_state`` the same on
    the torch path) and each entry's ``x``: across a vocabulary split's ``group`` the slices' states are merged first
    (one all-reduce of their maxima, one of their sums). A token whose target is outside its set, or whose set is
    empty, takes the whole vocabulary (``lse`` +inf) unless the target joins its set (``add_target``); a masked token
    (``mask`` 0) always does."""
    m, s, t, q, count, found, target_x = state.unbind()
    if group is not None:
        big = m.clone()
        dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
        offset = torch.where(big == float("-inf"), 0.0, big)
        scale = torch.exp(m - offset)
        sums = torch.stack([s * scale, t * scale, q * scale * scale, count, found, target_x])
        dist.all_reduce(sums, group=group)
        m, (s, t, q, count, found, target_x) = big, sums.unbind()
    found = found > 0
    active = torch.ones_like(found) if mask is None else mask.reshape(-1) != 0
    if kept.add_target:  # the target joins the set where the set lacks it
        joins = ~found
        new_max = torch.where(joins, torch.maximum(m, target_x), m)
        offset = torch.where(new_max == float("-inf"), 0.0, new_max)
        scale, e = torch.exp(m - offset), torch.where(joins, torch.exp(target_x - offset), 0.0)
        s, t, q = s * scale + e, t * scale + torch.where(joins, e * target_x, 0.0), q * scale * scale + e * e
        m = new_max
        used = active
    else:
        used = active & found
    lse = m + torch.log(s)
    entropy = lse - t / s if kept.entropy_over_set else None
    squares = q / (s * s) if compute_sum_squares else None
    return KeptTerms(
        torch.where(used, lse, float("inf")),
        None if entropy is None else torch.where(used, entropy, 0.0),
        None if squares is None else torch.where(used, squares, 0.0),
        found.to(torch.int32),
        target_x,
        x,
    )


def used(terms: KeptTerms | None) -> torch.Tensor | None:
    """Where each token's set is used (bool [N]), None without a set."""
    return None if terms is None else terms.lse < float("inf")


def dense_share(terms: KeptTerms | None, kept: KeptTokens | None, g: torch.Tensor, h: torch.Tensor | None) -> tuple:
    """(g, h) of the dense gradient pass: a set's token leaves its policy term (and, with the set's entropy, its
    entropy term) to the set's entries (``kernels/kept.py::kept_gradient_kernel``, ``torch_gradient``)."""
    if terms is None:
        return g, h
    in_set = used(terms).view(g.shape)
    g = torch.where(in_set, 0.0, g)
    if h is not None and kept.entropy_over_set:
        h = torch.where(in_set, 0.0, h)
    return g, h


# ---- The torch path (and the checks' own arithmetic) ---------------------------------------------------------------


def entries(kept: KeptTokens, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each entry's token [E], its id [E], int64) of the sets: CSR's or the padded form's rows (E = N K there)."""
    if kept.offsets is None:
        ids = kept.ids.reshape(N, -1)
        token = torch.arange(N, device=ids.device).unsqueeze(1).expand_as(ids)
        return token.reshape(-1), ids.reshape(-1).long()
    lengths = (kept.offsets[1:] - kept.offsets[:-1]).long()
    token = torch.repeat_interleave(torch.arange(N, device=kept.ids.device), lengths, output_size=kept.ids.numel())
    return token, kept.ids.long()


def torch_state(
    x_of: callable,
    ids: torch.Tensor,
    kept: KeptTokens,
    mask: torch.Tensor | None,
    col0: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels/kept_launch.py::kept_state`` in torch: (each entry's x [E], the [7, N] state). ``x_of(token, local)``
    gives the x of (token, local column) pairs ([E] each): a gather from the logits, or the head's dot products."""
    N = ids.numel()
    token, v = entries(kept, N)
    active = torch.ones(N, dtype=torch.bool, device=ids.device) if mask is None else mask.reshape(-1) != 0
    here = active[token] & (v >= col0) & (v < col0 + width)
    local = torch.where(here, v - col0, 0)
    x = torch.where(here, x_of(token, local), float("-inf"))
    flat_ids = ids.reshape(-1).long()
    m = torch.full((N,), float("-inf"), device=ids.device, dtype=x.dtype).scatter_reduce(
        0, token, x, "amax", include_self=True
    )
    offset = torch.where(m == float("-inf"), 0.0, m)
    e = torch.exp(x - offset[token])
    zeros = torch.zeros(N, device=ids.device, dtype=x.dtype)
    s = zeros.index_add(0, token, e)
    t = zeros.index_add(0, token, torch.where(e > 0, e * x, 0.0))
    q = zeros.index_add(0, token, e * e)
    count = zeros.index_add(0, token, here.to(x.dtype))
    found = zeros.index_add(0, token, (here & (v == flat_ids[token])).to(x.dtype)).clamp(max=1.0)
    owned = active & (flat_ids >= col0) & (flat_ids < col0 + width)
    target_x = torch.where(owned, x_of(torch.arange(N, device=ids.device), torch.where(owned, flat_ids - col0, 0)), 0.0)
    return x.reshape(kept.ids.shape), torch.stack([m, s, t, q, count, found, target_x])


def torch_gradient(
    out: torch.Tensor,
    ids: torch.Tensor,
    kept: KeptTokens,
    terms: KeptTerms,
    g: torch.Tensor,
    inv_temperature: float,
    softcap: float | None,
    h: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    col0: int = 0,
    n0: int = 0,
    lead: torch.Tensor | None = None,
) -> None:
    """``kernels/kept_launch.py::kept_gradient`` in torch: ``out`` the gradient [B, T, width] (any strides) or a
    [rows, width] workspace of the tokens from ``n0``; ``g``, ``h``, ``lse``, ``entropy`` one per row of ``out``,
    ``lead`` one an entry."""
    rows_of = out.shape[0] * out.shape[1] if out.dim() == 3 else out.shape[0]
    pad = lambda t: None if t is None else torch.nn.functional.pad(t.reshape(-1), (n0, ids.numel() - n0 - rows_of))  # noqa: E731
    entries_ = torch_entry_gradients(
        ids, kept, terms, pad(g), inv_temperature, softcap, pad(h), pad(lse), pad(entropy), lead
    )
    write_entries(out, entries_, col0, n0)


def torch_entry_gradients(ids, kept: KeptTokens, terms: KeptTerms, g, inv_temperature: float, softcap,
                          h=None, lse=None, entropy=None, lead=None) -> tuple:  # fmt: skip
    """(token, global column, value) of every entry the sets' tokens write (``kept._entry_gradient``; the added
    targets too), ``g``, ``h``, ``lse``, ``entropy`` over every token [N], ``lead`` (one an entry) the top-k
    distillation's: computed once, written into any tile of the gradient by ``write_entries``."""
    N = ids.numel()
    token, v = entries(kept, N)
    flat_ids = ids.reshape(-1).long()
    x = terms.x.reshape(-1)
    in_set = used(terms)
    written = in_set[token] & (x > float("-inf"))
    columns, rows = v, token
    lead = g.reshape(-1)[token] * (v == flat_ids[token]).to(x.dtype) if lead is None else lead.reshape(-1).to(x.dtype)
    if kept.add_target:
        joins = in_set & (terms.found == 0)
        columns, rows = torch.cat([columns, flat_ids]), torch.cat([rows, torch.arange(N, device=ids.device)])
        x, written = torch.cat([x, terms.target_x]), torch.cat([written, joins])
        lead = torch.cat([lead, g.reshape(-1).to(x.dtype)])
    keep = written.nonzero().squeeze(1)  # (a host sync: the torch path)
    columns, rows, x, lead = columns[keep], rows[keep], x[keep], lead[keep]
    kept_lse = terms.lse[rows]
    q = torch.exp(x - kept_lse)
    value = lead - g.reshape(-1)[rows] * q
    if h is not None:
        h = h.reshape(-1)[rows]
        if kept.entropy_over_set:
            value = value - h * q * (x - kept_lse + terms.entropy[rows])
        else:
            p = torch.exp(x - lse.reshape(-1)[rows])
            value = value - h * p * (x - lse.reshape(-1)[rows] + entropy.reshape(-1)[rows])
    value = value * inv_temperature
    if softcap is not None:
        capped = x / inv_temperature
        value = value * (1.0 - (capped / softcap) ** 2)
    return rows, columns, value


def write_entries(out: torch.Tensor, entries_: tuple, col0: int = 0, n0: int = 0) -> None:
    """Write ``torch_entry_gradients``'s entries that fall in ``out`` (the gradient [B, T, width], or a [rows, width]
    tile of the tokens from ``n0``; its columns global ids from ``col0``) over its dense values."""
    rows, columns, value = entries_
    rows_of = out.shape[0] * out.shape[1] if out.dim() == 3 else out.shape[0]
    here = (rows >= n0) & (rows < n0 + rows_of) & (columns >= col0) & (columns < col0 + out.shape[-1])
    local, columns, value = rows[here] - n0, columns[here] - col0, value[here].to(out.dtype)
    if out.dim() == 3:
        T = out.shape[1]
        out[local // T, local % T, columns] = value
    else:
        out[local, columns] = value
