"""On-policy distillation on the log-prob pass: the student samples, a teacher scores the student's own tokens.

Two families, as verl 0.9's distillation registry (``verl/trainer/distillation``) and TRL 1.16's self-distillation
(``trl/experimental/sdpo``) compute them:

- **The top-k forward KL** (``topk_distillation_loss``, ``fused_linear_topk_distillation_loss``, the Modules): the
  teacher gives K ids and their log-probs a token; the student's log-probs at those ids, normalized over the whole
  vocabulary, come from one log-sum-exp pass and K gathered logits (``sparse_entries.TopKEntries``, an entries value
  of each input form's log-prob Function: from the head, each of the K logits its own dot product, no [N, V]
  tensor), and the divergence is written here in torch over
  [N, K]: autograd hands the kernels dLoss/dlog q, and their backward writes dL/dz = (sum of dL/dlog q over the
  token's entries with that id - (sum over all K) softmax) / T, the K ids' terms fused, no [N, V] scatter. The
  conventions by name:

  * ``convention="verl"`` (``forward_kl_topk``): both sides clamped below at ``log_prob_min_clamp``, the token's
    sum p (log p - log q) clamped at 0, then at +-``loss_max_clamp``, reduced by verl's ``loss_agg_mode``; metrics
    ``distillation/student_mass`` (and ``_min``, ``_max``), ``teacher_mass`` (the same), ``loss_min``, ``loss_max``,
    ``overlap_ratio`` and ``overlap_token_advantage`` (the student's own top-k ids), ``loss``.
  * ``convention="trl"`` (``compute_topk_self_distillation_loss`` on the teacher's ids): with ``add_tail`` the
    leftover mass 1 - sum as one more bucket on both sides (``add_tail_bucket``), else both renormalized over the
    K; TRL's generalized divergence of ``alpha`` (0: forward KL); reduced as TRL's trainer does (each row's token
    mean, then the mean over rows).

- **The reverse-KL estimators** (``reverse_kl_distillation_loss``): the teacher's log-prob of the sampled token
  through verl's estimators (``kl`` / ``k1``, ``abs``, ``mse`` / ``k2``, ``low_var_kl`` / ``k3``), as a supervised
  loss reduced by ``loss_agg_mode``, or in the policy-gradient form (``reverse_kl_advantages``: the advantage is minus
  the detached estimate, through ``grpo_loss`` with any of its loss types); verl's ``distillation_ppo_loss`` is that
  loss times its coefficient plus the task's GRPO loss (the recipe in ``reverse_kl_advantages``).

slime and prime-rl fold the teacher instead into the advantage: ``advantages + coef * (teacher_logps -
student_logps)`` per token (``docs/loss-semantics.md``), an input of ``grpo_loss`` as it is.
"""

from __future__ import annotations

import dataclasses

import torch

from . import collectives, pipeline
from .context_parallel import WholeSequenceLayout, whole_rows
from .conventions import VERL_AGG_MODES, verl_aggregate
from .from_hidden_states import HiddenStatesSource
from .from_logits import LogitsSource
from .inputs import LogprobSettings, check_context_parallel
from .methods import input_source
from .passes import aligned
from .validation import check_choice, check_like_mask, check_number

CONVENTIONS = ("verl", "trl")
REVERSE_KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
OVERLAP_CHUNK_TOKENS = 1024  # tokens a chunk of the student's own top-k (the overlap metric)


