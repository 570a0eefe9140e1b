"""The one dispatch both loss functions call: a prepared call (``inputs.prepare_inputs``) on either source.

1. TRL's policy-term masks, where the options ask for them: a first, gradient-free log-prob pass.
2. The fused loss kernels where they apply (a backend that has them, a token-level loss, one
   device's vocabulary), else the differentiable log-probs with the loss math in torch
   (``objective.loss_from_logps``).
"""

from __future__ import annotations

import torch

from .backends import get_backend
from .inputs import LogprobSettings, LossInputs, prepare_logprob_inputs
from .kernels.contracts import TokenInputs
from .objective import GRPOLossOutput, loss_from_logps, policy_masks
from .sources import PolicyTerms


def compute_loss(source, inputs: LossInputs) -> GRPOLossOutput:
    opts = inputs.options
    policy = PolicyTerms(inputs.importance_weights, None, inputs.mask_seq)
    if opts.masks_tokens:  # the masks need this call's log-probs / entropies first: one more read of the logits
        with torch.no_grad():
            first_pass = source.logprobs(inputs, opts.top_entropy_quantile < 1.0)
        policy = with_policy_masks(inputs, first_pass)
    # inside a torch.compile graph the Triton path runs its log-prob kernels as custom ops (ops.py) and the
    # O(B * T) loss math as graph code: the fused loss kernels are not custom ops yet
    fused = get_backend(inputs.backend).fuses_loss and not torch.compiler.is_compiling()
    if fused and opts.loss_in_kernel and inputs.vocab_shard is None:
        return inputs.as_called(source.fused_loss(inputs, policy))
    logp, entropy = source.logprobs(inputs, opts.compute_entropy, final=True)
    return loss_in_torch(inputs, logp, entropy, policy)


def compute_logprobs(source, ids, temperature: float, compute_entropy: bool, settings: LogprobSettings):
    """(log-probs, entropy or None) in fp32, shaped like the ids, differentiable where autograd records;
    ``ids`` None: the entropy alone. The one body of ``token_logprobs`` and its family."""
    source, inputs = prepare_logprob_inputs(source, ids, temperature, settings)
    logp, entropy = source.logprobs(inputs, compute_entropy, final=True)
    if inputs.caller_shape is None:
        return logp, entropy
    return logp.reshape(inputs.caller_shape), None if entropy is None else entropy.reshape(inputs.caller_shape)


def loss_in_torch(inputs: LossInputs, logp, entropy, policy: PolicyTerms) -> GRPOLossOutput:
    """The loss math in torch on differentiable log-probs (and entropy) of the token layout: every
    per-token input taken to the sequence layout, the output given back as the caller shaped it."""
    seq = inputs.layout.seq
    per_token = TokenInputs(inputs.mask_seq, seq(inputs.advantages), seq(inputs.old_logps), seq(inputs.ref_logps),
                            seq(policy.importance_weights))
    out = loss_from_logps(seq(logp), seq(entropy), per_token, inputs.normalizer, inputs.options, inputs.loss_scale,
                          policy.bonus_mask, policy.policy_mask)
    return inputs.as_called(out, seq_layout=True)


def with_policy_masks(inputs: LossInputs, first_pass) -> PolicyTerms:
    """TRL's policy-term masks from a first, gradient-free pass's (log-probs, entropy) in the token layout
    (0 at masked tokens): the masks need every token's entropy (the top-entropy quantile, gathered across
    processes) or each row's mean log-prob gap (the off-policy mask) before any gradient is final. They
    are computed in the sequence layout.

    Where the kernels compute the loss, the masks are folded into the importance weights (sequence
    layout), which multiply the policy term only, as TRL's masks do: so the one-pass kernel still writes
    the gradient in its single pass. Where the loss math runs in torch, the mask stays separate (vespo
    takes the importance weights into its sequence weight instead of the loss)."""
    opts, L, mask_seq = inputs.options, inputs.layout, inputs.mask_seq
    logp, entropy = (L.seq(t) for t in first_pass)
    sampling = inputs.old_logps if inputs.sampling_logps is None else inputs.sampling_logps
    policy_mask, entropy_mask = policy_masks(logp, entropy, mask_seq, L.seq(inputs.advantages).detach().float(),
                                             L.seq(sampling), opts)
    bonus_mask = mask_seq if entropy_mask is None else mask_seq * entropy_mask
    importance_weights = L.seq(inputs.importance_weights)
    if not opts.loss_in_kernel:
        return PolicyTerms(importance_weights, policy_mask, bonus_mask)
    if importance_weights is not None:
        policy_mask = importance_weights.detach().float() * policy_mask
    return PolicyTerms(policy_mask.expand_as(mask_seq), None, bonus_mask)
