"""The vocabulary-parallel loss on 2 and 4 gloo processes against the unsharded loss in one process.

Each rank holds a contiguous slice of the vocabulary's logits; the ids are global. On every rank
the loss, the per-token log-probs and the metrics must equal the unsharded ones, and the rank's
gradient must be its slice of the unsharded gradient. The exchange is O(B * T) values: the count
of all-reduced elements does not change with V.
"""

import pytest
import torch
from gloo_ranks import run_ranks
from helpers import LOSS_TYPE_REGISTRY, TRL_LOSS_TYPES

from grpo_kernels import grpo_loss

B, T = 3, 5
TOL = dict(atol=2e-6, rtol=1e-5)
CASES = [
    dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        temperature=0.9,
        **({"max_completion_length": 8} if loss_type == "dr_grpo" else {}),
        **({"epsilon_high": 1.2} if loss_type == "cispo" else {}),
    )
    for loss_type in TRL_LOSS_TYPES + ("gmpo",)  # one of the families: their loss math is the torch path's
    for level, beta in (("token", 0.04), ("sequence", 0.0))
    if level in LOSS_TYPE_REGISTRY[loss_type].levels
]
CASES += [dict(beta=0.04, entropy_coef=0.1, top_entropy_quantile=0.6, off_policy_mask_threshold=0.05)]
CASES += [dict(beta=0.04, entropy_coef=0.1, logit_scale=0.5, logit_softcap=1.5)]  # a head's raw outputs, capped


def _batch(V: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T)
    mask[0, 3:] = 0
    mask[2] = 0  # a fully masked row
    logits, ids = 2 * torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g)
    # old and reference log-probs near the current ones: ratios on both sides of the clip range, VESPO's weight alive
    lp = torch.log_softmax(logits / 0.9, -1).gather(-1, ids.unsqueeze(-1))[..., 0]
    return dict(
        logits=logits,
        completion_ids=ids,
        completion_mask=mask,
        advantages=torch.randn(B, generator=g),
        old_logps=lp + 0.2 * torch.randn(B, T, generator=g),
        ref_logps=lp + 0.2 * torch.randn(B, T, generator=g),
    )


def _run(batch, logits, **kwargs):
    leaf = logits.detach().clone().requires_grad_()
    out = grpo_loss(leaf, **{k: v for k, v in batch.items() if k != "logits"}, **kwargs)
    out.loss.backward()
    return out.loss.detach(), out.per_token_logps, {k: v.detach() for k, v in out.metrics.items()}, leaf.grad


def _rank_cases(rank: int, world: int, backend: str, V: int):
    import torch.distributed as dist

    batch, part = _batch(V), V // world
    mine = batch["logits"][..., rank * part : (rank + 1) * part]
    return [_run(batch, mine, backend=backend, vocab_parallel_group=dist.group.WORLD, **case) for case in CASES]


@pytest.mark.parametrize("world, backend", [(2, "torch"), (2, "triton"), (4, "torch")])
def test_sharded_vocabulary_equals_the_unsharded_loss(world, backend):
    V = 4 * 37
    per_rank = run_ranks(_rank_cases, world, backend, V, timeout=600)
    batch = _batch(V)
    for i, case in enumerate(CASES):
        loss, logps, metrics, grad = _run(batch, batch["logits"], backend=backend, **case)
        for rank, results in enumerate(per_rank):
            r_loss, r_logps, r_metrics, r_grad = results[i]
            where = f"case {case}, rank {rank}"
            torch.testing.assert_close(r_loss, loss, **TOL, msg=lambda m, where=where: f"{where}: loss\n{m}")
            active = batch["completion_mask"] != 0
            torch.testing.assert_close(
                r_logps[active], logps[active], **TOL, msg=lambda m, where=where: f"{where}: logps\n{m}"
            )
            assert set(r_metrics) == set(metrics), where
            for name in metrics:
                torch.testing.assert_close(
                    r_metrics[name], metrics[name], **TOL, msg=lambda m, where=where, name=name: f"{where}: {name}\n{m}"
                )
            part = V // world
            torch.testing.assert_close(
                r_grad,
                grad[..., rank * part : (rank + 1) * part],
                **TOL,
                msg=lambda m, where=where: f"{where}: gradient slice\n{m}",
            )


