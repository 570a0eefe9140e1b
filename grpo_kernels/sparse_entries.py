"""A log-prob pass's values and gradients at a per-row set of entries, on either backend: a sampler's kept set
(``kept_set.KeptSet``: each token's log-prob and entropy over its set) and a teacher's top-k ids (the log-probs at K
ids a token, ``distillation.py``). The terms before a pass (``kept_terms``: the Triton kernel ``kernels/kept.py`` or
the torch path's gathers, then ``kept_set.finish``), the pass's results over the sets (``with_kept_set``), the
entries' gradient written over a dense one (``kept_gradient``). The input forms' Functions (``from_logits.py``,
``from_hidden_states.py``, ``vocab_parallel.py``) call these; a call without a set never enters this module.
"""

from __future__ import annotations

import torch

from . import kept_set, torch_path
from .kernels import kept_launch
from .kernels.contracts import KeptTerms, KeptTokens, LossTokens


def kept_terms(logits, ids, kept: KeptTokens | None, mask, temperature: float, softcap, backend: str, *, col0: int = 0,
               group=None, compute_sum_squares: bool = False) -> KeptTerms | None:  # fmt: skip
    """Each token's kept-set terms (``kernels.contracts.KeptTerms``) from logits [B, T, width] (the ones that predict
    the completion: a vocabulary slice from global id ``col0`` with ``group``), None without a set: the Triton
    kernel (``kernels/kept.py``) or the torch path's gathers, then ``kept_set.finish``."""
    if kept is None:
        return None
    B, T, width = logits.shape
    if backend == "triton" and not torch.compiler.is_compiling():  # (a graph: the torch path's gathers)
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
                  backend: str, col0: int = 0, n0: int = 0, lead=None) -> None:  # fmt: skip
    """The kept sets' entries of the gradient ``out`` ([B, T, width], the logits' that predict the completion, or a
    [rows, width] tile of the tokens from ``n0``; the dense part written by a pass that left the sets' share out,
    ``kept_set.dense_share``); ``g``, ``h``, ``lse``, ``entropy`` one per row of ``out``; ``lead`` one an entry (the
    top-k entries', ``LogprobsAtIds``)."""
    flat = lambda t: None if t is None else t.reshape(-1).to(torch_path.compute_dtype(t)).contiguous()  # noqa: E731
    g, h, lse, entropy = flat(g), flat(h), flat(lse), flat(entropy)
    if backend == "triton" and not torch.compiler.is_compiling():  # (a graph: the torch path's scatter)
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


def entry_logits(logits, first, tokens: KeptTokens, mask, temperature: float, softcap, backend: str, col0: int = 0):
    """x = cap(z) / tau at each entry [N, K] of logits [B, T, width] (a vocabulary slice from ``col0``: -inf at the
    entries another slice holds), from the kept-set state kernel or the torch path's gathers."""
    return kept_terms(logits, first, tokens, mask, temperature, softcap, backend, col0=col0, group=None).x


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
