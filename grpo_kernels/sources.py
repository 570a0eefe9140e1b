"""The two input forms of a loss call, as two sources with the same three operations.

- ``LogitsSource``: logits [B, T, V] (or [B, T + 1, V] with ``drop_last_position``).
- ``HiddenStatesSource``: hidden states [B, T, H] and the lm_head weight [V, H] (and bias): the
  [N, V] logits are never held.

Each one checks itself (``checked_logits_shape``, ``for_call``), gives the call's differentiable
log-probs (``logprobs``: the loss math then runs in torch) and runs the fused loss kernels where they
apply (``fused_loss``: the per-token loss math inside the logits pass). The schedule of a fused call
(one-pass or two-pass; recompute or 3-product lm_head) is chosen here, with the launchers' measured
defaults (``kernels/tuned.json``) where the caller gave no hint.

``compute_loss`` and ``compute_logprobs`` are the one dispatch every public function calls, on either source:

1. TRL's policy-term masks, where the options ask for them: a first, gradient-free log-prob pass.
2. The fused loss kernels where they apply (a backend that has them, a token-level loss, one
   device's vocabulary), else the differentiable log-probs with the loss math in torch
   (``objective.loss_from_logps``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .backends import get_backend
from .functions import (
    FusedLinearThreeProducts,
    FusedLinearTokenLoss,
    FusedTokenLoss,
    FusedTokenLossOnePass,
    LinearTokenLogprobs,
    TokenLogprobs,
    aligned,
    three_products_loss_without_gradient,
)
from .inputs import LogprobSettings, LossInputs, packed_layout, prepare_logprob_inputs
from .kernels.contracts import TokenInputs
from .objective import GRPOLossOutput, loss_from_logps, metric_names, policy_masks
from .validation import check_in_place, check_linear_inputs, checked_drop_last_position

LM_HEAD_MODES = ("recompute", "three_products")


@dataclasses.dataclass(frozen=True)
class PolicyTerms:
    """What TRL's policy-term masks make of a call (``with_policy_masks``): the importance weights,
    a separate policy mask where the loss math runs in torch (else folded into the weights), and the
    tokens the entropy bonus acts on. Without masks: the call's weights, no mask, every active token."""

    importance_weights: Optional[torch.Tensor]
    policy_mask: Optional[torch.Tensor]
    bonus_mask: torch.Tensor


def _kernel_output(inputs: LossInputs, loss, metrics, logp) -> GRPOLossOutput:
    """The output of a fused loss Function: its loss, its metrics vector under TRL's names (the loss-metrics
    kernel's order), its log-probs (not differentiable)."""
    o = inputs.options
    return GRPOLossOutput(loss, dict(zip(metric_names(o, o.uses_kl, o.compute_entropy), metrics.unbind())), logp)