def _rank_all_reduced_elements(rank: int, world: int, V: int):
    import torch.distributed as dist

    counted = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        counted.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        batch, part = _batch(V), V // world
        _run(
            batch,
            batch["logits"][..., rank * part : (rank + 1) * part],
            backend="torch",
            vocab_parallel_group=dist.group.WORLD,
            beta=0.04,
        )
    finally:
        dist.all_reduce = original
    return sum(counted)


def test_the_exchange_does_not_grow_with_the_vocabulary():
    small, large = (run_ranks(_rank_all_reduced_elements, 2, V, timeout=300)[0] for V in (64, 1024))
    assert small == large and small <= 4 * B * T + 1  # max, then (W, target logit, entropy sum) per token, and V


def _rank_uneven(rank: int, world: int):
    import torch.distributed as dist

    V, cut = 90, 61  # rank 0 holds ids [0, 61), rank 1 [61, 90): not Megatron's equal partitions
    batch = _batch(V, seed=2)
    start, stop = (0, cut) if rank == 0 else (cut, V)
    return _run(
        batch,
        batch["logits"][..., start:stop],
        backend="torch",
        vocab_parallel_group=dist.group.WORLD,
        vocab_start_index=start,
        beta=0.04,
        entropy_coef=0.1,
    )


def test_an_explicit_vocab_start_index():
    per_rank = run_ranks(_rank_uneven, 2, timeout=300)
    batch = _batch(90, seed=2)
    loss, _, _, grad = _run(batch, batch["logits"], backend="torch", beta=0.04, entropy_coef=0.1)
    for rank, (r_loss, _, _, r_grad) in enumerate(per_rank):
        torch.testing.assert_close(r_loss, loss, **TOL)
        torch.testing.assert_close(r_grad, grad[..., :61] if rank == 0 else grad[..., 61:], **TOL)


def _rank_packed(rank: int, world: int):
    """A packed batch on a sharded vocabulary: both keywords together."""
    import torch.distributed as dist

    V, part = 80, 40
    batch = _batch(V, seed=3)
    lengths = [5, 2, 0]  # rows of the padded batch, packed (row 2 is fully masked: an empty sequence)
    valid = torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    packed = {k: (v[valid] if v.dim() >= 2 else v) for k, v in batch.items()}
    cu = torch.tensor([0, 5, 7, 7], dtype=torch.int32)
    return _run(
        packed,
        packed["logits"][..., rank * part : (rank + 1) * part],
        backend="torch",
        vocab_parallel_group=dist.group.WORLD,
        cu_seqlens=cu,
        beta=0.04,
        importance_sampling_level="sequence",
    )


def test_a_packed_batch_on_a_sharded_vocabulary():
    per_rank = run_ranks(_rank_packed, 2, timeout=300)
    batch = _batch(80, seed=3)
    batch["completion_mask"][1, 2:] = 0  # the padded layout of the same two sequences (lengths 5 and 2)
    valid = torch.arange(T).unsqueeze(0) < torch.tensor([5, 2, 0]).unsqueeze(1)
    loss, _, _, grad = _run(batch, batch["logits"], backend="torch", beta=0.04, importance_sampling_level="sequence")
    for rank, (r_loss, _, _, r_grad) in enumerate(per_rank):
        torch.testing.assert_close(r_loss, loss, **TOL)
        torch.testing.assert_close(r_grad, grad[valid][..., rank * 40 : (rank + 1) * 40], **TOL)


