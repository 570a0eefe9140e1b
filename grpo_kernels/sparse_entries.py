"""A log-prob pass's values and gradients at a per-row set of entries, on either backend: a sampler's kept set
(``kept_set.KeptSet``: each token's log-prob and entropy over its set) and a teacher's top-k ids (the log-probs at K
ids a token, ``distillation.py``). The terms before a pass (``kept_terms``: the Triton kernel ``kernels/kept.py`` or
the torch path's gathers, then ``kept_set.finish``), the pass's results over the sets (``with_kept_set``), the
entries' gradient written over a dense one (``kept_gradient``).

The entries are a value each input form's one log-prob Function takes (``from_logits.LogitsLogprobs``,
``from_hidden_states.HiddenStatesLogprobs``): ``KeptSetEntries`` or ``TopKEntries``, each saying what its pass reads
(``target``, ``kept_tokens``), what it returns (``values``) and how its gradient splits into the dense pass's share
and the entries' (``gradient``). A call without entries never enters this module.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import kept_set, torch_path
from .kernels import kept_launch
from .kernels.contracts import KeptTerms, KeptTokens, LossTokens
from .vocab_parallel import global_entry_logits


def kept_terms(logits, ids, kept: KeptTokens | None, mask, temperature: float, softcap, backend, *, col0: int = 0,
               group=None, compute_sum_squares: bool = False) -> KeptTerms | None:  # fmt: skip
    """Each token's kept-set terms (``kernels.contracts.KeptTerms``) from logits [B, T, width] (the ones that predict
    the completion: a vocabulary slice from global id ``col0`` with ``group``), None without a set: the Triton
    kernel (``kernels/kept.py``) or the torch path's gathers, then ``kept_set.finish``."""
    if kept is None:
        return None
    B, T, width = logits.shape
    if backend.eager_kernels:  # (a graph: the torch path's gathers)
        x, state = kept_launch.kept_state(
            logits,
            ids,
            kept,
            temperature=temperature,
            softcap=softcap,
            mask=mask,
            col0=col0,
            compute_entropy=kept.entropy_over_set,
            compute_sum_squares=compute_sum_squares,
        )
    else:
        dtype = torch_path.compute_dtype(logits)

        def x_of(token, local):
            raw = logits[token // T, token % T, local].to(dtype)
            return torch_path.capped(raw, softcap)[0] * (1.0 / temperature)  # (as the kernels scale)

        x, state = kept_set.torch_state(x_of, ids, kept, mask, col0, width)
    return kept_set.finish(state, kept, x, mask, group, compute_sum_squares)


def with_kept_set(r, kept: KeptTerms):
    """A pass's results (the torch path's, computed over the whole vocabulary) with each set's token's log-prob (and
    its entropy, where it is the set's) taken over its set."""
    in_set = kept_set.used(kept)
    logp = torch.where(in_set, kept.target_x - kept.lse, r.logp)
    entropy = r.entropy
    if entropy is not None and kept.entropy is not None:
        entropy = torch.where(in_set, kept.entropy, entropy)
    squares = (
        r.sum_squares
        if r.sum_squares is None or kept.sum_squares is None
        else torch.where(in_set, kept.sum_squares, r.sum_squares)
    )
    return r._replace(logp=logp, entropy=entropy, sum_squares=squares)


def kept_gradient(out, ids, kept: KeptTokens, terms: KeptTerms, g, h, lse, entropy, temperature: float, softcap,
                  backend, col0: int = 0, n0: int = 0, lead=None) -> None:  # fmt: skip
    """The kept sets' entries of the gradient ``out`` ([B, T, width], the logits' that predict the completion, or a
    [rows, width] tile of the tokens from ``n0``; the dense part written by a pass that left the sets' share out,
    ``kept_set.dense_share``); ``g``, ``h``, ``lse``, ``entropy`` one per row of ``out``; ``lead`` one an entry (the
    top-k entries', ``TopKEntries``)."""
    flat = lambda t: None if t is None else t.reshape(-1).to(torch_path.compute_dtype(t)).contiguous()  # noqa: E731
    g, h, lse, entropy = flat(g), flat(h), flat(lse), flat(entropy)
    if backend.eager_kernels:  # (a graph: the torch path's scatter)
        kept_launch.kept_gradient(
            out, ids, kept, terms, g, temperature=temperature, softcap=softcap, h=h, lse=lse, entropy=entropy,
            col0=col0, n0=n0, lead=None if lead is None else lead.reshape(-1).float().contiguous(),
        )  # fmt: skip
    else:
        kept_set.torch_gradient(out, ids, kept, terms, g, 1.0 / temperature, softcap, h, lse, entropy, col0, n0, lead)


def with_kept_lse(loss_tokens: LossTokens, terms: KeptTerms | None) -> LossTokens:
    """The loss tokens with the kept sets' log-sum-exp (and the set's entropy) for the loss kernels to read."""
    if terms is None:
        return loss_tokens
    return loss_tokens._replace(tokens=loss_tokens.tokens._replace(kept_lse=terms.lse, kept_entropy=terms.entropy))


def at_ids_tokens(ids_k: torch.Tensor) -> KeptTokens:
    """K ids a token [..., K] as the kept-set kernels read a padded set (``kernels/kept.py``): each id's logit
    gathered (or, from the head, its own dot product)."""
    K = ids_k.shape[-1]
    return KeptTokens(ids_k.reshape(-1, K).to(torch.int32).contiguous(), None, K, False, False)


def at_ids_terms(x, lse, mask) -> KeptTerms:
    """What the entries' gradient reads (``kernels/kept.py::kept_gradient_kernel`` with a lead): the whole
    vocabulary's log-sum-exp as the set's (+inf at a masked token: not written), each entry's x."""
    N = lse.numel()
    lse = lse.reshape(-1) if mask is None else torch.where(mask.reshape(-1) != 0, lse.reshape(-1), float("inf"))
    zeros = torch.zeros(N, device=lse.device, dtype=lse.dtype)
    return KeptTerms(lse.contiguous(), None, None, zeros.to(torch.int32), zeros, x.reshape(-1).contiguous())


def summed_over_repeats(ids_k: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Each entry's sum of ``G`` over its token's entries with the same id ([N, K] both): a repeated id's gradient
    entry is the sum of its entries' (sorted ids, segment sums, O(N K log K))."""
    ordered, order = ids_k.sort(dim=-1)
    first_of_run = torch.ones_like(ordered, dtype=torch.bool)
    first_of_run[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    run = first_of_run.long().cumsum(-1) - 1  # each sorted entry's run
    sums = torch.zeros_like(G).scatter_add_(-1, run, G.gather(-1, order))
    return torch.empty_like(G).scatter_(-1, order, sums.gather(-1, run))


# ---- The entries as a value: what a log-prob Function asks of them ----------------------------------------------


class EntryGradient(NamedTuple):
    """What writes a pass's entries over its dense gradient (``kept_gradient``; from the head,
    ``from_hidden_states.kept_entries``): the entries as the kernels read them, their terms, the per-token g and h
    (the whole gradient, before the dense pass's share was taken), the forward's ``lse`` and ``entropy`` where the
    entries' entropy terms read them, and ``lead``, one an entry, where each entry's gradient is its own
    (``kept._entry_gradient``: the top-k's), with ``per_entry``, the incoming gradient at each entry it sums (a
    graph's sparse update reads it: ``from_hidden_states.with_entry_gradients``)."""

    tokens: KeptTokens
    terms: KeptTerms
    g: torch.Tensor
    h: torch.Tensor | None
    lse: torch.Tensor | None
    entropy: torch.Tensor | None
    lead: torch.Tensor | None = None
    per_entry: torch.Tensor | None = None


class KeptSetEntries(NamedTuple):
    """The sampler's kept set of each token (``kept_set.KeptSet``, as the kernels read it): each token's log-prob
    (and, with ``entropy_over_set``, its entropy) over its set. The set's terms are merged over a vocabulary shard's
    group, and the pass reads them (its log-sum-exp over the set)."""

    kept_tokens: KeptTokens
    read_by_the_pass = True

    def on_shard(self, mask, shard) -> KeptSetEntries:
        return self

    def target(self, ids: torch.Tensor) -> torch.Tensor:
        """The dense pass's ids: the targets."""
        return ids

    def terms_group(self, shard):
        """The group a shard's terms are merged over (``kept_set.finish``)."""
        return None if shard is None else shard.group

    def merged(self, terms: KeptTerms, shard, width: int) -> KeptTerms:
        return terms

    def values(self, r, terms: KeptTerms):
        """The pass's log-probs, taken over the sets already."""
        return r.logp

    def kept_column_0(self, owned: torch.Tensor, shard) -> torch.Tensor:
        """Where a shard's local column 0 holds no spurious one-hot (the owner of the target)."""
        return owned

    def gradient(self, grad_values, grad_entropy, terms: KeptTerms, lse, entropy, mask) -> tuple:
        """(g, h of the dense pass, the entries' ``EntryGradient``): a set's token leaves its terms to its entries
        (``kept_set.dense_share``)."""
        as_lse = lambda t: None if t is None else t.reshape(lse.shape).to(lse.dtype)  # noqa: E731 (fp64's torch path)
        g = torch.zeros_like(lse) if grad_values is None else as_lse(grad_values)
        h = as_lse(grad_entropy)
        g_dense, h_dense = kept_set.dense_share(terms, self.kept_tokens, g, h)
        return g_dense, h_dense, EntryGradient(self.kept_tokens, terms, g, h, lse, entropy)


class TopKEntries(NamedTuple):
    """K ids a token (``ids_k`` [..., K]: a teacher's top-k): the log-probs at each, normalized over the whole
    vocabulary, [..., K]. The pass runs on each token's first id for the log-sum-exp; each id's logit is gathered
    beside it (from the head, its own dot product; from a vocabulary shard, from the rank that holds it). The
    dense backward runs with g = sum_k G_k, then each entry's gradient, (sum of G over the token's entries with its id
    - g q) / tau, is written over it: no [N, V] scatter."""

    ids_k: torch.Tensor
    kept_tokens: KeptTokens  # the ids as the kept-set kernels read a padded set (``at_ids_tokens``)
    read_by_the_pass = False

    @classmethod
    def of(cls, ids_k: torch.Tensor) -> TopKEntries:
        return cls(ids_k, at_ids_tokens(ids_k))

    def on_shard(self, mask, shard) -> TopKEntries:
        """On a shard, a masked token's ids point into this rank's slice (its first id), read by no one."""
        if shard is None or mask is None:
            return self
        return TopKEntries.of(torch.where(mask.reshape(*self.ids_k.shape[:-1], 1) != 0, self.ids_k, shard.start))

    def target(self, ids) -> torch.Tensor:
        """The dense pass's ids: each token's first id (a masked token's is 0: ``validation.checked_teacher_topk``)."""
        return self.ids_k[..., 0].contiguous()

    def terms_group(self, shard):
        return None  # (each entry's logit comes from the rank that holds it: ``merged``)

    def merged(self, terms: KeptTerms, shard, width: int) -> KeptTerms:
        """On a shard, each entry's x from the rank whose slice holds it."""
        if shard is None:
            return terms
        x = global_entry_logits(terms.x.view(-1, self.ids_k.shape[-1]), self.ids_k, shard.start, width, shard.group)
        return terms._replace(x=x)

    def values(self, r, terms: KeptTerms) -> torch.Tensor:
        """log q = x - lse at each entry, [..., K] (the Function zeroes masked tokens')."""
        return (terms.x.view(r.lse.numel(), -1) - r.lse.reshape(-1, 1)).view(self.ids_k.shape)

    def kept_column_0(self, owned: torch.Tensor, shard) -> torch.Tensor:
        """Column 0 holds an entry's final value where one of the token's ids is the slice's first."""
        return owned | (self.ids_k.reshape(owned.numel(), -1) == shard.start).any(-1)

    def gradient(self, grad_values, grad_entropy, terms: KeptTerms, lse, entropy, mask) -> tuple:
        """(g = sum_k G_k at the first id, no h, the entries' ``EntryGradient`` with their leads)."""
        G = grad_values.reshape(lse.numel(), -1).to(lse.dtype)
        if mask is not None:
            G = torch.where(mask.reshape(-1, 1) != 0, G, 0.0)
        g = G.sum(-1).view(lse.shape)
        lead = summed_over_repeats(self.kept_tokens.ids.long(), G)
        return g, None, EntryGradient(self.kept_tokens, at_ids_terms(terms.x, lse, mask), g, None, None, None, lead, G)