class LogitsSource:
    what = "logits"

    def __init__(self, logits: torch.Tensor, *, drop_last_position: bool = False, in_place_backward: bool = False,
                 one_pass: Optional[bool] = None):
        self.tensor = logits  # as passed: [B, T, V], or [B, T + 1, V] with drop_last_position
        self.drop_last_position = drop_last_position
        self.in_place_backward = in_place_backward
        self.one_pass = one_pass
        self.logits = None  # the [B, T, V] view that predicts the completion (for checks: made without autograd)

    def packed(self, cu_seqlens):
        """(layout, this source as one row [1, total, V]) of a packed batch."""
        if self.drop_last_position:
            raise ValueError("drop_last_position=True applies to padded [B, T + 1, V] logits, not to a packed batch "
                             "(cu_seqlens): give the packed logits of the completion tokens only")
        layout, one_row = packed_layout(cu_seqlens, self.tensor, self.what)
        return layout, LogitsSource(one_row, in_place_backward=self.in_place_backward, one_pass=self.one_pass)

    def as_one_row(self) -> "LogitsSource":
        """Logits [..., V] of other leading dims as one row [1, N, V] (a view where possible)."""
        return LogitsSource(self.tensor.reshape(1, -1, self.tensor.shape[-1]), in_place_backward=self.in_place_backward,
                            one_pass=self.one_pass)

    def checked_logits_shape(self, ids) -> torch.Tensor:
        if not checked_drop_last_position(self.drop_last_position, self.tensor, ids):
            self.logits = self.tensor
            return self.logits
        # a view for shapes and strides, without an autograd node (host time; set_grad_enabled called as a
        # function costs a tenth of a no_grad block)
        enabled = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        try:
            self.logits = aligned(self.tensor, True)
        finally:
            torch.set_grad_enabled(enabled)
        return self.logits

    def for_call(self, backend: str, sharded: bool) -> "LogitsSource":
        if sharded and self.in_place_backward:
            raise ValueError("in_place_backward=True is not supported with vocab_parallel_group")
        check_in_place(self.in_place_backward, self.tensor)
        if backend == "triton" and self.logits.stride(-1) != 1:
            raise ValueError(
                f"backend='triton' needs logits with a unit last stride, got strides {tuple(self.logits.stride())}; "
                "views that slice B or T are fine, a transposed vocabulary is not (call .contiguous())"
            )
        return self

    def logprobs(self, inputs: LossInputs, compute_entropy: bool, final: bool = False):
        """(log-probs, entropy or None) [B, T], differentiable, 0 at masked tokens. ``final``: the pass the
        gradient flows through (it may write the gradient into the logits, with in_place_backward)."""
        temperature, softcap = inputs.options.kernel_temperature, inputs.options.kernel_softcap
        if inputs.vocab_shard is not None:
            from .vocab_parallel import vocab_parallel_logprobs

            return vocab_parallel_logprobs(aligned(self.tensor, self.drop_last_position), inputs.ids,
                                           inputs.kernel_mask, temperature, softcap, compute_entropy, inputs.backend,
                                           inputs.vocab_shard)
        return TokenLogprobs.apply(self.tensor, inputs.ids.contiguous(), inputs.kernel_mask, temperature, softcap,
                                   compute_entropy, inputs.backend, final and self.in_place_backward,
                                   self.drop_last_position)[:2]

    def fused_loss(self, inputs: LossInputs, policy: PolicyTerms) -> GRPOLossOutput:
        """The loss with its per-token math in the logits kernel: one-pass (dlogits written in the
        forward, 2 x S bytes) where a gradient is wanted and the schedule allows, else two-pass."""
        loss_tokens = inputs.loss_tokens(policy)
        wants_grad = torch.is_grad_enabled() and self.tensor.requires_grad
        one_pass = self.one_pass
        if one_pass is None:  # the device sweep's measured choice for this GPU and vocabulary, else one-pass
            one_pass = get_backend(inputs.backend).launch.default_one_pass(self.tensor)
        if one_pass and wants_grad and not self.in_place_backward:
            outputs = FusedTokenLossOnePass.apply(self.tensor, inputs.ids.contiguous(), loss_tokens, inputs.options,
                                                  self.drop_last_position)
        else:  # two-pass: dLoss/dlogp (and dLoss/dH) applied by the backward kernel
            outputs = FusedTokenLoss.apply(self.tensor, inputs.ids.contiguous(), loss_tokens, inputs.options,
                                           self.in_place_backward, self.drop_last_position)
        return _kernel_output(inputs, *outputs)