def _lm_head_shard_run(rank: int, world: int, backend: str, options: dict, packed: bool = False):
    """Megatron's column-parallel lm_head: this rank's weight (and bias) rows, hidden states replicated."""
    import torch.distributed as dist

    from grpo_kernels import fused_linear_grpo_loss

    hidden, weight, bias, batch = _lm_head_inputs()
    inputs = {k: v for k, v in batch.items() if k != "logits"}
    extra = {}
    if packed:  # the same rows packed: sequences of lengths 3, 5 and 0 (row 2 is fully masked)
        valid = batch["completion_mask"].sum(-1, keepdim=True) > torch.arange(T)
        valid[0] = torch.arange(T) < 3
        hidden = hidden[valid]
        inputs = {k: (v[valid] if v.dim() == 2 else v) for k, v in inputs.items()}
        extra["cu_seqlens"] = torch.tensor([0, 3, 8, 8], dtype=torch.int32)
    part = weight.shape[0] // world
    h = hidden.clone().requires_grad_()
    w = weight[rank * part : (rank + 1) * part].clone().requires_grad_()
    b = bias[rank * part : (rank + 1) * part].clone().requires_grad_()
    out = fused_linear_grpo_loss(
        h, w, **inputs, bias=b, backend=backend, vocab_parallel_group=dist.group.WORLD, **options, **extra
    )
    out.loss.backward()
    return out.loss.detach(), {k: v.detach() for k, v in out.metrics.items()}, h.grad, w.grad, b.grad


def _rank_lm_head_shard(rank: int, world: int, backend: str, options: dict):
    return _lm_head_shard_run(rank, world, backend, options)


def _rank_lm_head_every_loss_type(rank: int, world: int):
    return [_lm_head_shard_run(rank, world, "torch", case) for case in CASES]


def _rank_lm_head_packed(rank: int, world: int):
    return _lm_head_shard_run(rank, world, "torch", dict(beta=0.04, importance_sampling_level="sequence"), True)


def _lm_head_inputs(V: int = 96, H: int = 12):
    """Old and reference log-probs near this head's own, so that every term (VESPO's weight too) is alive."""
    g = torch.Generator().manual_seed(9)
    hidden, weight, bias = (
        torch.randn(B, T, H, generator=g),
        0.5 * torch.randn(V, H, generator=g),
        0.1 * torch.randn(V, generator=g),
    )
    batch = _batch(V, seed=9)
    lp = torch.log_softmax(hidden @ weight.T + bias, -1).gather(-1, batch["completion_ids"].unsqueeze(-1))[..., 0]
    batch["old_logps"] = lp + 0.05 * torch.randn(B, T, generator=g)
    batch["ref_logps"] = lp + 0.05 * torch.randn(B, T, generator=g)
    return hidden, weight, bias, batch


