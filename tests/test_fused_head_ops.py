"""The fused head as a differentiable op, for trainers that compute their own loss on log-probs:
``linear_selective_log_softmax`` and ``linear_selective_log_softmax_and_entropy`` against the unfused head (the
materialized logits' log-softmax, by autograd): values and gradients in the hidden states, the weight and the
bias, on both backends, packed, vocabulary-parallel, with a frozen head, and in each ``head_precision``."""

import pytest
import torch
from gloo_ranks import run_ranks
from helpers import assert_close

from grpo_kernels import linear_selective_log_softmax, linear_selective_log_softmax_and_entropy

B, T, H, V = 3, 5, 24, 101
FP32 = dict(atol=2e-6, rtol=1e-5)


def _inputs(dtype=torch.float32, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    b = (torch.randn(V, generator=g) * 0.1).to(dtype) if bias else None
    ids = torch.randint(0, V, (B, T), generator=g)
    loss_weights = torch.randn(B, T, generator=g)
    return hidden, weight, b, ids, loss_weights


def _grads(fn, hidden, weight, bias, ids, loss_weights, entropy_coef=0.3, freeze_weight=False):
    """(log-probs, entropy, d hidden, d weight, d bias) of a loss sum(w (log p + c H)) through ``fn``."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_(not freeze_weight)
    b = None if bias is None else bias.detach().clone().requires_grad_()
    logp, entropy = fn(h, w, b, ids)
    ((logp + entropy_coef * entropy) * loss_weights).sum().backward()
    return logp.detach(), entropy.detach(), h.grad, w.grad, None if b is None else b.grad


def _unfused(precision_dtype=None, temperature=0.9, softcap=None):
    """The unfused head: logits materialized (in ``precision_dtype``, else the inputs' dtype), then fp32 math."""

    def fn(h, w, b, ids):
        cast = (lambda t: t) if precision_dtype is None else (lambda t: None if t is None else t.to(precision_dtype))
        logits = cast(h) @ cast(w).T
        if b is not None:
            logits = logits + cast(b)
        x = logits.float()
        if softcap is not None:
            x = softcap * torch.tanh(x / softcap)
        log_p = torch.log_softmax(x / temperature, -1)
        return log_p.gather(-1, ids[..., None])[..., 0], -(log_p.exp() * log_p).sum(-1)

    return fn


def _ours(**keywords):
    def fn(h, w, b, ids):
        return linear_selective_log_softmax_and_entropy(h, w, ids, b, 0.9, **keywords)

    return fn


def _check(expected, actual, tol=FP32):
    names = ("log-probs", "entropy", "d hidden", "d weight", "d bias")[: len(expected)]
    for name, e, a in zip(names, expected, actual, strict=True):
        if e is None:
            assert a is None, name
            continue
        assert a.dtype == e.dtype, name
        assert_close(name, e, a, **tol)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_op_is_the_unfused_head(backend, bias):
    inputs = _inputs(bias=bias)
    _check(_grads(_unfused(), *inputs), _grads(_ours(backend=backend), *inputs))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_log_probs_alone_and_a_soft_capped_scaled_head(backend):
    """The log-probs alone (no entropy, its own gradient), and a head whose raw output is scaled then capped."""
    hidden, weight, bias, ids, loss_weights = _inputs(seed=1)
    h = hidden.clone().requires_grad_()
    got = linear_selective_log_softmax(h, weight, ids, bias, 0.9, backend=backend)
    (got * loss_weights).sum().backward()
    h2 = hidden.clone().requires_grad_()
    expected, _ = _unfused()(h2, weight, bias, ids)
    (expected * loss_weights).sum().backward()
    assert_close("log-probs", expected, got, **FP32)
    assert_close("d hidden", h2.grad, h.grad, **FP32)
    capped = _grads(_ours(backend=backend, logit_scale=0.5, logit_softcap=3.0), hidden, weight, bias, ids, loss_weights)
    unfused = _unfused(softcap=3.0)
    half = _grads(lambda h, w, b, i: unfused(h * 0.5, w, b * 0.5, i), hidden, weight, bias, ids, loss_weights)
    _check(half, capped)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_frozen_head_gets_no_weight_gradient(backend):
    inputs = _inputs(seed=2)
    expected = _grads(_unfused(), *inputs, freeze_weight=True)
    actual = _grads(_ours(backend=backend), *inputs, freeze_weight=True)
    assert actual[3] is None
    _check(expected, actual)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_head_precision_fp32_is_the_unfused_head_in_fp32(backend, dtype):
    """16-bit hidden states and weight with head_precision="fp32": the unfused head computed in fp32 (TRL's
    cast_lm_head_to_fp32), to fp32 rounding; the gradients come back in the inputs' dtype."""
    inputs = _inputs(dtype=dtype, seed=3)
    expected = _grads(_unfused(precision_dtype=torch.float32), *inputs)
    actual = _grads(_ours(backend=backend, head_precision="fp32"), *inputs)
    # the gradients: the same fp32 values, each rounded once to the inputs' dtype
    ulp = torch.finfo(dtype).eps
    _check(expected[:2], actual[:2], tol=dict(atol=1e-5, rtol=1e-5))
    for name, e, a in zip(("d hidden", "d weight", "d bias"), expected[2:], actual[2:], strict=True):
        assert a.dtype == dtype, name
        assert_close(name, e.float(), a.float(), atol=ulp * e.float().abs().max().item(), rtol=ulp)


def test_a_packed_batch_is_the_padded_one():
    hidden, weight, bias, ids, loss_weights = _inputs(seed=4)
    lengths = [5, 2, 4]
    packed_h = torch.cat([hidden[i, :n] for i, n in enumerate(lengths)])
    packed_ids = torch.cat([ids[i, :n] for i, n in enumerate(lengths)])
    cu = torch.tensor([0, 5, 7, 11], dtype=torch.int32)
    packed_w = torch.cat([loss_weights[i, :n] for i, n in enumerate(lengths)])
    expected = _grads(_unfused(), packed_h, weight, bias, packed_ids, packed_w)
    actual = _grads(_ours(backend="triton", cu_seqlens=cu), packed_h, weight, bias, packed_ids, packed_w)
    _check(expected, actual)


def test_unknown_head_precision_is_named():
    hidden, weight, bias, ids, _ = _inputs()
    with pytest.raises(
        ValueError, match=r"head_precision must be one of \['input', 'fp32_logits', 'fp32'\], got 'bf16'"
    ):
        linear_selective_log_softmax(hidden, weight, ids, bias, head_precision="bf16")


def _sharded_rank(rank, world, inputs):
    """This rank's vocabulary shard of the weight (and bias): the op's values and this shard's gradients."""
    import torch.distributed as dist

    hidden, weight, bias, ids, loss_weights = inputs
    rows = slice(rank * V // world, (rank + 1) * V // world)
    group = dist.new_group(list(range(world)))

    def sharded(h, w, b, i):
        return linear_selective_log_softmax_and_entropy(
            h, w, i, b, 0.9, backend="torch", vocab_parallel_group=group, vocab_start_index=rows.start
        )

    return _grads(sharded, hidden, weight[rows], bias[rows], ids, loss_weights), rows


def test_a_vocabulary_parallel_head_is_the_whole_one():
    inputs = _inputs(seed=5)
    whole = _grads(_unfused(), *inputs)
    for (logp, entropy, dh, dw, db), rows in run_ranks(_sharded_rank, 2, inputs):
        _check(whole[:3], (logp, entropy, dh))
        assert_close("d weight shard", whole[3][rows], dw, **FP32)
        assert_close("d bias shard", whole[4][rows], db, **FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_head_precision_input_is_the_unfused_head_in_its_dtype(backend, dtype):
    """16-bit hidden states and weight at the default precision ("input"): the unfused head in that dtype (its
    logits accumulated in fp32 and rounded to the dtype), on every mode. The values sit on a coarse grid, so every
    sum is exact whatever its order and each path rounds the same logits (tests/test_fused_linear.py says why)."""
    hidden, weight, bias, ids, loss_weights = _inputs(seed=6)
    hidden, weight, bias = ((t * k).round().clamp(-12, 12) / k for t, k in ((hidden, 4), (weight, 8), (bias, 8)))
    inputs = (hidden.to(dtype), weight.to(dtype), bias.to(dtype), ids, loss_weights)
    expected = _grads(_unfused(), *inputs)  # torch's head in the dtype: rounded logits
    assert expected[0].dtype == torch.float32
    actual = _grads(_ours(backend=backend), *inputs)
    _check(expected[:2], actual[:2], tol=dict(atol=1e-5, rtol=1e-5))
    ulp = torch.finfo(dtype).eps
    for name, e, a in zip(("d hidden", "d weight", "d bias"), expected[2:], actual[2:], strict=True):
        assert_close(name, e.float(), a.float(), atol=2 * ulp * e.float().abs().max().item(), rtol=2 * ulp)
    if dtype == torch.bfloat16:  # (fp16's 11 bits hold these sums exactly: nothing to round there)
        unrounded = _grads(_unfused(precision_dtype=torch.float32), *inputs)
        assert (unrounded[0] - actual[0]).abs().max() > 1e-3, "nothing was rounded: the test would not tell"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_default_16_bit_head_on_ordinary_inputs_is_the_unfused_head(device, backend, dtype):
    """Ordinary 16-bit inputs (not on a grid: the fp32 sums need rounding) at the default precision: every entry
    point's log-probs equal the unfused head's, ``F.linear`` in the dtype (fp32 accumulation, one rounding to nearest
    even), within 1e-5 on every token but at most one (a logit whose fp32 sum lands on a rounding boundary in
    another order of accumulation). Before the kernels rounded explicitly, Triton's interpreter truncated bf16 and
    was off on every token (6e-2). The fp64 head differs by far more: the test can tell."""
    from grpo_kernels import fused_linear_grpo_loss, linear_token_logprobs

    g = torch.Generator().manual_seed(0)
    Bo, To, Ho, Vo = 4, 16, 24, 67
    hidden = torch.randn(Bo, To, Ho, generator=g).to(device, dtype)
    weight = (torch.randn(Vo, Ho, generator=g) * 0.3).to(device, dtype)
    bias = (torch.randn(Vo, generator=g) * 0.1).to(device, dtype)
    ids = torch.randint(0, Vo, (Bo, To), generator=g).to(device)
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    expected = torch.log_softmax(logits / 0.9, -1).gather(-1, ids[..., None])[..., 0]
    mask, advantages = torch.ones(Bo, To, device=device), torch.randn(Bo, generator=g).to(device)
    found = {
        "linear_token_logprobs": linear_token_logprobs(hidden, weight, ids, bias, 0.9, backend=backend),
        "linear_selective_log_softmax": linear_selective_log_softmax(
            hidden.clone().requires_grad_(), weight, ids, bias, 0.9, backend=backend
        ).detach(),
    }
    for mode in ("recompute", "three_products"):
        out = fused_linear_grpo_loss(
            hidden.clone().requires_grad_(), weight, ids, mask, advantages, bias=bias, temperature=0.9,
            backend=backend, lm_head_mode=mode,
        )  # fmt: skip
        found[f"the loss's log-probs ({mode})"] = out.per_token_logps
    for name, logp in found.items():
        off = (logp - expected).abs()
        assert (off > 1e-5).sum() <= 1, f"{name}: {int((off > 1e-5).sum())} tokens off, max {off.max():.2e}"
    fp64 = torch.log_softmax((hidden.double() @ weight.double().T + bias.double()) / 0.9, -1).gather(
        -1, ids[..., None]
    )[..., 0]
    assert (fp64 - expected.double()).abs().max() > 1e-3 if dtype == torch.bfloat16 else True