class HiddenStatesSource:
    what = "hidden_states"

    def __init__(self, hidden_states: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 lm_head_mode: Optional[str] = None):
        self.tensor, self.weight, self.bias, self.lm_head_mode = hidden_states, weight, bias, lm_head_mode
        self._flat, self._flat_with_grad = None, False

    def packed(self, cu_seqlens):
        layout, one_row = packed_layout(cu_seqlens, self.tensor, self.what)
        return layout, HiddenStatesSource(one_row, self.weight, self.bias, self.lm_head_mode)

    def as_one_row(self) -> "HiddenStatesSource":
        return HiddenStatesSource(self.tensor.reshape(1, -1, self.tensor.shape[-1]), self.weight, self.bias,
                                  self.lm_head_mode)

    def checked_logits_shape(self, ids) -> torch.Tensor:
        check_linear_inputs(self.tensor, self.weight, self.bias)
        B, T, _ = self.tensor.shape
        return self.tensor.new_empty(()).expand(B, T, self.weight.shape[0])  # shape checks only, no memory

    def for_call(self, backend: str, sharded: bool) -> "HiddenStatesSource":
        mode = self.lm_head_mode
        if mode is None:  # the device sweep's measured choice, else recompute
            # (inside a torch.compile graph only the log-prob kernels run: see compute_loss)
            mode = ("recompute" if backend != "triton" or torch.compiler.is_compiling()
                    else get_backend(backend).lm_head_launch.default_lm_head_mode(self.tensor, self.weight.shape[0]))
        if mode not in LM_HEAD_MODES:
            raise ValueError(f"lm_head_mode must be one of {list(LM_HEAD_MODES)}, got {mode!r}")
        return HiddenStatesSource(self.tensor, self.weight, self.bias, mode)

    def flat(self, inputs: LossInputs) -> tuple:
        """(hidden [N, H], weight, bias, ids [N]) as the kernels read them. Masked tokens are never read:
        their hidden states become 0 and their ids 0 (one O(N * H) copy, which also makes a sliced view
        contiguous). Padding garbage (NaN, inf) would otherwise reach d weight, a sum over every token's
        hidden state."""
        if self._flat is not None and (self._flat_with_grad or not torch.is_grad_enabled()):
            return self._flat  # (a copy made under no_grad, for the masks' first pass, carries no gradient)
        B, T, H = self.tensor.shape
        if inputs.mask is None:  # a log-prob call: every token read
            hidden, ids = self.tensor.reshape(B * T, H).contiguous(), inputs.ids.reshape(-1).contiguous()
        else:
            active = (inputs.mask != 0).reshape(B * T, 1)
            hidden = torch.where(active, self.tensor.reshape(B * T, H), 0.0)
            ids = torch.where(active.squeeze(1), inputs.ids.reshape(-1), 0).contiguous()
        self._flat = (hidden, self.weight.contiguous(), None if self.bias is None else self.bias.contiguous(), ids)
        self._flat_with_grad = torch.is_grad_enabled()
        return self._flat

    def logprobs(self, inputs: LossInputs, compute_entropy: bool, final: bool = False):
        """(log-probs, entropy or None) [B, T], differentiable, 0 at masked tokens, as in the logits source."""
        B, T = inputs.shape
        temperature, softcap = inputs.options.kernel_temperature, inputs.options.kernel_softcap
        if inputs.vocab_shard is not None:
            from .vocab_parallel import vocab_parallel_linear_logprobs

            pair = vocab_parallel_linear_logprobs(self.flat(inputs), temperature, softcap, compute_entropy,
                                                  inputs.backend, inputs.vocab_shard)
        else:
            pair = LinearTokenLogprobs.apply(*self.flat(inputs), temperature, softcap, compute_entropy,
                                             inputs.backend)[:2]
        if inputs.mask is None:
            return tuple(None if t is None else t.view(B, T) for t in pair)
        active = (inputs.mask != 0).view(B, T)
        return tuple(None if t is None else torch.where(active, t.view(B, T), 0.0) for t in pair)

    def fused_loss(self, inputs: LossInputs, policy: PolicyTerms) -> GRPOLossOutput:
        """The loss with its per-token math in the lm_head kernels: "recompute" (the backward recomputes
        each chunk's logits) or "three_products" (each chunk's logits once, by cuBLAS; the gradient in the
        forward)."""
        args = (*self.flat(inputs), inputs.loss_tokens(policy), inputs.options, inputs.shape)
        wants_grad = torch.is_grad_enabled() and (self.tensor.requires_grad or self.weight.requires_grad)
        if self.lm_head_mode == "three_products" and wants_grad:
            outputs = FusedLinearThreeProducts.apply(*args)
        elif self.lm_head_mode == "three_products":  # no gradient wanted: cuBLAS logits and the logits kernel
            outputs = three_products_loss_without_gradient(*args)
        else:
            outputs = FusedLinearTokenLoss.apply(*args)
        return _kernel_output(inputs, *outputs)


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
