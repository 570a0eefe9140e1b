"""On-policy distillation (``grpo_kernels.distillation``) number for number with verl 0.9.1's own distillation code
(``verl/trainer/distillation``: the FSDP ``compute_forward_kl_topk``, its registered loss, ``distillation_loss``)
and TRL 1.16's (``add_tail_bucket``, ``compute_topk_self_distillation_loss``): the loss, the gradient of the logits
(and of the hidden states, weight and bias through the fused head) and every metric, both backends, padded and
packed, a vocabulary split over two processes; the teacher's ids repeated, covering the whole vocabulary, K = 1;
an all-padding batch; bad teacher inputs refused by name.
"""

import pytest
import torch
from gloo_ranks import run_ranks

pytest.importorskip("verl")
pytest.importorskip("trl")

from tensordict import TensorDict  # noqa: E402
from trl.experimental.sdpo.loss_utils import add_tail_bucket, compute_topk_self_distillation_loss  # noqa: E402
from verl.trainer.distillation import losses as verl_losses  # noqa: E402
from verl.trainer.distillation.fsdp import losses as verl_fsdp  # noqa: E402
from verl.trainer.ppo.core_algos import agg_loss  # noqa: E402
from verl.workers.config import ActorConfig, DistillationConfig, DistillationLossConfig  # noqa: E402

from grpo_kernels import distillation  # noqa: E402
from grpo_kernels.distillation import (  # noqa: E402
    fused_linear_topk_distillation_loss,
    topk_distillation_loss,
)

B, T, V, K, H = 3, 6, 41, 5, 12
TEMPERATURE = 0.8
FP32 = dict(atol=2e-6, rtol=2e-5)


def _batch(seed=0, k=K, repeat=True):
    """Student logits, a teacher's top-k (ids and log-probs from its own log-softmax; one token's first id
    repeated), a mask with a partial row and an empty one."""
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(B, T, V, generator=g)
    teacher = torch.log_softmax(2 * torch.randn(B, T, V, generator=g), -1)
    logps, ids = teacher.topk(k, dim=-1)
    if repeat and k > 1:
        ids[0, 1, 1], logps[0, 1, 1] = ids[0, 1, 0], logps[0, 1, 0]
    mask = torch.ones(B, T)
    mask[1, 4:] = 0
    mask[2] = 0
    return logits, ids, logps, mask


def _verl_per_token(logits, ids, logps, mask, **loss_kw):
    """verl's FSDP ``compute_forward_kl_topk`` on the active tokens, packed as verl packs them ("thd": one row of
    nnz tokens, the teacher's top-k as nested tensors), its student logits already divided by the temperature as its
    engine divides them: per-token outputs [B, T] (0 at masked tokens)."""
    active = mask.bool()
    student = (logits / TEMPERATURE)[active].unsqueeze(0)
    rows = [(ids[b][active[b]], logps[b][active[b]]) for b in range(B) if active[b].any()]
    config = DistillationConfig(distillation_loss=DistillationLossConfig(topk=ids.shape[-1], **loss_kw))
    out = verl_fsdp.compute_forward_kl_topk(
        student_logits=student,
        teacher_topk_log_probs=torch.nested.nested_tensor([r[1] for r in rows], layout=torch.jagged),
        teacher_topk_ids=torch.nested.nested_tensor([r[0] for r in rows], layout=torch.jagged),
        config=config,
        data_format="thd",
    )
    padded = {}
    for name, value in out.items():
        full = torch.zeros(B, T, dtype=value.dtype)
        full[active] = value[0].detach()
        padded[name] = full
    return padded, out["distillation_losses"], student  # (the last two with their graph)