@dataclasses.dataclass
class DistillationOutput:
    """``loss``: the reduced loss (differentiable); ``metrics``: the convention's metrics (0-d tensors, detached);
    ``per_token_loss``: each token's divergence as the reduction reads it (0 at masked tokens), shaped as the
    completion's tokens."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    per_token_loss: torch.Tensor


# ---- The student's log-probs at the teacher's ids -----------------------------------------------------------------


def topk_logprobs(
    logits: torch.Tensor,
    teacher_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    backend: str = "auto",
    check_ids: bool = True,
    drop_last_position: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    vocab_parallel_group=None,
    vocab_start_index: int | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    head_precision: str = "input",
    reduce_hidden_grad: bool = True,
) -> torch.Tensor:
    """Differentiable log softmax(cap(logits) / temperature) at K ids a token (``teacher_ids`` [..., K] int, shaped
    as the logits without their last dim plus K; a packed call's [total, K]), normalized over the whole vocabulary,
    fp32: ``log_softmax(logits / T).gather(-1, teacher_ids)`` without the [N, V] log-softmax (one log-sum-exp pass,
    the K logits gathered beside it; the backward's K ids' terms fused into one dense pass). With ``weight`` (and
    ``bias``), ``logits`` holds the hidden states [..., H] and no [N, V] tensor is made (each of the K logits its own
    dot product). For a loss of one's own on a teacher's top-k (verl's ``forward_kl_topk`` logits processor, and its
    fused-kernel path from hidden states, are served by it: the verl adapter)."""
    source = input_source(logits, weight, bias, head_precision, drop_last_position)
    placeholder = (
        torch.zeros(teacher_ids.shape, device=teacher_ids.device) if isinstance(teacher_ids, torch.Tensor) else None
    )
    _, logq, _ = pipeline.logprobs_at_ids(
        source, teacher_ids, placeholder, None, temperature, LogprobSettings.of(locals())
    )
    return logq.reshape(teacher_ids.shape)


# ---- The top-k forward KL ----------------------------------------------------------------------------------------


def topk_distillation_loss(
    logits: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    *,
    convention: str = "verl",
    log_prob_min_clamp: float | None = -10.0,
    loss_max_clamp: float | None = 10.0,
    loss_agg_mode: str | None = None,
    add_tail: bool = True,
    alpha: float = 0.0,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
    compute_overlap: bool = True,
    backend: str = "auto",
    check_ids: bool = True,
    drop_last_position: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    vocab_parallel_group=None,
    vocab_start_index: int | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    context_parallel_group=None,
) -> DistillationOutput:
    """The top-k forward KL of the student's logits [B, T, V] (``logits[:, t]`` predicts token t; [B, T + 1, V] with
    ``drop_last_position``; a packed [total, V] with ``cu_seqlens``; a vocabulary slice with
    ``vocab_parallel_group``, the teacher's ids global) against the teacher's K ids and log-probs a token
    (``teacher_ids`` int and ``teacher_logps`` [B, T, K]), on the active tokens of ``completion_mask``. The
    student's log-probs are log softmax(cap(logits) / temperature) at the teacher's ids.

    ``convention``: "verl" (``log_prob_min_clamp`` -10, ``loss_max_clamp`` 10 and ``loss_agg_mode`` "token-mean"
    by default, verl's; ``dp_size``, ``batch_num_tokens``, ``global_batch_size``: verl's ``global_batch_info``) or
    "trl" (``add_tail``, ``alpha``; TRL's reduction). ``compute_overlap``: verl's overlap metrics, from the student's
    own top-K ids (``torch.topk`` over chunks of the logits: one more read of them). ``context_parallel_group``: each
    rank's tokens of every sequence, the loss and metrics the whole sequences' on every rank (as ``grpo_loss``). See
    the module docstring."""
    source = LogitsSource(logits, drop_last_position=drop_last_position)
    return _topk_loss(source, locals())


def fused_linear_topk_distillation_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    *,
    convention: str = "verl",
    log_prob_min_clamp: float | None = -10.0,
    loss_max_clamp: float | None = 10.0,
    loss_agg_mode: str | None = None,
    add_tail: bool = True,
    alpha: float = 0.0,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
    compute_overlap: bool = False,
    backend: str = "auto",
    check_ids: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    vocab_parallel_group=None,
    vocab_start_index: int | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    head_precision: str = "input",
    reduce_hidden_grad: bool = True,
    context_parallel_group=None,
) -> DistillationOutput:
    """``topk_distillation_loss`` from hidden states [B, T, H] and the lm_head ``weight`` [V, H] (and ``bias``): the
    [N, V] logits are never held (each of the K ids' logits its own dot product beside the head's log-sum-exp pass).
    ``compute_overlap`` (off by default here): verl's overlap metrics need the student's own top-k ids, taken from
    [chunk, V] tiles of the head's logits, one more product pass without gradient."""
    source = HiddenStatesSource(hidden_states, weight, bias, head_precision=head_precision)
    return _topk_loss(source, locals())


def _topk_loss(source, settings: dict) -> DistillationOutput:
    """The one body of the top-k family: the pass (``pipeline.logprobs_at_ids``), the convention's per-token
    divergence in torch over [N, K], its reduction and metrics."""
    convention = settings["convention"]
    check_choice("convention", convention, CONVENTIONS)
    check_context_parallel(settings["context_parallel_group"])
    for name in ("loss_agg_mode", "loss_scale_factor"):
        if convention == "trl" and settings[name] is not None:
            raise ValueError(
                f"{name} is verl's reduction's; convention='trl' reduces as TRL's trainer does (each row's token "
                f"mean, then the mean over rows), got {name}={settings[name]!r}"
            )
    check_number("loss_scale_factor", settings["loss_scale_factor"], positive=True, optional=True)
    check_number("alpha", settings["alpha"], non_negative=True)
    if settings["alpha"] > 1.0:
        raise ValueError(f"alpha must be in [0, 1] (TRL's generalized divergence), got {settings['alpha']}")
    inputs, logq, logp = pipeline.logprobs_at_ids(
        source,
        settings["teacher_ids"],
        settings["teacher_logps"],
        settings["completion_mask"],
        settings["temperature"],
        LogprobSettings.of(settings),
    )
    active = inputs.mask.reshape(logq.shape[:-1]) != 0
    logp = torch.where(active.unsqueeze(-1), logp.to(logq.dtype), 0.0)
    whole = _WholeTokens(inputs, active, settings["context_parallel_group"])
    if convention == "verl":
        per_token, metrics = _verl_forward_kl(logq, logp, active, settings, whole)
        loss = _verl_reduced(whole(per_token, differentiable=True), whole.inputs, settings)
    else:
        per_token, metrics = _trl_forward_kl(logq, logp, active, settings), {}
        loss = _trl_reduced(whole(per_token, differentiable=True), whole.inputs)
    if convention == "verl" and settings["compute_overlap"]:
        metrics.update(_overlap_metrics(inputs, logq.detach(), logp, active, settings, whole))
    metrics["distillation/loss"] = loss.detach()
    per_token = per_token if inputs.caller_shape is None else per_token.reshape(inputs.caller_shape)
    return DistillationOutput(loss, metrics, per_token)


class _WholeTokens:
    """A top-k call's per-token values as the reductions and metrics read them: this call's own, or with a
    ``context_parallel_group`` the whole sequences' (``context_parallel.WholeSequenceLayout``: exchanged over the
    group, a value ``differentiable`` into this rank's), with ``active`` and ``inputs`` to match."""

    def __init__(self, inputs, active, group):
        self.layout = None if group is None else WholeSequenceLayout.over(inputs.layout, group, active.device)
        if self.layout is None:
            self.active, self.inputs = active, inputs
            return
        mask = self.layout.gathered(inputs.mask.reshape(active.shape))
        self.active = mask != 0
        self.inputs = inputs._replace(mask=mask, mask_seq=mask, layout=self.layout)

    def __call__(self, t: torch.Tensor, differentiable: bool = False) -> torch.Tensor:
        return t if self.layout is None else self.layout.gathered(t, differentiable)


def _verl_forward_kl(logq, logp, active, settings, whole: _WholeTokens) -> tuple:
    """verl's ``compute_forward_kl_topk`` and its registered loss: the masses, the clamped sum p (log p - log q)
    clamped at 0 (the token's loss), the range metrics (over ``whole``'s tokens), then ``loss_max_clamp``."""
    clamp = settings["log_prob_min_clamp"]
    student_mass, teacher_mass = logq.exp().sum(-1), logp.exp().sum(-1)
    if clamp is not None:
        logq, logp = logq.clamp_min(clamp), logp.clamp_min(clamp)
    per_token = (logp.exp() * (logp - logq)).sum(-1).clamp_min(0.0)
    per_token = torch.where(active, per_token, 0.0)
    metrics = {}
    for name, value in (("student_mass", student_mass), ("teacher_mass", teacher_mass)):
        metrics.update(_mean_min_max(f"distillation/{name}", whole(value.detach()), whole.active))
    metrics.update(_mean_min_max("distillation/loss", whole(per_token.detach()), whole.active, mean=False))
    cap = settings["loss_max_clamp"]
    if cap is not None:  # (the minimum for k1, which can be negative; here it is at least 0 already)
        per_token = per_token.clamp(min=-cap, max=cap)
    return per_token, metrics


def _mean_min_max(name: str, value: torch.Tensor, active: torch.Tensor, mean: bool = True) -> dict:
    """A per-token value's mean, min and max over the active tokens (NaN without any), verl's names; on the device,
    no host sync (and so inside a graph)."""
    out = {} if not mean else {name: _active_mean(value, active)}
    out[f"{name}_min"] = _over_active(value.masked_fill(~active, float("inf")).min(), active)
    out[f"{name}_max"] = _over_active(value.masked_fill(~active, float("-inf")).max(), active)
    return out


def _active_mean(value: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """A per-token value's mean over the active tokens, NaN without any (no host sync)."""
    return _over_active(torch.where(active, value, 0.0).sum() / active.sum().clamp(min=1), active)


def _over_active(x: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """``x``, a statistic over the active tokens, NaN where there is none."""
    return torch.where(active.any(), x, torch.full((), float("nan"), device=x.device, dtype=x.dtype))


def _verl_reduced(per_token, inputs, settings) -> torch.Tensor:
    """verl's ``agg_loss`` over the sequence layout (a packed call's sequences as rows)."""
    mode = settings["loss_agg_mode"] or "token-mean"
    check_choice("loss_agg_mode", mode, VERL_AGG_MODES)
    L = inputs.layout
    mask = L.seq(inputs.mask.reshape(per_token.shape))
    return _verl_aggregated(
        L.seq(per_token),
        mask,
        mode,
        settings["dp_size"],
        settings["batch_num_tokens"],
        settings["global_batch_size"],
        settings["loss_scale_factor"],
    )


def _verl_aggregated(per_token, mask, mode: str, dp_size: int, batch_num_tokens, global_batch_size, loss_scale_factor):
    """verl's ``agg_loss`` of [rows, T] per-token values, its ``global_batch_info`` defaulted on one process to this
    call's counts, at least 1 (an all-padding batch gives 0 tokens and rows, which verl's own counts never are)."""
    tokens, rows = batch_num_tokens, global_batch_size
    if dp_size == 1:
        tokens = mask.sum().clamp(min=1.0) if tokens is None else tokens
        rows = (mask.sum(-1) > 0).sum().clamp(min=1) if rows is None else rows
    return verl_aggregate(
        per_token,
        mask,
        mode,
        dp_size=dp_size,
        batch_num_tokens=tokens,
        global_batch_size=rows,
        loss_scale_factor=loss_scale_factor,
    )


def _trl_forward_kl(logq, logp, active, settings) -> torch.Tensor:
    """TRL's top-k divergence on the teacher's ids: a tail bucket on both sides (``add_tail_bucket``) or both
    renormalized over the K, then its generalized divergence of ``alpha`` summed over the buckets."""
    if settings["add_tail"]:
        logq, logp = _with_tail_bucket(logq), _with_tail_bucket(logp)
    else:
        logq = logq - torch.logsumexp(logq, dim=-1, keepdim=True)
        logp = logp - torch.logsumexp(logp, dim=-1, keepdim=True)
    per_token = _divergence(logq, logp, settings["alpha"])
    return torch.where(active, per_token, 0.0)


def _with_tail_bucket(log_probs: torch.Tensor) -> torch.Tensor:
    """K log-probs and one more bucket, log(1 - their mass), the mass capped below 1 by e^-1e-7 as TRL caps it."""
    log_mass = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([log_probs, torch.log(-torch.expm1(log_mass))], dim=-1)


def _divergence(logq: torch.Tensor, logp: torch.Tensor, alpha: float) -> torch.Tensor:
    """TRL's generalized divergence of the student's (logq) and the teacher's (logp) buckets: alpha 0 the forward
    KL(p || q), 1 the reverse, between them the lerp of both against their mixture."""

    def kl(log_target, log_input):  # KL(target || input), summed over the buckets
        return (log_target.exp() * (log_target - log_input)).sum(-1)

    if alpha == 0.0:
        return kl(logp, logq)
    if alpha == 1.0:
        return kl(logq, logp)
    a = torch.tensor(alpha, dtype=logq.dtype, device=logq.device)
    mixture = torch.logsumexp(torch.stack([logq + torch.log(1 - a), logp + torch.log(a)]), dim=0)
    return torch.lerp(kl(logq, mixture), kl(logp, mixture), a)


def _trl_reduced(per_token, inputs) -> torch.Tensor:
    """TRL's self-distillation reduction: each row's token mean (its count clamped at 1), then the mean over rows."""
    L = inputs.layout
    mask = L.seq(inputs.mask.reshape(per_token.shape))
    return ((L.seq(per_token) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def _overlap_metrics(inputs, logq, logp, active, settings, whole: _WholeTokens) -> dict:
    """verl's overlap diagnostics: the share of the teacher's K ids among the student's own top-K (the mean over
    active tokens, over K), and the mean over tokens with an overlap of -p (log p - log q) over the overlapping ids
    (both sides clamped as the loss clamps them)."""
    K = logq.shape[-1]
    student_top = _student_topk_ids(inputs, K).view(logq.shape)
    teacher_ids = settings["teacher_ids"].reshape(logq.shape).to(student_top.device)
    overlap = (teacher_ids.unsqueeze(-1) == student_top.unsqueeze(-2)).any(-1)
    count = overlap.sum(-1)
    clamp = settings["log_prob_min_clamp"]
    if clamp is not None:
        logq, logp = logq.clamp_min(clamp), logp.clamp_min(clamp)
    token_kl = logp.exp() * (logp - logq)
    advantage = torch.where(count > 0, (-token_kl * overlap).sum(-1) / count.clamp_min(1), 0.0)
    count, advantage, active = whole(count.float()), whole(advantage), whole.active  # (over the whole sequences)
    with_overlap = active & (count > 0)
    ratio = _active_mean(count, active) / K  # (NaN without an active token)
    advantage = _active_mean(advantage, with_overlap)
    return {
        "distillation/overlap_ratio": ratio,
        "distillation/overlap_token_advantage": torch.where(with_overlap.any(), advantage, 0.0),
    }


@torch.no_grad()
def _student_topk_ids(inputs, K: int) -> torch.Tensor:
    """The student's own top-K ids [N, K] (global), a chunk of tokens at a time: ``torch.topk`` of its logits (from
    the head, of [chunk, V] products), merged across a vocabulary split (each rank's top-K, gathered, then the top-K
    of those). The cap and the temperature keep the order, so the raw logits' order is the distribution's."""
    source, shard = inputs.source, inputs.vocab_shard
    if isinstance(source, HiddenStatesSource):
        hidden, weight, bias, _ = source.flat(inputs)
        logits_of = lambda n: torch.nn.functional.linear(hidden[n], weight, bias)  # noqa: E731
        N = hidden.shape[0]
    else:
        logits = aligned(source.tensor, source.drop_last_position)
        flat = logits.reshape(-1, logits.shape[-1])
        logits_of = lambda n: flat[n]  # noqa: E731
        N = flat.shape[0]
    start = 0 if shard is None else shard.start
    values, ids = [], []
    for n0 in range(0, N, OVERLAP_CHUNK_TOKENS):
        chunk = logits_of(slice(n0, min(n0 + OVERLAP_CHUNK_TOKENS, N))).float()
        top = torch.topk(chunk, k=min(K, chunk.shape[-1]), dim=-1)
        values.append(top.values)
        ids.append(top.indices + start)
    values, ids = torch.cat(values), torch.cat(ids)
    if shard is not None:  # the global top-K among every rank's top-K
        values = torch.cat(collectives.all_gathered(values, shard.group), dim=-1)
        ids = torch.cat(collectives.all_gathered(ids, shard.group), dim=-1)
        ids = ids.gather(-1, torch.topk(values, k=K, dim=-1).indices)
    return ids


# ---- The reverse-KL estimators -----------------------------------------------------------------------------------


def reverse_kl_distillation_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    teacher_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    *,
    estimator: str = "k3",
    loss_max_clamp: float | None = 10.0,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    check_ids: bool = True,
    drop_last_position: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    vocab_parallel_group=None,
    vocab_start_index: int | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    head_precision: str = "input",
    reduce_hidden_grad: bool = True,
    context_parallel_group=None,
) -> DistillationOutput:
    """verl's single-sample reverse-KL distillation as a supervised loss (``compute_distillation_loss_reverse_kl_
    estimator`` and ``distillation_loss`` without the policy gradient): the student's log-prob of each sampled token
    (the log-prob pass: logits, or hidden states with the head's ``weight`` and ``bias``; packed; a vocabulary
    split) and the teacher's ``teacher_logps`` [B, T] through verl's ``kl_penalty`` ``estimator`` ("kl" / "k1",
    "abs", "mse" / "k2", "low_var_kl" / "k3": the log-ratio clamped to +-20, the estimate to +-10), the range and
    ``distillation/abs_loss`` metrics, clamped to +-``loss_max_clamp``, reduced by ``loss_agg_mode``.
    ``context_parallel_group``: each rank's tokens of every sequence, the loss and metrics the whole sequences' on
    every rank (as ``grpo_loss``).

    The policy-gradient form (verl's ``use_policy_gradient``, Thinking Machines' on-policy distillation) is
    ``grpo_loss`` with ``reverse_kl_advantages`` as its advantages; verl's ``distillation_ppo_loss`` sums that loss
    times its coefficient and the task's GRPO loss (``docs/loss-semantics.md``)."""
    check_choice("estimator", estimator, REVERSE_KL_ESTIMATORS)
    check_choice("loss_agg_mode", loss_agg_mode, VERL_AGG_MODES)
    check_number("loss_scale_factor", loss_scale_factor, positive=True, optional=True)
    if estimator == "k1":  # as verl refuses it (its "kl", the same estimate, it lets through)
        raise ValueError(
            "estimator='k1' as a supervised loss: its gradient does not depend on the teacher's log-probs (verl "
            "refuses it); use it in the policy-gradient form, grpo_loss with advantages=reverse_kl_advantages(...)"
        )
    check_context_parallel(context_parallel_group)
    source = input_source(logits, weight, bias, head_precision, drop_last_position)
    inputs, logp, mask = pipeline.sequence_logprobs(
        source, completion_ids, completion_mask, temperature, LogprobSettings.of(locals())
    )
    check_like_mask("teacher_logps", teacher_logps, completion_mask)
    teacher = inputs.layout.seq(teacher_logps.reshape(inputs.ids.shape)).to(logp.dtype)
    if context_parallel_group is not None:  # the whole sequences' (every rank the same loss)
        inputs, logp, teacher = whole_rows(inputs, context_parallel_group, logp, teacher)
        mask, teacher = inputs.mask_seq, teacher.to(logp.dtype)
    L = inputs.layout
    active = mask != 0
    teacher = torch.where(active, teacher, logp.detach())  # a masked token's teacher value is never read
    per_token = torch.where(active, reverse_kl_estimate(logp, teacher, estimator), 0.0)
    metrics = _mean_min_max("distillation/loss", per_token.detach(), active, mean=False)
    metrics["distillation/abs_loss"] = _active_mean(per_token.detach().abs(), active)
    if loss_max_clamp is not None:
        per_token = per_token.clamp(min=-loss_max_clamp, max=loss_max_clamp)
    loss = _verl_aggregated(
        per_token, mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor
    )
    metrics["distillation/loss"] = loss.detach()
    per_token_out = per_token if inputs.caller_shape is None else L.from_seq(per_token).reshape(inputs.caller_shape)
    return DistillationOutput(loss, metrics, per_token_out)


def reverse_kl_advantages(
    student_logps: torch.Tensor,
    teacher_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    estimator: str = "k1",
    loss_max_clamp: float | None = 10.0,
) -> torch.Tensor:
    """The policy-gradient form's per-token advantage (verl's ``use_policy_gradient``, Thinking Machines' on-policy
    distillation): minus verl's ``estimator`` of the student's and the teacher's log-probs of the sampled tokens,
    clamped to +-``loss_max_clamp``, detached, 0 at masked tokens, [B, T] in fp32. Pass it to ``grpo_loss`` as its
    ``advantages`` (with ``GRPOOptions.from_preset("verl")`` that is verl's vanilla PPO loss); the student's
    log-probs come from ``token_logprobs`` without a gradient, as verl reads its own detached:

        with torch.no_grad():
            student = token_logprobs(logits, ids, temperature)
        advantages = reverse_kl_advantages(student, teacher_logps, mask)
        distill = grpo_loss(logits, ids, mask, advantages, old_logps, options=verl_options).loss
        loss = task.loss + coef * distill  # verl's distillation_ppo_loss with use_task_rewards

    Any estimator is allowed here, ``k1`` included (verl's recommendation for this form)."""
    check_choice("estimator", estimator, REVERSE_KL_ESTIMATORS)
    check_like_mask("student_logps", student_logps, completion_mask)
    check_like_mask("teacher_logps", teacher_logps, completion_mask)
    student, teacher = student_logps.detach().float(), teacher_logps.detach().float()
    active = completion_mask != 0
    teacher = torch.where(active, teacher, student)  # a masked token's teacher value is never read
    estimate = reverse_kl_estimate(student, teacher, estimator)
    if loss_max_clamp is not None:
        estimate = estimate.clamp(min=-loss_max_clamp, max=loss_max_clamp)
    return torch.where(active, -estimate, 0.0)


def reverse_kl_estimate(student: torch.Tensor, teacher: torch.Tensor, estimator: str) -> torch.Tensor:
    """verl's ``kl_penalty`` of the student's (``student``) and the teacher's log-probs, per token: "kl" / "k1"
    log q - log p, "abs" its magnitude, "mse" / "k2" half its square, "low_var_kl" / "k3" exp(r) - r - 1 with
    r = log p - log q clamped to +-20, the estimate clamped to +-10."""
    if estimator in ("kl", "k1"):
        return student - teacher
    if estimator == "abs":
        return (student - teacher).abs()
    if estimator in ("mse", "k2"):
        return 0.5 * (student - teacher).square()
    r = (teacher - student).clamp(min=-20.0, max=20.0)
    return (torch.exp(r) - r - 1.0).clamp(min=-10.0, max=10.0)


# ---- The Modules -------------------------------------------------------------------------------------------------


class TopKDistillationLoss(torch.nn.Module):
    """``topk_distillation_loss`` as a Module: the convention and its settings (every keyword of the function but the
    tensors) held, ``forward(logits, teacher_ids, teacher_logps, completion_mask)`` and per-call keywords
    (``cu_seqlens``, ...)."""

    def __init__(self, temperature: float = 1.0, **settings):
        super().__init__()
        self.temperature, self.settings = temperature, settings

    def forward(self, logits, teacher_ids, teacher_logps, completion_mask, **call) -> DistillationOutput:
        return topk_distillation_loss(
            logits, teacher_ids, teacher_logps, completion_mask, self.temperature, **(self.settings | call)
        )


class FusedLinearTopKDistillationLoss(torch.nn.Module):
    """``fused_linear_topk_distillation_loss`` as a Module: ``forward(hidden_states, weight, teacher_ids,
    teacher_logps, completion_mask, bias=None)``, the [N, V] logits never held."""

    def __init__(self, temperature: float = 1.0, **settings):
        super().__init__()
        self.temperature, self.settings = temperature, settings

    def forward(self, hidden_states, weight, teacher_ids, teacher_logps, completion_mask, bias=None, **call):
        return fused_linear_topk_distillation_loss(
            hidden_states, weight, teacher_ids, teacher_logps, completion_mask, bias, self.temperature,
            **(self.settings | call),
        )  # fmt: skip
