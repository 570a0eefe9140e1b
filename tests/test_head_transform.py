"""The head's output transform (``logit_scale``, ``logit_softcap``) on every path against the specification.

A model such as Gemma 2 returns cap * tanh(s * (h W^T + b) / cap): the loss options ``logit_scale`` and
``logit_softcap`` say so, and every path that reads raw head outputs (the logits path's kernels, one-pass,
two-pass and split-row; the fused lm_head in both modes; the torch path; the log-prob functions) applies
it, forward and backward (the chain factor s (1 - tanh^2)). The expected values are
``grpo_loss_reference`` on the same raw values (its ``head_output``). The cap is small against the
logits (std 2, cap 3) so that it bends most of them.
"""

import contextlib

import pytest
import torch
from helpers import assert_close, make_batch, split_row

from grpo_kernels import (
    GRPOOptions,
    fused_linear_grpo_loss,
    grpo_loss,
    grpo_loss_reference,
    linear_token_logprobs,
    selective_log_softmax_and_entropy,
    token_logprobs,
)
from grpo_kernels.reference import head_output, token_logprobs_and_entropy

LOGITS_BACKENDS = ["torch", "triton", "triton-two-pass", "triton-split-row"]
TRANSFORMS = {
    "scale": dict(logit_scale=0.5),
    "softcap": dict(logit_softcap=3.0),
    # all at once, as a capped model trained at a temperature with the KL and an entropy bonus
    "scale_softcap_temperature": dict(
        logit_scale=1.7, logit_softcap=3.0, temperature=0.7, beta=0.04, entropy_coef=0.05
    ),
}
FP32 = dict(atol=2e-6, rtol=2e-5)  # the kernels' tanh is 2 / (1 + e^-2y) - 1: ~1e-7 of the cap


def _logits_run(backend, batch, **options):
    logits = batch["logits"].detach().clone().requires_grad_()
    inputs = {**batch, "logits": logits}
    if backend is None:
        out = grpo_loss_reference(**inputs, **options)
    else:
        with split_row(4) if backend == "triton-split-row" else contextlib.nullcontext():
            out = grpo_loss(**inputs, backend=backend.split("-")[0], one_pass=backend != "triton-two-pass", **options)
    out.loss.backward()
    return out, logits.grad


def _check_logits(backend, batch, loss_tol=FP32, grad_tol=FP32, **options):
    up = {**batch, "logits": batch["logits"].float()}
    expected, expected_grad = _logits_run(None, up, **options)
    actual, grad = _logits_run(backend, batch, **options)
    assert_close("loss", expected.loss, actual.loss, **loss_tol)
    assert_close("dlogits", expected_grad.to(grad.dtype), grad, **grad_tol)
    active = batch["completion_mask"] != 0
    assert_close("per_token_logps", expected.per_token_logps[active], actual.per_token_logps[active], **loss_tol)
    for name in expected.metrics:
        assert_close(name, expected.metrics[name], actual.metrics[name], **loss_tol)


def test_the_reference_transform_is_the_models():
    """head_output is Gemma 2's soft-cap after Cohere's scale, written out; a capped logit stays finite."""
    x = torch.tensor([-float("inf"), -40.0, -1.0, 0.0, 2.5, 90.0])
    expected = 30.0 * torch.tanh(x * 0.25 / 30.0)
    torch.testing.assert_close(head_output(x, 0.25, 30.0), expected)
    assert head_output(x, 0.25, 30.0)[0] == -30.0
    torch.testing.assert_close(head_output(x, 0.25), x * 0.25)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("transform", TRANSFORMS, ids=list(TRANSFORMS))
def test_logits_path_applies_the_head_transform(device, backend, transform):
    batch = make_batch(device=device, V=1003, seed=3, clip_spread=0.6)
    _check_logits(backend, batch, **TRANSFORMS[transform])


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_capped_minus_inf_logits_stay_finite_with_zero_gradient(device, backend):
    """A -inf raw logit (a vocabulary entry masked out) is -cap once capped, as in the model: finite, its
    probability small but not zero, its gradient zero (the tanh is flat there)."""
    batch = make_batch(device=device, V=1003, seed=4)
    logits = batch["logits"].clone()
    logits[0, :, 100:400] = float("-inf")
    logits[1, 1, :] = float("-inf")  # a whole row at -inf: uniform after the cap
    batch["logits"] = logits
    batch["completion_ids"][1, 1] = 7
    _check_logits(backend, batch, logit_softcap=3.0, beta=0.04, entropy_coef=0.05)
    out, grad = _logits_run(backend, batch, logit_softcap=3.0, beta=0.04)
    assert torch.isfinite(out.per_token_logps).all()
    assert (grad[0, :, 100:400] == 0).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_logits_with_a_softcap(device, backend):
    """bf16 raw logits: fp32 math on the same values; the gradient is rounded to bf16 (2 eps relative)."""
    batch = make_batch(device=device, dtype=torch.bfloat16, V=2053, seed=5)
    eps = torch.finfo(torch.bfloat16).eps
    _check_logits(
        backend,
        batch,
        loss_tol=dict(atol=1e-5, rtol=1e-4),
        grad_tol=dict(atol=1e-5, rtol=2 * eps),
        logit_softcap=3.0,
        logit_scale=0.8,
        beta=0.04,
    )


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_log_prob_functions_apply_the_head_transform(device, backend):
    batch = make_batch(device=device, V=1003, seed=6)
    logits, ids = batch["logits"], batch["completion_ids"]
    transform = dict(logit_scale=0.6, logit_softcap=2.5)
    expected_lp, expected_entropy = token_logprobs_and_entropy(logits.float(), ids, 0.8, 0.6, 2.5)
    lp, entropy = token_logprobs(logits, ids, 0.8, return_entropy=True, backend=backend, **transform)
    assert_close("logps", expected_lp, lp, **FP32)
    assert_close("entropy", expected_entropy, entropy, **FP32)

    leaf = logits.detach().clone().requires_grad_()
    reference_leaf = logits.detach().clone().requires_grad_()
    lp, entropy = selective_log_softmax_and_entropy(leaf, ids, 0.8, backend=backend, **transform)
    (lp.sum() + 0.3 * entropy.sum()).backward()
    expected_lp, expected_entropy = token_logprobs_and_entropy(reference_leaf, ids, 0.8, 0.6, 2.5)
    (expected_lp.sum() + 0.3 * expected_entropy.sum()).backward()
    assert_close("d logits", reference_leaf.grad, leaf.grad, **FP32)