def _verl_loss_and_metrics(per_token, mask, loss_agg_mode="token-mean", loss_mode="forward_kl_topk", **loss_kw):
    """verl's registered ``forward_kl_topk`` and ``distillation_loss`` (supervised) on verl's per-token outputs,
    through its own padding helpers: a TensorDict of prompts (one token each), responses and masks."""
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode=loss_agg_mode)
    config = DistillationConfig(  # (not "enabled": that would ask for teacher models; the loss reads none)
        distillation_loss=DistillationLossConfig(loss_mode=loss_mode, topk=K, use_policy_gradient=False, **loss_kw),
    )
    lengths = mask.sum(1).long()
    keep = lengths > 0  # verl's batches hold sequences with a response
    prompts = torch.ones(int(keep.sum()), 1, dtype=torch.long)
    responses = torch.ones(int(keep.sum()), T, dtype=torch.long)
    attention = torch.cat([torch.ones(int(keep.sum()), 1), mask[keep]], 1).long()

    def unpadded(t):  # each sequence's prompt token then its response, shifted left by one as the model's output
        parts = []
        for b in keep.nonzero().squeeze(1).tolist():
            parts += [t[b, : lengths[b]], torch.zeros(1, dtype=t.dtype)]
        return torch.cat(parts)

    model_output = {name: unpadded(v) for name, v in per_token.items()}
    data = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "attention_mask": attention,
            "response_mask": mask[keep],
        },
        batch_size=[int(keep.sum())],
    )
    for name, value in (("dp_size", 1), ("batch_num_tokens", int(mask.sum())), ("global_batch_size", int(keep.sum()))):
        data.set_non_tensor(name, value)  # verl's global batch info
    return verl_losses.distillation_loss(actor, config, model_output, data)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "loss_agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_the_top_k_forward_kl_is_verls(backend, loss_agg_mode):
    """verl's forward_kl_topk (its clamps at -10 and 10, its masses, overlap and range metrics, its reduction): the
    loss, the gradient of the logits and every metric."""
    logits, ids, logps, mask = _batch()
    per_token, _, _ = _verl_per_token(logits.double(), ids, logps.double(), mask)
    expected, expected_metrics = _verl_loss_and_metrics(per_token, mask, loss_agg_mode)
    # the gradient: verl's own chain on its own logits (its per-token loss, its clamps, its agg_loss)
    x = logits.double().requires_grad_()
    _, losses_nnz, _ = _verl_per_token(x, ids, logps.double(), mask)
    losses = torch.zeros(B, T, dtype=torch.float64).masked_scatter(
        mask.bool(), losses_nnz[0].double().clamp_min(0.0).clamp(-10.0, 10.0)
    )
    agg_loss(loss_mat=losses, loss_mask=mask.double(), loss_agg_mode=loss_agg_mode, dp_size=1,
             batch_num_tokens=mask.sum(), global_batch_size=int((mask.sum(1) > 0).sum())).backward()  # fmt: skip
    y = logits.clone().requires_grad_()
    ours = topk_distillation_loss(y, ids, logps, mask, TEMPERATURE, backend=backend, loss_agg_mode=loss_agg_mode)
    ours.loss.backward()
    torch.testing.assert_close(ours.loss.double(), expected.double(), **FP32)
    torch.testing.assert_close(y.grad.double(), x.grad, atol=1e-6, rtol=1e-5)
    for name, value in expected_metrics.items():
        value = value.aggregate() if hasattr(value, "aggregate") else value  # (verl's Metric)
        torch.testing.assert_close(ours.metrics[name].double(), torch.as_tensor(value).double(), **FP32, msg=name)
    assert set(ours.metrics) >= set(expected_metrics) | {"distillation/loss"}


