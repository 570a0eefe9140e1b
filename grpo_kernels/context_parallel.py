"""Context parallelism: every sequence split over the ranks of a group (Megatron's ``context_parallel_size``: each
rank holds two zigzag chunks of every sequence, padded [B, T / CP] or a packed THD batch with its own ``cu_seqlens``).

A token's log-prob, entropy and gradient need only its own logits, so each rank runs the log-prob pass on its own
tokens, with no exchange. What needs the whole sequence is the loss's math on them: the row and batch token counts of
the reductions, GSPO's sequence ratio, VESPO's sequence weight, the prompt mean, the rollout correction's sequence
terms, the metrics. So the group exchanges the per-token values, O(B * T) numbers and never a logit, and every rank
runs that math on the whole sequences (a token's place within its sequence changes none of it: each sequence is its
rank-ordered parts, end to end). Every rank then holds the whole batch's loss and metrics, the values one process
computes on the whole batch; the exchange's backward gives each rank the whole loss's gradient at its own tokens, its
slice, with nothing to reduce (as verl's ``postprocess_packed_seqs`` gathers its per-token outputs). Summed over the
group, the ranks' parameter gradients are the whole loss's: a trainer that averages gradients over data x context
parallel ranks (Megatron's DDP) multiplies the loss by the context-parallel size first, as Megatron's own loss does.

``whole_sequences`` turns a prepared call on this rank's tokens into the call on the whole sequences, which the rest
of the pipeline runs unchanged (``pipeline.loss``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import all_gathered
from .from_logits import zero_at_masked
from .inputs import LossInputs, SequenceLayout
from .kernels.contracts import Sequences


class WholeSequenceLogprobs:
    """The source of the call on the whole sequences: the log-probs and entropies [S, CP * T_part] already gathered,
    differentiable into this rank's own pass. What the pipeline asks of a source before the loss math runs in torch."""

    what = "log-probs"
    fused_in_graph = False

    def __init__(self, logp: torch.Tensor, entropy: torch.Tensor | None):
        self.logp, self.entropy = logp, entropy

    def logprobs(self, inputs, compute_entropy: bool, final: bool = False):
        """0 at the tokens ``inputs``' mask leaves out (a rollout correction's rejections among them, which this rank's
        pass, run before the correction, did read), as every pass gives them."""
        logp, entropy = zero_at_masked(inputs.mask, self.logp, self.entropy if compute_entropy else None)
        if final:
            return logp, entropy
        return logp.detach(), None if entropy is None else entropy.detach()


