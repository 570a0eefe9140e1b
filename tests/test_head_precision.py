"""head_precision="fp32_logits": the fused head with 16-bit operands, fp32 accumulation and the fp32 accumulator kept
as the logit (an fp32-output head, as a rollout engine that samples from fp32 logits of bf16 operands computes them).

The oracle is the unrounded product of the bf16 operands in fp32: ``F.linear(h.float(), W.float(), b.float())``. A
bf16 x bf16 product is exact in fp32, so that is what ``torch.mm(h, W.T, out_dtype=torch.float32)`` computes on a
GPU up to the order of its sums (torch 2.13 has no CPU kernel for ``out_dtype``: where the installed torch has one,
the test compares it too). On ordinary inputs (random, not exactly representable logits) "input" rounds the logits
to bf16 and is far from the oracle, which the first test checks, so that the equalities below can fail."""

import pytest
import torch
import torch.nn.functional as F
from gloo_ranks import run_ranks

from grpo_kernels import (
    KeptSet,
    fused_linear_grpo_loss,
    grpo_loss,
    linear_selective_log_softmax_and_entropy,
    selective_log_softmax,
    topk_logprobs,
)

B, T, H, V, TAU = 2, 6, 32, 96, 0.8
TIGHT = dict(atol=2e-5, rtol=2e-5)  # fp32 sums in another order
BF16_GRAD = dict(atol=2e-2, rtol=2e-2)  # gradients come back in bf16, rounded from fp32 sums in another order


def _case(seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).bfloat16()
    weight = (torch.randn(V, H, generator=g) / 2).bfloat16()
    b = torch.randn(V, generator=g).bfloat16() if bias else None
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    adv = torch.randn(B, generator=g)
    old = -torch.rand(B, T, generator=g) * 3
    return hidden, weight, b, ids, mask, adv, old