def test_the_clamps_per_token_are_verls():
    """Each active token's loss is verl's value, clamped at 0 and at +-loss_max_clamp, with and without
    log_prob_min_clamp (None: no clamp)."""
    logits, ids, logps, mask = _batch(seed=1)
    for clamp in (-10.0, -2.0, None):
        per_token, _, _ = _verl_per_token(logits.double(), ids, logps.double(), mask, log_prob_min_clamp=clamp)
        ours = topk_distillation_loss(
            logits, ids, logps, mask, TEMPERATURE, log_prob_min_clamp=clamp, loss_max_clamp=3.0
        )
        expected = per_token["distillation_losses"].double().clamp_min(0.0).clamp(max=3.0) * mask
        torch.testing.assert_close(ours.per_token_loss.double(), expected, **FP32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_fused_head_equals_its_logits(backend):
    """From hidden states and the head (no [N, V] logits): the loss, every metric (the overlap with
    compute_overlap) and the gradients of hidden states, weight and bias equal the logits path on h W^T + b."""
    _, ids, logps, mask = _batch(seed=2)
    g = torch.Generator().manual_seed(3)
    head = [torch.randn(B, T, H, generator=g), 0.5 * torch.randn(V, H, generator=g), torch.randn(V, generator=g)]
    wanted = [t.clone().double().requires_grad_() for t in head]
    expected = topk_distillation_loss(
        torch.nn.functional.linear(*wanted), ids, logps, mask, TEMPERATURE, backend="torch"
    )
    expected.loss.backward()
    ours_in = [t.clone().requires_grad_() for t in head]
    ours = fused_linear_topk_distillation_loss(
        ours_in[0], ours_in[1], ids, logps, mask, ours_in[2], TEMPERATURE, backend=backend, compute_overlap=True
    )
    ours.loss.backward()
    torch.testing.assert_close(ours.loss.double(), expected.loss, **FP32)
    for got, want in zip(ours_in, wanted, strict=True):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=1e-5, rtol=1e-4)
    for name, value in expected.metrics.items():
        torch.testing.assert_close(ours.metrics[name].double(), value.double(), **FP32, msg=name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_packed_batch_equals_the_padded_one(backend):
    logits, ids, logps, mask = _batch(seed=4)
    active = mask.bool()
    x, y = logits.clone().requires_grad_(), logits[active].clone().requires_grad_()
    padded = topk_distillation_loss(
        x, ids, logps, mask, TEMPERATURE, backend=backend, loss_agg_mode="seq-mean-token-mean"
    )
    lengths = mask.sum(1).long()
    cu = torch.nn.functional.pad(lengths[lengths > 0].cumsum(0), (1, 0)).int()
    packed = topk_distillation_loss(
        y, ids[active], logps[active], torch.ones(int(active.sum())), TEMPERATURE, backend=backend,
        loss_agg_mode="seq-mean-token-mean", cu_seqlens=cu,
    )  # fmt: skip
    padded.loss.backward()
    packed.loss.backward()
    torch.testing.assert_close(packed.loss, padded.loss, **FP32)
    torch.testing.assert_close(y.grad, x.grad[active], **FP32)
    torch.testing.assert_close(packed.per_token_loss, padded.per_token_loss[active], **FP32)


@pytest.mark.parametrize("add_tail", [True, False])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_trls_top_k_divergence_and_reduction(backend, add_tail, alpha):
    """TRL's compute_topk_self_distillation_loss (its support the student's own top-k, the teacher projected onto
    it; a tail bucket or renormalized; its generalized divergence) and its trainer's reduction: ours with those ids
    as the teacher's top-k and the teacher's log-probs there."""
    logits, _, _, mask = _batch(seed=5)
    teacher_logits = 2 * torch.randn(B, T, V, generator=torch.Generator().manual_seed(6))
    x = logits.double().requires_grad_()
    per_token = compute_topk_self_distillation_loss(
        x / TEMPERATURE, teacher_logits.double(), distillation_topk=K, distillation_alpha=alpha,
        distillation_add_tail=add_tail,
    )  # fmt: skip
    expected = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    expected.backward()
    ids = (logits / TEMPERATURE).topk(K, dim=-1).indices
    logps = torch.log_softmax(teacher_logits, -1).gather(-1, ids)
    y = logits.clone().requires_grad_()
    ours = topk_distillation_loss(
        y, ids, logps, mask, TEMPERATURE, convention="trl", add_tail=add_tail, alpha=alpha, backend=backend
    )
    ours.loss.backward()
    torch.testing.assert_close(ours.loss.double(), expected, **FP32)
    torch.testing.assert_close(y.grad.double(), x.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours.per_token_loss.double(), per_token.detach() * mask, **FP32)


def test_trls_tail_bucket():
    logps = torch.log_softmax(torch.randn(4, 9), -1).topk(3, -1).values
    torch.testing.assert_close(distillation._with_tail_bucket(logps), add_tail_bucket(logps))


def test_edge_teachers():
    """K = 1, the teacher's ids covering the whole vocabulary (the student's mass then 1), repeated ids (each
    repeat a term of its own, as verl's gather counts it), and an all-padding batch (a zero loss and gradient, no
    error)."""
    logits, ids, logps, mask = _batch(seed=7)
    for k_ids, k_logps in (
        (ids[..., :1], logps[..., :1]),
        (torch.arange(V).expand(B, T, V), torch.log_softmax(torch.randn(B, T, V), -1)),
        (ids[..., :1].expand(B, T, 3), logps[..., :1].expand(B, T, 3)),
    ):
        per_token, _, _ = _verl_per_token(logits.double(), k_ids, k_logps.double(), mask)
        for backend in ("torch", "triton"):
            x = logits.clone().requires_grad_()
            ours = topk_distillation_loss(x, k_ids, k_logps, mask, TEMPERATURE, backend=backend)
            expected = per_token["distillation_losses"].double().clamp_min(0.0).clamp(max=10.0) * mask
            torch.testing.assert_close(ours.per_token_loss.double(), expected, **FP32)
            y = logits.double().requires_grad_()
            reference = torch.log_softmax(y / TEMPERATURE, -1).gather(-1, k_ids).clamp_min(-10.0)
            lp = k_logps.double().clamp_min(-10.0)
            tok = (lp.exp() * (lp - reference)).sum(-1).clamp_min(0.0).clamp(max=10.0)
            ((tok * mask).sum() / mask.sum()).backward()
            ours.loss.backward()
            torch.testing.assert_close(x.grad.double(), y.grad, atol=1e-6, rtol=1e-5)
    x = logits.clone().requires_grad_()
    empty = topk_distillation_loss(x, ids, logps, torch.zeros(B, T), TEMPERATURE)
    empty.loss.backward()
    assert empty.loss.item() == 0.0 and torch.count_nonzero(x.grad) == 0


def test_bad_teacher_inputs_are_refused_by_name():
    logits, ids, logps, mask = _batch()
    cases = [
        (dict(teacher_ids=ids.float()), TypeError, "teacher_ids must be an integer tensor"),
        (dict(teacher_logps=ids), TypeError, "teacher_logps must be a floating-point tensor"),
        (dict(teacher_ids=ids[:, :-1], teacher_logps=logps[:, :-1]), ValueError, "the completion mask's shape"),
        (dict(teacher_logps=logps[..., :2]), ValueError, "teacher_ids and teacher_logps must have one shape"),
        (dict(teacher_ids=ids.clone().fill_(V)), ValueError, rf"teacher_ids must lie in \[0, V\) = \[0, {V}\)"),
        (dict(teacher_logps=logps.clone().fill_(float("nan"))), ValueError, "teacher_logps must be finite"),
        (dict(convention="slime"), ValueError, "convention must be one of"),
        (dict(convention="trl", loss_agg_mode="token-mean"), ValueError, "loss_agg_mode is verl's reduction"),
        (dict(loss_agg_mode="mean"), ValueError, "loss_agg_mode must be one of"),
    ]
    with pytest.raises(ValueError, match="estimator='k1' as a supervised loss"):
        distillation.reverse_kl_distillation_loss(logits, ids[..., 0], logps[..., 0], mask, estimator="k1")
    for change, error, match in cases:
        call = dict(teacher_ids=ids, teacher_logps=logps) | change
        with pytest.raises(error, match=match):
            topk_distillation_loss(logits, completion_mask=mask, temperature=TEMPERATURE, **call)
    wide = torch.zeros(B, T, V + 1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"the teacher's K .* must be in \[1, V\]"):
        topk_distillation_loss(logits, wide, wide.float(), mask)
    masked_garbage = ids.clone()
    masked_garbage[2] = -7  # row 2 is masked: never read
    topk_distillation_loss(logits, masked_garbage, logps, mask)


def _garbage_at_masked(ids, logps, mask):
    """The teacher's ids and log-probs with what a padded batch may hold at its masked tokens: ids outside [0, V) on
    either side (the first id too: the pass's target), NaN and infinite log-probs."""
    masked = (mask == 0).unsqueeze(-1).expand_as(ids)
    fill = torch.tensor([V + 7, -100, V, 2**40])[torch.arange(ids.numel()) % 4].view(ids.shape)
    junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.0])[torch.arange(ids.numel()) % 4]
    return torch.where(masked, fill, ids), torch.where(masked, junk.view(ids.shape), logps)


