"""The eager baseline the benchmarks (and the tests) compare against: the GRPO loss from logits [B, T, V] the way
an eager trainer computes it, the fp32 log-softmax materialized ([B, T, V]), then the package's O(B * T) loss math
(``grpo_kernels.objective``). Not part of the package: nothing in it is a fast path, and the specification
(``grpo_kernels.reference``) is the oracle.

    from eager_baseline import grpo_loss_eager   # benchmarks/ on sys.path (a script there has it)
"""

from __future__ import annotations

import torch

from grpo_kernels import torch_path
from grpo_kernels.objective import (
    GRPOLossOutput,
    as_row_column,
    entropy_bonus,
    loss_metrics,
    per_token_terms,
    policy_masks,
    reduce_loss,
)
from grpo_kernels.options import GRPOOptions


def materialized_logprobs_and_entropy(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, softcap: float | None = None
):
    """log softmax(cap(logits) / temperature)[ids] and the entropy of that distribution, in fp32 (cap: the head's
    soft-cap, ``torch_path.capped``; temperature and softcap as the kernels take them, ``GRPOOptions.kernel_*``)."""
    logps_all = torch.log_softmax(torch_path.capped(logits.float(), softcap)[0] / temperature, dim=-1)  # [B, T, V]
    lp = logps_all.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)
    p = logps_all.exp()
    entropy = -(p * torch.where(p > 0, logps_all, 0.0)).sum(-1)  # a -inf logit adds 0, not 0 * -inf
    return lp, entropy


def grpo_loss_eager(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    normalizer=None,
    options: GRPOOptions | None = None,
    sampling_logps: torch.Tensor | None = None,
    prompt_ids: torch.Tensor | None = None,
    **option_kwargs,
) -> GRPOLossOutput:
    """The whole GRPO loss from logits [B, T, V] the way an eager trainer computes it: the fp32
    log-softmax materialized ([B, T, V]), then this module's math. The benchmarks' "eager" baseline.

    ``sampling_logps`` [B, T]: the sampler's log-probs, for the off-policy mask (default: the old
    log-probs, else this pass's own, which keeps every row). ``prompt_ids`` [B]: the prompt mean's."""
    opts = options if options is not None else GRPOOptions(**option_kwargs)
    mask = completion_mask.float()
    lp, entropy = materialized_logprobs_and_entropy(
        logits, completion_ids, opts.kernel_temperature, opts.kernel_softcap
    )
    importance_weights = as_row_column(None if importance_weights is None else importance_weights.float())
    bonus_mask = policy_mask = None
    if opts.masks_tokens:
        policy_mask, entropy_mask = policy_masks(
            lp, entropy, mask, advantages.float(), old_logps if sampling_logps is None else sampling_logps, opts
        )
        bonus_mask = None if entropy_mask is None else mask * entropy_mask
    terms = per_token_terms(
        lp,
        mask,
        as_row_column(advantages.float()),
        None if old_logps is None else old_logps.float(),
        None if ref_logps is None else ref_logps.float(),
        importance_weights,
        opts,
        policy_mask,
    )
    policy_loss = reduce_loss(terms.per_token_loss, mask, opts, normalizer, prompt_ids)
    loss = policy_loss - entropy_bonus(entropy, mask if bonus_mask is None else bonus_mask, opts, mask, normalizer)
    metrics = loss_metrics(terms, entropy if opts.compute_entropy else None, mask, opts)
    if opts.has_entropy_bonus:  # TRL logs the loss before its bonus
        metrics["policy_loss"] = policy_loss.detach()
    return GRPOLossOutput(loss, metrics, lp.detach())