@pytest.mark.parametrize(
    "backend, options",
    [
        ("torch", dict(beta=0.04, entropy_coef=0.1)),
        ("triton", dict(loss_type="dapo", beta=0.04, importance_sampling_level="sequence")),
        ("torch", dict(loss_type="vespo", top_entropy_quantile=0.5)),
    ],
)
@pytest.mark.parametrize("world", [2, 4])
def test_a_sharded_lm_head_equals_the_unsharded_loss(backend, options, world):
    per_rank = run_ranks(_rank_lm_head_shard, world, backend, options, timeout=300)
    hidden, weight, bias, batch = _lm_head_inputs()
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    from grpo_kernels import grpo_loss_reference

    expected = grpo_loss_reference(h @ w.T + b, **{k: v for k, v in batch.items() if k != "logits"}, **options)
    expected.loss.backward()
    part = weight.shape[0] // world
    for rank, (loss, metrics, dh, dw, db) in enumerate(per_rank):
        rows = slice(rank * part, (rank + 1) * part)
        torch.testing.assert_close(loss, expected.loss, **TOL)
        for name, value in expected.metrics.items():
            torch.testing.assert_close(metrics[name], value, **TOL)
        torch.testing.assert_close(dh, h.grad, atol=1e-5, rtol=1e-5)  # the whole d hidden on every rank
        torch.testing.assert_close(dw, w.grad[rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(db, b.grad[rows], atol=1e-5, rtol=1e-5)


def _rank_token_logprobs(rank: int, world: int):
    import torch.distributed as dist

    from grpo_kernels import token_logprobs

    batch = _batch(64, seed=4)
    return token_logprobs(
        batch["logits"][..., rank * 32 : (rank + 1) * 32],
        batch["completion_ids"],
        0.8,
        return_entropy=True,
        vocab_parallel_group=dist.group.WORLD,
    )


def test_token_logprobs_on_a_sharded_vocabulary():
    from grpo_kernels import token_logprobs

    batch = _batch(64, seed=4)
    expected = token_logprobs(batch["logits"], batch["completion_ids"], 0.8, return_entropy=True)
    for logp, entropy in run_ranks(_rank_token_logprobs, 2, timeout=300):
        torch.testing.assert_close(logp, expected[0], **TOL)
        torch.testing.assert_close(entropy, expected[1], **TOL)


def _lm_head_reference(options, rows=None):
    from grpo_kernels import grpo_loss_reference

    hidden, weight, bias, batch = _lm_head_inputs()
    if rows is not None:  # the padded layout of the packed test's sequences
        batch["completion_mask"] = batch["completion_mask"] * rows
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    expected = grpo_loss_reference(h @ w.T + b, **{k: v for k, v in batch.items() if k != "logits"}, **options)
    expected.loss.backward()
    return expected, h.grad, w.grad, b.grad


def test_a_sharded_lm_head_for_every_loss_type():
    per_rank = run_ranks(_rank_lm_head_every_loss_type, 2, timeout=600)
    for i, case in enumerate(CASES):
        expected, dh, dw, db = _lm_head_reference(case)
        for rank, results in enumerate(per_rank):
            loss, metrics, r_dh, r_dw, r_db = results[i]
            rows = slice(rank * 48, (rank + 1) * 48)
            torch.testing.assert_close(loss, expected.loss, **TOL, msg=lambda m, case=case: f"{case}: loss\n{m}")
            for name, value in expected.metrics.items():
                torch.testing.assert_close(
                    metrics[name], value, **TOL, msg=lambda m, case=case, name=name: f"{case}: {name}\n{m}"
                )
            torch.testing.assert_close(
                r_dh, dh, atol=1e-5, rtol=1e-5, msg=lambda m, case=case: f"{case}: d hidden\n{m}"
            )
            torch.testing.assert_close(
                r_dw, dw[rows], atol=1e-5, rtol=1e-5, msg=lambda m, case=case: f"{case}: d weight\n{m}"
            )
            torch.testing.assert_close(
                r_db, db[rows], atol=1e-5, rtol=1e-5, msg=lambda m, case=case: f"{case}: d bias\n{m}"
            )


def test_a_packed_batch_on_a_sharded_lm_head():
    per_rank = run_ranks(_rank_lm_head_packed, 2, timeout=300)
    lengths = torch.tensor([3, 5, 0])
    rows = (torch.arange(T) < lengths.unsqueeze(1)).float()
    expected, dh, dw, db = _lm_head_reference(dict(beta=0.04, importance_sampling_level="sequence"), rows)
    for rank, (loss, _, r_dh, r_dw, _) in enumerate(per_rank):
        torch.testing.assert_close(loss, expected.loss, **TOL)
        torch.testing.assert_close(r_dh, dh[rows.bool()], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r_dw, dw[rank * 48 : (rank + 1) * 48], atol=1e-5, rtol=1e-5)


def _rank_linear_token_logprobs(rank: int, world: int, backend: str):
    import torch.distributed as dist

    from grpo_kernels import linear_token_logprobs

    hidden, weight, bias, batch = _lm_head_inputs()
    part = weight.shape[0] // world
    rows = slice(rank * part, (rank + 1) * part)
    return linear_token_logprobs(
        hidden,
        weight[rows],
        batch["completion_ids"],
        bias[rows],
        0.8,
        return_entropy=True,
        backend=backend,
        vocab_parallel_group=dist.group.WORLD,
    )


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_linear_token_logprobs_on_a_sharded_lm_head(backend):
    """A column-parallel lm_head's old / reference log-probs: every rank gets the unsharded values."""
    from grpo_kernels import token_logprobs

    hidden, weight, bias, batch = _lm_head_inputs()
    expected = token_logprobs(hidden @ weight.T + bias, batch["completion_ids"], 0.8, return_entropy=True)
    for logp, entropy in run_ranks(_rank_linear_token_logprobs, 2, backend, timeout=300):
        torch.testing.assert_close(logp, expected[0], **TOL)
        torch.testing.assert_close(entropy, expected[1], **TOL)