@pytest.mark.parametrize("form", ["logits", "hidden_states", "packed_hidden_states"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_any_id_at_a_masked_token_changes_nothing(backend, form):
    """A masked token's teacher ids and log-probs may be anything (the documented contract): the loss, the metrics and
    every gradient equal the call with in-range ids there, on both backends and each input form. (The fused head on
    the torch backend raised an index error on an id >= V.)"""
    _, ids, logps, mask = _batch(seed=6)
    bad_ids, bad_logps = _garbage_at_masked(ids, logps, mask)
    g = torch.Generator().manual_seed(7)
    head = [torch.randn(B, T, H, generator=g), 0.5 * torch.randn(V, H, generator=g), torch.randn(V, generator=g)]

    def run(teacher_ids, teacher_logps):
        leaves = [t.clone().requires_grad_() for t in head]
        if form == "logits":
            logits = torch.nn.functional.linear(*leaves)
            out = topk_distillation_loss(logits, teacher_ids, teacher_logps, mask, TEMPERATURE, backend=backend)
        elif form == "hidden_states":
            out = fused_linear_topk_distillation_loss(
                leaves[0], leaves[1], teacher_ids, teacher_logps, mask, leaves[2], TEMPERATURE, backend=backend
            )
        else:  # each row a sequence of T tokens, its padding inside the packed batch
            cu = torch.arange(0, B * T + 1, T, dtype=torch.int32)
            out = fused_linear_topk_distillation_loss(
                leaves[0].reshape(B * T, H), leaves[1], teacher_ids.reshape(B * T, K), teacher_logps.reshape(B * T, K),
                mask.reshape(-1), leaves[2], TEMPERATURE, backend=backend, cu_seqlens=cu,
                loss_agg_mode="seq-mean-token-mean",
            )  # fmt: skip
        out.loss.backward()
        return out, [t.grad for t in leaves]

    expected, expected_grads = run(ids, logps)
    ours, grads = run(bad_ids, bad_logps)
    torch.testing.assert_close(ours.loss, expected.loss, atol=0, rtol=0)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    for name, value in expected.metrics.items():
        torch.testing.assert_close(ours.metrics[name], value, atol=0, rtol=0, equal_nan=True, msg=name)


def _rank_split(rank: int, world: int, backend: str):
    import torch.distributed as dist

    logits, ids, logps, mask = _batch(seed=8)
    ids, logps = _garbage_at_masked(ids, logps, mask)  # the whole-vocabulary oracle has in-range ids there
    part = V // world + 1
    start, stop = rank * part, min((rank + 1) * part, V)
    x = logits[..., start:stop].clone().requires_grad_()
    out = topk_distillation_loss(
        x, ids, logps, mask, TEMPERATURE, backend=backend, vocab_parallel_group=dist.group.WORLD,
        vocab_start_index=start,
    )  # fmt: skip
    out.loss.backward()
    g = torch.Generator().manual_seed(9)
    head = [torch.randn(B, T, H, generator=g), 0.5 * torch.randn(V, H, generator=g), torch.randn(V, generator=g)]
    h = head[0].clone().requires_grad_()
    w, b = head[1][start:stop].clone().requires_grad_(), head[2][start:stop].clone().requires_grad_()
    fused = fused_linear_topk_distillation_loss(
        h, w, ids, logps, mask, b, TEMPERATURE, backend=backend, vocab_parallel_group=dist.group.WORLD,
        vocab_start_index=start, compute_overlap=True,
    )  # fmt: skip
    fused.loss.backward()
    reverse_ids, reverse_teacher = _reverse_kl_batch()
    y = logits[..., start:stop].clone().requires_grad_()
    reverse = distillation.reverse_kl_distillation_loss(
        y, reverse_ids, reverse_teacher, mask, TEMPERATURE, backend=backend, vocab_parallel_group=dist.group.WORLD,
        vocab_start_index=start,
    )  # fmt: skip
    reverse.loss.backward()
    return dict(
        loss=out.loss.detach(), grad=x.grad, metrics={k: v.detach() for k, v in out.metrics.items()},
        head_loss=fused.loss.detach(), d_hidden=h.grad, d_weight=w.grad, d_bias=b.grad, rows=(start, stop),
        head_metrics={k: v.detach() for k, v in fused.metrics.items()},
        reverse_loss=reverse.loss.detach(), reverse_per_token=reverse.per_token_loss.detach(), reverse_grad=y.grad,
    )  # fmt: skip


def _reverse_kl_batch():
    """Sampled ids (global) and a teacher's log-probs for the reverse-KL estimators."""
    g = torch.Generator().manual_seed(16)
    return torch.randint(0, V, (B, T), generator=g), -torch.rand(B, T, generator=g) * 5


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_packed_seq_mean_token_sum_norm_takes_verls_divisor(backend):
    """verl's seq-mean-token-sum-norm divides by its loss_scale_factor, else the padded response width. A packed batch
    has no padded width: with ``loss_scale_factor`` = the width its batch was padded to, the packed top-k and reverse-KL
    losses equal verl's ``agg_loss`` on that padded batch (lengths 20, 15, 7 and 0 in a width of 24: by default, the
    longest sequence, 20, the loss was 1.2x verl's)."""
    lengths, width = torch.tensor([20, 15, 7, 0]), 24
    rows = len(lengths)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    g = torch.Generator().manual_seed(12)
    logits = 2 * torch.randn(rows, width, V, generator=g)
    logps, ids = torch.log_softmax(2 * torch.randn(rows, width, V, generator=g), -1).topk(K, dim=-1)
    sampled, teacher = torch.randint(0, V, (rows, width), generator=g), -5 * torch.rand(rows, width, generator=g)
    active = mask.bool()
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()
    mode = dict(loss_agg_mode="seq-mean-token-sum-norm", backend=backend)
    padded = topk_distillation_loss(logits, ids, logps, mask, TEMPERATURE, **mode)
    verl_expected = agg_loss(
        loss_mat=padded.per_token_loss, loss_mask=mask, loss_agg_mode="seq-mean-token-sum-norm", dp_size=1,
        global_batch_size=int((lengths > 0).sum()),
    )  # fmt: skip
    torch.testing.assert_close(padded.loss, verl_expected, **FP32)
    packed_args = (logits[active], ids[active], logps[active], torch.ones(int(mask.sum())), TEMPERATURE)
    packed = topk_distillation_loss(*packed_args, cu_seqlens=cu, loss_scale_factor=width, **mode)
    torch.testing.assert_close(packed.loss, verl_expected, **FP32)
    longest = topk_distillation_loss(*packed_args, cu_seqlens=cu, **mode)  # the documented default
    torch.testing.assert_close(longest.loss, verl_expected * width / 20, **FP32)
    reverse = distillation.reverse_kl_distillation_loss(logits, sampled, teacher, mask, TEMPERATURE, **mode)
    reverse_expected = agg_loss(
        loss_mat=reverse.per_token_loss, loss_mask=mask, loss_agg_mode="seq-mean-token-sum-norm", dp_size=1,
        global_batch_size=int((lengths > 0).sum()),
    )  # fmt: skip
    torch.testing.assert_close(reverse.loss, reverse_expected, **FP32)
    reverse_packed = distillation.reverse_kl_distillation_loss(
        logits[active], sampled[active], teacher[active], torch.ones(int(mask.sum())), TEMPERATURE, cu_seqlens=cu,
        loss_scale_factor=width, **mode,
    )  # fmt: skip
    torch.testing.assert_close(reverse_packed.loss, reverse_expected, **FP32)
    with pytest.raises(TypeError, match="loss_scale_factor"):
        topk_distillation_loss(*packed_args, cu_seqlens=cu, loss_scale_factor="24", **mode)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        topk_distillation_loss(*packed_args, convention="trl", loss_scale_factor=width, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_vocabulary_split_over_two_processes_equals_one(backend):
    logits, ids, logps, mask = _batch(seed=8)
    x = logits.clone().requires_grad_()
    whole = topk_distillation_loss(x, ids, logps, mask, TEMPERATURE, backend="torch")
    whole.loss.backward()
    g = torch.Generator().manual_seed(9)
    head = [torch.randn(B, T, H, generator=g), 0.5 * torch.randn(V, H, generator=g), torch.randn(V, generator=g)]
    head = [t.clone().requires_grad_() for t in head]
    fused = fused_linear_topk_distillation_loss(
        head[0], head[1], ids, logps, mask, head[2], TEMPERATURE, backend="torch", compute_overlap=True
    )
    fused.loss.backward()
    reverse_ids, reverse_teacher = _reverse_kl_batch()
    y = logits.clone().requires_grad_()
    reverse = distillation.reverse_kl_distillation_loss(y, reverse_ids, reverse_teacher, mask, TEMPERATURE)
    reverse.loss.backward()
    for r in run_ranks(_rank_split, 2, backend, timeout=600):
        start, stop = r["rows"]
        torch.testing.assert_close(r["loss"], whole.loss.detach(), **FP32)
        torch.testing.assert_close(r["grad"], x.grad[..., start:stop], atol=1e-6, rtol=1e-5)
        for name, value in whole.metrics.items():
            torch.testing.assert_close(r["metrics"][name], value.detach(), **FP32, msg=name)
        torch.testing.assert_close(r["head_loss"], fused.loss.detach(), **FP32)
        torch.testing.assert_close(r["d_hidden"], head[0].grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(r["d_weight"], head[1].grad[start:stop], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(r["d_bias"], head[2].grad[start:stop], atol=1e-5, rtol=1e-4)
        for name, value in fused.metrics.items():
            torch.testing.assert_close(r["head_metrics"][name], value.detach(), **FP32, msg=name)
        torch.testing.assert_close(r["reverse_loss"], reverse.loss.detach(), **FP32)
        torch.testing.assert_close(r["reverse_per_token"], reverse.per_token_loss.detach(), **FP32)
        torch.testing.assert_close(r["reverse_grad"], y.grad[..., start:stop], atol=1e-6, rtol=1e-5)


def _verl_reverse_kl(student_logps, teacher_logps, mask, estimator, loss_agg_mode):
    """verl's registered estimator loss and ``distillation_loss`` (supervised) on the student's log-probs, through
    its own padding helpers (prompts of one token)."""
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode=loss_agg_mode)
    config = DistillationConfig(
        distillation_loss=DistillationLossConfig(loss_mode=estimator, use_policy_gradient=False, topk=None)
    )
    model_output, data = _verl_batch(student_logps, mask, teacher_logps)
    return verl_losses.distillation_loss(actor, config, model_output, data)


@pytest.mark.parametrize("estimator", [e for e in distillation.REVERSE_KL_ESTIMATORS if e != "k1"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_reverse_kl_estimators_are_verls(backend, estimator):
    """verl's single-sample estimators as a supervised loss (its kl_penalty, clamps, abs_loss and range metrics,
    loss_max_clamp, agg_loss), on the student's log-probs of the sampled tokens: loss, gradient, metrics."""
    logits, _, _, mask = _batch(seed=10)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, V, (B, T), generator=g)
    lp = torch.log_softmax(logits.double() / TEMPERATURE, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    teacher = (lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 3).float()  # some beyond k3's clamps
    for agg in ("token-mean", "seq-mean-token-sum"):
        x = logits.double().requires_grad_()
        student = torch.log_softmax(x / TEMPERATURE, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        expected, expected_metrics = _verl_reverse_kl(student, teacher.double(), mask, estimator, agg)
        expected.backward()
        y = logits.clone().requires_grad_()
        ours = distillation.reverse_kl_distillation_loss(
            y, ids, teacher, mask, TEMPERATURE, estimator=estimator, loss_agg_mode=agg, backend=backend
        )
        ours.loss.backward()
        torch.testing.assert_close(ours.loss.double(), expected.double(), **FP32)
        torch.testing.assert_close(y.grad.double(), x.grad, atol=1e-6, rtol=1e-5)
        for name, value in expected_metrics.items():
            value = value.aggregate() if hasattr(value, "aggregate") else value
            torch.testing.assert_close(ours.metrics[name].double(), torch.as_tensor(value).double(), **FP32, msg=name)


@pytest.mark.parametrize("use_task_rewards", [True, False])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_policy_gradient_form_with_the_task_loss_is_verls_distillation_ppo_loss(backend, use_task_rewards):
    """verl's ``distillation_ppo_loss`` with ``use_policy_gradient`` (its vanilla PPO loss on the advantage minus the
    detached k1 estimate, clamped to +-loss_max_clamp), plus the task's PPO loss times 1 and the distillation's times
    ``distillation_loss_coef`` (``use_task_rewards``; without it the distillation's alone, coefficient 1): the recipe
    of ``reverse_kl_advantages`` (the student's detached log-probs, the advantage, ``grpo_loss`` with the verl preset)
    gives its loss and its gradient of the logits."""
    from grpo_kernels import GRPOOptions, grpo_loss, token_logprobs

    logits, _, _, mask = _batch(seed=17)
    g = torch.Generator().manual_seed(18)
    ids = torch.randint(0, V, (B, T), generator=g)
    lp = torch.log_softmax(logits.double() / TEMPERATURE, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    teacher = (lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 8).float()  # some beyond loss_max_clamp
    old = (lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    task_advantages = torch.randn(B, T, generator=g)
    coef = 0.3
    # verl's own, on the student's log-probs from the logits in float64
    x = logits.double().requires_grad_()
    student = torch.log_softmax(x / TEMPERATURE, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode="token-mean")
    config = DistillationConfig(
        distillation_loss=DistillationLossConfig(
            loss_mode="k1", use_policy_gradient=True, use_task_rewards=use_task_rewards, distillation_loss_coef=coef,
            topk=None,
        )
    )  # fmt: skip
    model_output, data = _verl_batch(student, mask, teacher.double(), old_log_probs=old.double(),
                                     advantages=task_advantages.double())  # fmt: skip
    expected, _ = verl_losses.distillation_ppo_loss(actor, config, model_output, data)
    expected.backward()
    # ours: the estimate's pass, then grpo_loss with verl's preset for the task and the distillation's advantage
    y = logits.clone().requires_grad_()
    options = GRPOOptions.from_preset("verl", temperature=TEMPERATURE)
    with torch.no_grad():
        student_logps = token_logprobs(y, ids, TEMPERATURE, backend=backend)
    advantages = distillation.reverse_kl_advantages(student_logps, teacher, mask)  # (k1, clamped at 10)
    distill = grpo_loss(y, ids, mask, advantages, old, options=options, backend=backend).loss
    ours = grpo_loss(y, ids, mask, task_advantages, old, options=options, backend=backend).loss + coef * distill
    if not use_task_rewards:
        ours = distill
    ours.backward()
    torch.testing.assert_close(ours.double(), expected, **FP32)
    torch.testing.assert_close(y.grad.double(), x.grad, atol=1e-6, rtol=1e-5)


def test_reverse_kl_advantages_refuse_bad_inputs_by_name():
    mask = torch.ones(B, T)
    good = -torch.rand(B, T)
    with pytest.raises(ValueError, match=r"teacher_logps must have the completion mask's shape"):
        distillation.reverse_kl_advantages(good, good[:, :-1], mask)
    with pytest.raises(TypeError, match=r"student_logps must be a floating-point tensor"):
        distillation.reverse_kl_advantages(good.long(), good, mask)
    with pytest.raises(ValueError, match=r"estimator"):
        distillation.reverse_kl_advantages(good, good, mask, estimator="k4")
    mask[1] = 0  # an all-padding row: zero advantages, whatever its teacher values
    bad_teacher = good.clone()
    bad_teacher[1] = float("nan")
    out = distillation.reverse_kl_advantages(good, bad_teacher, mask)
    assert out[1].eq(0).all() and out.isfinite().all()


def _verl_batch(student_logps, mask, teacher_logps, **per_token):
    """verl's model output and micro-batch for its distillation losses (prompts of one token, the sequences with a
    response), ``per_token`` [B, T] fields (old_log_probs, advantages) padded as its data holds them."""
    lengths = mask.sum(1).long()
    keep = lengths > 0
    rows = keep.nonzero().squeeze(1).tolist()

    def unpadded(t):
        parts = []
        for b in rows:
            parts += [t[b, : lengths[b]], torch.zeros(1, *t.shape[2:], dtype=t.dtype)]
        return torch.cat(parts)

    data = TensorDict(
        {
            "prompts": torch.ones(len(rows), 1, dtype=torch.long),
            "responses": torch.ones(len(rows), T, dtype=torch.long),
            "attention_mask": torch.cat([torch.ones(len(rows), 1), mask[keep]], 1).long(),
            "response_mask": mask[keep],
            "teacher_logprobs": torch.nested.nested_tensor(
                [
                    torch.cat([teacher_logps[b, : lengths[b]], torch.zeros(1, dtype=teacher_logps.dtype)]).unsqueeze(-1)
                    for b in rows
                ],
                layout=torch.jagged,
            ),  # fmt: skip
            **{name: value[keep] for name, value in per_token.items()},
        },
        batch_size=[len(rows)],
    )
    for name, value in (("dp_size", 1), ("batch_num_tokens", int(mask.sum())), ("global_batch_size", len(rows))):
        data.set_non_tensor(name, value)
    return {"log_probs": unpadded(student_logps)}, data


def test_the_reverse_kl_from_hidden_states_packed_equals_the_logits():
    _, _, _, mask = _batch(seed=12)
    g = torch.Generator().manual_seed(13)
    head = [torch.randn(B, T, H, generator=g), 0.5 * torch.randn(V, H, generator=g), torch.randn(V, generator=g)]
    ids = torch.randint(0, V, (B, T), generator=g)
    teacher = -torch.rand(B, T, generator=g) * 4
    x = [t.clone().requires_grad_() for t in head]
    expected = distillation.reverse_kl_distillation_loss(
        torch.nn.functional.linear(*x), ids, teacher, mask, TEMPERATURE, backend="torch"
    )
    expected.loss.backward()
    active = mask.bool()
    lengths = mask.sum(1).long()
    cu = torch.nn.functional.pad(lengths[lengths > 0].cumsum(0), (1, 0)).int()
    y = [head[0][active].clone().requires_grad_(), head[1].clone().requires_grad_(), head[2].clone().requires_grad_()]
    ours = distillation.reverse_kl_distillation_loss(
        y[0], ids[active], teacher[active], torch.ones(int(active.sum())), TEMPERATURE, weight=y[1], bias=y[2],
        cu_seqlens=cu, backend="triton",
    )  # fmt: skip
    ours.loss.backward()
    torch.testing.assert_close(ours.loss, expected.loss, **FP32)
    torch.testing.assert_close(ours.per_token_loss, expected.per_token_loss[active], **FP32)
    torch.testing.assert_close(y[0].grad, x[0].grad[active], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(y[1].grad, x[1].grad, atol=1e-5, rtol=1e-4)


def test_the_modules_are_the_functions():
    from grpo_kernels import FusedLinearTopKDistillationLoss, TopKDistillationLoss

    logits, ids, logps, mask = _batch(seed=14)
    module = TopKDistillationLoss(TEMPERATURE, convention="trl", add_tail=False)
    expected = topk_distillation_loss(logits, ids, logps, mask, TEMPERATURE, convention="trl", add_tail=False)
    torch.testing.assert_close(module(logits, ids, logps, mask).loss, expected.loss)
    g = torch.Generator().manual_seed(15)
    hidden, weight = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g)
    fused = FusedLinearTopKDistillationLoss(TEMPERATURE, loss_agg_mode="seq-mean-token-sum")(
        hidden, weight, ids, logps, mask
    )
    expected = topk_distillation_loss(
        hidden @ weight.T, ids, logps, mask, TEMPERATURE, loss_agg_mode="seq-mean-token-sum"
    )
    torch.testing.assert_close(fused.loss, expected.loss, **FP32)


def test_the_verl_adapter_serves_verls_top_k_logits_processor_and_registry(monkeypatch):
    """With the verl adapter, verl's FSDP top-k logits processor runs our pass (its outputs and the logits'
    gradient equal verl's own), and "grpo_kernels_forward_kl_topk" in verl's distillation registry gives verl's
    registered forward_kl_topk's losses and metrics."""
    from grpo_kernels.integration import verl as adapter

    logits, ids, logps, mask = _batch(seed=16)
    active = mask.bool()
    rows = [b for b in range(B) if active[b].any()]
    nested = lambda t: torch.nested.nested_tensor([t[b][active[b]] for b in rows], layout=torch.jagged)  # noqa: E731
    config = DistillationConfig(distillation_loss=DistillationLossConfig(topk=K))
    outputs = {}
    for name, fn in (("verl", verl_fsdp.compute_forward_kl_topk), ("ours", adapter.compute_forward_kl_topk)):
        x = (logits / TEMPERATURE)[active].unsqueeze(0).requires_grad_()
        out = fn(x, nested(logps), nested(ids), config, "thd")
        (out["distillation_losses"] * torch.linspace(0.5, 1.5, x.shape[1])).sum().backward()
        outputs[name] = ({k: v.detach() for k, v in out.items()}, x.grad)
    for key, value in outputs["verl"][0].items():
        torch.testing.assert_close(outputs["ours"][0][key].to(value.dtype), value, **FP32, msg=key)
    torch.testing.assert_close(outputs["ours"][1], outputs["verl"][1], atol=1e-6, rtol=1e-5)
    monkeypatch.setattr(verl_fsdp, "compute_forward_kl_topk", verl_fsdp.compute_forward_kl_topk)
    adapter.patch_distillation()
    assert verl_fsdp.compute_forward_kl_topk is adapter.compute_forward_kl_topk
    adapter.register()
    per_token, _, _ = _verl_per_token(logits.double(), ids, logps.double(), mask)
    expected, expected_metrics = _verl_loss_and_metrics(per_token, mask)
    actual, metrics = _verl_loss_and_metrics(per_token, mask, loss_mode="grpo_kernels_forward_kl_topk")
    torch.testing.assert_close(actual, expected)
    for name, value in expected_metrics.items():
        got, want = (v.aggregate() if hasattr(v, "aggregate") else v for v in (metrics[name], value))
        torch.testing.assert_close(torch.as_tensor(got).double(), torch.as_tensor(want).double(), msg=name)