# ---- the fused lm_head ----------------------------------------------------------------------------------------

FUSED_PATHS = {
    "torch": dict(backend="torch"),
    "triton-recompute": dict(backend="triton", lm_head_mode="recompute"),
    "triton-three-products": dict(backend="triton", lm_head_mode="three_products"),
}
B, T, H, V = 3, 5, 37, 203  # odd H and V: every tile has a ragged edge


def _head_inputs(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = 0.5 * torch.randn(V, H, generator=g)
    bias = 0.2 * torch.randn(V, generator=g)
    batch = make_batch(B=B, T=T, V=V, device=device, seed=seed)
    del batch["logits"]
    to = lambda x: x.to(device=device, dtype=dtype).requires_grad_()  # noqa: E731
    return batch, to(hidden), to(weight), to(bias)


def _fused_run(path, batch, hidden, weight, bias, **options):
    h, w, b = (x.detach().clone().requires_grad_() for x in (hidden, weight, bias))
    if path is None:
        out = grpo_loss_reference(h.float() @ w.float().T + b.float(), **batch, **options)
    else:
        out = fused_linear_grpo_loss(h, w, **batch, bias=b, **FUSED_PATHS[path], **options)
    out.loss.backward()
    return out, (h.grad, w.grad, b.grad)


@pytest.mark.parametrize("path", FUSED_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_lm_head_applies_the_head_transform(device, path, dtype):
    """Both lm_head modes and the torch path: logits = cap(s (h W^T + b)), the loss, the metrics and d hidden,
    d weight, d bias as the reference's on the materialized raw logits."""
    batch, hidden, weight, bias = _head_inputs(device, dtype)
    options = dict(logit_scale=0.8, logit_softcap=3.0, temperature=0.9, beta=0.04, entropy_coef=0.05)
    expected, expected_grads = _fused_run(None, batch, hidden, weight, bias, **options)
    actual, grads = _fused_run(path, batch, hidden, weight, bias, **options)
    bf16 = dtype == torch.bfloat16
    loss_tol = dict(atol=2e-3, rtol=2e-3) if bf16 else FP32  # bf16 products: the reference's are fp32
    grad_tol = dict(atol=2e-2, rtol=2e-2) if bf16 else dict(atol=1e-5, rtol=1e-4)
    assert_close("loss", expected.loss, actual.loss, **loss_tol)
    active = batch["completion_mask"] != 0
    assert_close("per_token_logps", expected.per_token_logps[active], actual.per_token_logps[active], **loss_tol)
    for name in expected.metrics:
        assert_close(name, expected.metrics[name], actual.metrics[name], **loss_tol)
    for name, e, a in zip(("d hidden", "d weight", "d bias"), expected_grads, grads, strict=True):
        assert_close(name, e.to(a.dtype), a, **grad_tol)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_linear_token_logprobs_apply_the_head_transform(device, backend):
    batch, hidden, weight, bias = _head_inputs(device, torch.float32, seed=2)
    ids = batch["completion_ids"]
    raw = (hidden @ weight.T + bias).detach()
    expected_lp, expected_entropy = token_logprobs_and_entropy(raw, ids, 0.9, 0.8, 3.0)
    lp, entropy = linear_token_logprobs(
        hidden.detach(),
        weight.detach(),
        ids,
        bias.detach(),
        0.9,
        return_entropy=True,
        backend=backend,
        logit_scale=0.8,
        logit_softcap=3.0,
    )
    assert_close("logps", expected_lp, lp, atol=1e-5, rtol=1e-5)
    assert_close("entropy", expected_entropy, entropy, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "name, value",
    [("logit_scale", 0.0), ("logit_scale", -1.0), ("logit_softcap", 0.0), ("logit_softcap", float("nan"))],
)
def test_a_transform_that_is_not_positive_is_refused_by_name(name, value):
    with pytest.raises((ValueError, TypeError), match=name):  # TypeError: not a finite number
        GRPOOptions(**{name: value})


def test_the_scale_is_folded_into_the_kernels_temperature_and_cap():
    """cap(s x) / tau = (C / s) tanh(x / (C / s)) / (tau / s): the kernels see one temperature and one cap."""
    opts = GRPOOptions(temperature=0.7, logit_scale=0.25, logit_softcap=30.0)
    assert opts.kernel_temperature == pytest.approx(0.7 / 0.25) and opts.kernel_softcap == pytest.approx(120.0)
    assert GRPOOptions(logit_scale=2.0).kernel_softcap is None