class WholeSequenceLayout(SequenceLayout):
    """The whole sequences as padded rows [S, CP * T_part]: rank r's tokens of sequence s at columns r * T_part on
    (its own sequence layout's row s, 0 past its tokens). ``gathered`` makes a per-token value of this rank's call
    the whole sequences'; ``from_seq`` gives this rank's own tokens back, in the token layout the caller passed them
    in. ``over`` builds it: one exchange of the parts' sizes (a host sync)."""

    def __init__(self, local: SequenceLayout, T_part: int, group, rank: int, world: int):
        self.packed = False
        self.S, self.T_max = local.S, T_part * world
        self.N = self.S * self.T_max
        self.sequences = Sequences(self.S, self.T_max)
        self.local, self.group, self.rank, self.T_part = local, group, rank, T_part
        self.own = slice(rank * T_part, rank * T_part + local.T_max)

    @classmethod
    def over(cls, local: SequenceLayout, group, device) -> WholeSequenceLayout:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        sizes = torch.stack(all_gathered(torch.tensor([local.S, local.T_max], device=device), group)).cpu()
        if (sizes[:, 0] != local.S).any():
            raise ValueError(
                "context_parallel_group: every rank holds its part of the same sequences, so each passes as many "
                f"sequences (rows, or cu_seqlens' entries - 1), got {sizes[:, 0].tolist()} across the group's ranks"
            )
        return cls(local, int(sizes[:, 1].max()), group, rank, world)

    def part(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of each sequence, [S, T_part], 0 past them."""
        seq = self.local.seq(t)
        return torch.nn.functional.pad(seq, (0, self.T_part - seq.shape[1])).contiguous()

    def gathered(self, t: torch.Tensor | None, differentiable: bool = False) -> torch.Tensor | None:
        """A per-token value of this rank's call (its token or sequence layout) as the whole sequences' [S, CP *
        T_part]: detached fp32, or ``differentiable`` into this rank's part (``GatheredParts``)."""
        if t is None:
            return None
        if differentiable:
            return GatheredParts.apply(self.part(t), self.group, self.rank)
        return torch.cat(all_gathered(self.part(t.detach().float()), self.group), dim=1)

    def gathered_together(self, *values, differentiable: bool = False) -> tuple:
        """``gathered`` of several per-token values (None stays None) in one exchange: stacked [k, S, T_part], one
        all-gather for them all, not one each."""
        present = [t for t in values if t is not None]
        if not present:
            return values
        parts = [self.part(t if differentiable else t.detach().float()) for t in present]
        if differentiable:
            whole = GatheredParts.apply(torch.stack(parts), self.group, self.rank)
        else:
            whole = torch.cat(all_gathered(torch.stack(parts), self.group), dim=-1)
        gathered = iter(whole.unbind(0))
        return tuple(None if t is None else next(gathered) for t in values)

    def from_seq(self, t: torch.Tensor) -> torch.Tensor:
        return self.local.from_seq(t[:, self.own])


class GatheredParts(torch.autograd.Function):
    """Every rank's part [..., S, T_part] of the sequences, side by side in rank order [..., S, CP * T_part]. Every
    rank computes the same loss from the result, so the gradient at this rank's part is the whole loss's there: the
    backward takes its slice and reduces nothing."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, group, rank: int):
        width = part.shape[-1]
        ctx.own = slice(rank * width, (rank + 1) * width)
        return torch.cat(all_gathered(part, group), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.own], None, None


def whole_sequences(inputs: LossInputs, group) -> LossInputs:
    """The loss call ``inputs`` (this rank's tokens of every sequence, prepared) as the call on the whole sequences:
    this rank's differentiable log-prob pass, then the per-token values exchanged over ``group``: two all-gathers
    after the sizes' exchange, one of the differentiable log-probs (and entropy), one of every detached input stacked.
    Per-sequence inputs (advantages or importance weights [S] / [S, 1], ``prompt_ids``) are the same on every rank and
    stay as they are."""
    opts, local = inputs.options, inputs.layout
    logp, entropy = inputs.source.logprobs(inputs, opts.compute_entropy, final=True)
    whole = WholeSequenceLayout.over(local, group, inputs.mask.device)
    per_token = lambda t: None if t is None or local.per_sequence(t) else t  # noqa: E731
    mask, old, ref, sampling, advantages, importance_weights = whole.gathered_together(
        inputs.mask,
        inputs.old_logps,
        inputs.ref_logps,
        inputs.sampling_logps,
        per_token(inputs.advantages),
        per_token(inputs.importance_weights),
    )
    return inputs._replace(
        source=WholeSequenceLogprobs(*whole.gathered_together(logp, entropy, differentiable=True)),
        ids=torch.zeros(mask.shape, dtype=torch.long, device=mask.device),  # (the pass has run: no id is read again)
        mask=mask,
        mask_seq=mask,
        advantages=inputs.advantages if advantages is None else advantages,
        old_logps=old,
        ref_logps=ref,
        importance_weights=inputs.importance_weights if importance_weights is None else importance_weights,
        sampling_logps=sampling,
        backend=inputs.backend._replace(name="torch"),  # the loss math in torch on the gathered log-probs
        layout=whole,
        caller_shape=caller_shape(inputs),
        vocab_shard=None,
        kept=None,
    )


def caller_shape(inputs: LossInputs) -> torch.Size:
    """The shape a call's per-token outputs take: its ids' as the caller passed them (a packed call's too)."""
    return inputs.caller_shape if inputs.caller_shape is not None else inputs.ids.shape


def whole_rows(inputs: LossInputs, group, logp_seq: torch.Tensor, *per_token) -> tuple:
    """A method's log-prob pass on this rank's tokens (``pipeline.sequence_logprobs``: its ``LossInputs``, the
    differentiable log-probs in its sequence layout, and detached per-token values such as DPO's reference
    log-probs) as the whole sequences': (the inputs with the whole layout and mask, the log-probs [S, CP * T_part]
    differentiable into this rank's, each of ``per_token`` gathered)."""
    whole = WholeSequenceLayout.over(inputs.layout, group, logp_seq.device)
    mask, *per_token = whole.gathered_together(inputs.mask_seq, *per_token)
    inputs = inputs._replace(mask=mask, mask_seq=mask, layout=whole, caller_shape=caller_shape(inputs))
    return (inputs, whole.gathered(logp_seq, differentiable=True), *per_token)