def _fp32_output_logits(hidden, weight, bias):
    """The bf16 operands' product with an fp32 output, unrounded (the oracle's head)."""
    return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def test_the_oracle_is_an_fp32_output_product_and_input_precision_is_far_from_it():
    hidden, weight, bias, ids, *_ = _case()
    logits = _fp32_output_logits(hidden, weight, bias)
    try:
        out = torch.mm(hidden.reshape(-1, H), weight.T, out_dtype=torch.float32) + bias.float()
    except (NotImplementedError, RuntimeError, TypeError):  # no kernel for out_dtype on this device / torch
        out = None
    if out is not None:
        torch.testing.assert_close(out.view(B, T, V), logits, **TIGHT)
    rounded = linear_selective_log_softmax_and_entropy(hidden, weight, ids, bias, TAU, backend="torch")[0]
    oracle = torch.log_softmax(logits / TAU, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert (rounded - oracle).abs().max() > 1e-3, "the bf16-rounded head should differ from the fp32-output one"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_logprobs_entropy_and_gradients_equal_the_fp32_output_head(backend):
    hidden, weight, bias, ids, *_ = _case(1)
    weights = torch.randn(2, B, T, generator=torch.Generator().manual_seed(7))
    h, w, b = _leaves(hidden, weight, bias)
    logp, entropy = linear_selective_log_softmax_and_entropy(
        h, w, ids, b, TAU, backend=backend, head_precision="fp32_logits"
    )
    ((weights[0] * logp).sum() + (weights[1] * entropy).sum()).backward()
    rh, rw, rb = _leaves(hidden, weight, bias)
    logp_all = torch.log_softmax(_fp32_output_logits(rh, rw, rb) / TAU, -1)
    ref_logp = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    ref_entropy = -(logp_all.exp() * logp_all).sum(-1)
    ((weights[0] * ref_logp).sum() + (weights[1] * ref_entropy).sum()).backward()
    torch.testing.assert_close(logp, ref_logp, **TIGHT)
    torch.testing.assert_close(entropy, ref_entropy, **TIGHT)
    for name, got, want in (("d hidden", h.grad, rh.grad), ("d weight", w.grad, rw.grad), ("d bias", b.grad, rb.grad)):
        assert got.dtype == torch.bfloat16, name
        torch.testing.assert_close(got.float(), want.float(), **BF16_GRAD, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("backend, mode", [("torch", None), ("triton", "recompute"), ("triton", "three_products")])
def test_the_loss_equals_the_loss_on_fp32_output_logits(backend, mode):
    """The fused loss (the kernels' per-token math on the Triton backend, both lm_head modes: the 3-product mode's
    chunk product with an fp32 output, its dlogits cast to bf16 for the gradient products) equals grpo_loss on the
    oracle's logits: loss, metrics and log-probs tight, gradients to bf16; without a gradient too."""
    hidden, weight, bias, ids, mask, adv, old = _case(2)
    kw = dict(beta=0.0, temperature=TAU, loss_type="dapo")
    h, w, b = _leaves(hidden, weight, bias)
    call = dict(bias=b, backend=backend, head_precision="fp32_logits", lm_head_mode=mode, **kw)
    with torch.no_grad():
        no_grad = fused_linear_grpo_loss(h, w, ids, mask, adv, old_logps=old, **call)
    out = fused_linear_grpo_loss(h, w, ids, mask, adv, old_logps=old, **call)
    out.loss.backward()
    rh, rw, rb = _leaves(hidden, weight, bias)
    ref = grpo_loss(_fp32_output_logits(rh, rw, rb), ids, mask, adv, old_logps=old, backend="torch", **kw)
    ref.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, **TIGHT)
    torch.testing.assert_close(no_grad.loss, ref.loss, **TIGHT)
    torch.testing.assert_close(out.per_token_logps, ref.per_token_logps, **TIGHT)
    for key in ref.metrics:
        torch.testing.assert_close(out.metrics[key], ref.metrics[key], **TIGHT, msg=lambda m, k=key: f"{k}: {m}")
    torch.testing.assert_close(h.grad.float(), rh.grad.float(), **BF16_GRAD)
    torch.testing.assert_close(w.grad.float(), rw.grad.float(), **BF16_GRAD)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_kept_set_and_the_teachers_top_k_take_the_unrounded_logits(backend):
    hidden, weight, bias, ids, mask, *_ = _case(3)
    logits = _fp32_output_logits(hidden, weight, bias)
    g = torch.Generator().manual_seed(5)
    kept_ids = torch.stack([torch.randperm(V, generator=g)[:5] for _ in range(B * T)]).view(B, T, 5)
    kept_ids[..., 0] = ids  # each token's own id among its kept ones
    kept = KeptSet.from_padded(kept_ids)
    got = linear_selective_log_softmax_and_entropy(
        hidden, weight, ids, bias, TAU, backend=backend, head_precision="fp32_logits", kept_set=kept
    )[0]
    want = selective_log_softmax(logits, ids, TAU, backend="torch", kept_set=kept)
    torch.testing.assert_close(got, want, **TIGHT)
    teacher = torch.stack([torch.randperm(V, generator=g)[:4] for _ in range(B * T)]).view(B, T, 4)
    got = topk_logprobs(hidden, teacher, TAU, weight=weight, bias=bias, backend=backend, head_precision="fp32_logits")
    want = topk_logprobs(logits, teacher, TAU, backend="torch")
    torch.testing.assert_close(got, want, **TIGHT)


def test_a_compiled_call_equals_eager():
    hidden, weight, bias, ids, *_ = _case(4)

    def step(h, w, b):
        return linear_selective_log_softmax_and_entropy(
            h, w, ids, b, TAU, backend="torch", head_precision="fp32_logits"
        )

    eager = step(hidden, weight, bias)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(hidden, weight, bias)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def _sharded_rank(rank, world):
    import torch.distributed as dist

    hidden, weight, bias, ids, *_ = _case(6)
    part = V // world
    h = hidden.reshape(-1, H).clone().requires_grad_()
    logp, entropy = linear_selective_log_softmax_and_entropy(
        h,
        weight[rank * part : (rank + 1) * part],
        ids.reshape(-1),
        bias[rank * part : (rank + 1) * part],
        TAU,
        backend="torch",
        vocab_parallel_group=dist.group.WORLD,
        head_precision="fp32_logits",
    )
    (logp.sum() + entropy.sum()).backward()
    return logp.detach(), entropy.detach(), h.grad


def test_a_vocabulary_shard_equals_the_fp32_output_head():
    hidden, weight, bias, ids, *_ = _case(6)
    rh = hidden.reshape(-1, H).clone().requires_grad_()
    logp_all = torch.log_softmax(_fp32_output_logits(rh, weight, bias) / TAU, -1)
    logp = logp_all.gather(-1, ids.reshape(-1, 1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    (logp.sum() + entropy.sum()).backward()
    for got_logp, got_entropy, got_grad in run_ranks(_sharded_rank, 2, timeout=300):
        torch.testing.assert_close(got_logp, logp.detach(), **TIGHT)
        torch.testing.assert_close(got_entropy, entropy.detach(), **TIGHT)
        torch.testing.assert_close(got_grad.float(), rh.grad.float(), **BF16_GRAD)
