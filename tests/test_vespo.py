"""VESPO (TRL's loss_type="vespo"): loss -phi(w) * A * log pi per token, phi detached, a token-count reduction.

phi(w) = e^lambda * w^k * e^(-lambda w) of the row's sequence importance ratio w (phi(1) = 1),
with k and lambda chosen by the advantage's sign. The weight is checked against that formula
written directly (not in TRL's log space); the loss, gradient and metric of every path against
the reference; stock TRL is the oracle in tests/test_trl_integration.py.
"""

import math

import pytest
import torch
from helpers import assert_close, make_batch

from grpo_kernels import GRPOOptions, fused_linear_grpo_loss, grpo_loss, grpo_loss_reference
from grpo_kernels.objective import vespo_weights

TOL = dict(atol=2e-6, rtol=1e-5)


def test_the_weight_is_the_gamma_formula():
    opts = GRPOOptions(loss_type="vespo", vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)
    log_ratio = torch.tensor([[0.1, -0.3, 0.2, 9.0], [0.0, 0.0, 0.0, 0.0], [-0.2, 0.05, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    advantages = torch.tensor([[0.5], [-1.0], [-0.2]])
    phi = vespo_weights(advantages, log_ratio, mask, None, opts)
    for row in range(3):
        w = math.exp(float((log_ratio[row] * mask[row]).sum()))  # the masked position's 9.0 never counts
        k, lam = (2.0, 3.0) if advantages[row, 0] >= 0 else (3.0, 2.0)
        expected = math.exp(lam) * w**k * math.exp(-lam * w)
        assert phi[row, 0].item() == pytest.approx(expected, rel=1e-6)
    assert phi[1, 0].item() == pytest.approx(1.0)  # phi(1) = 1: on-policy rows keep the plain gradient
    # a rollout importance weight multiplies w (its log is added), on active tokens only
    iw = torch.full((3, 4), 1.5)
    with_iw = vespo_weights(advantages, log_ratio, mask, iw, opts)
    w0 = math.exp(float((log_ratio[0] * mask[0]).sum()) + 3 * math.log(1.5))
    assert with_iw[0, 0].item() == pytest.approx(math.exp(3.0) * w0**2 * math.exp(-3.0 * w0), rel=1e-6)
    # an overflowing ratio (clamped to e^20) gives a vanishing weight, never NaN
    huge = vespo_weights(advantages, torch.full((3, 4), 20.0), mask, None, opts)
    assert torch.isfinite(huge).all() and (huge < 1e-30).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", ["plain", "kl_iw_bonus", "masks"])
def test_vespo_matches_the_reference(device, backend, case):
    batch = make_batch(device=device, seed=41, V=500, clip_spread=0.3)
    options = dict(loss_type="vespo", temperature=0.9)
    extra = {}
    if case == "kl_iw_bonus":
        options.update(beta=0.04, entropy_coef=0.05)
        extra["importance_weights"] = (0.8 + 0.4 * torch.rand(3, 5, generator=torch.Generator().manual_seed(1))).to(
            device
        )
    if case == "masks":
        options.update(top_entropy_quantile=0.6, off_policy_mask_threshold=0.1)
    logits = batch["logits"].detach().clone().requires_grad_()
    expected = grpo_loss_reference(logits, **{k: v for k, v in batch.items() if k != "logits"}, **extra, **options)
    expected.loss.backward()
    expected_grad = logits.grad
    logits = batch["logits"].detach().clone().requires_grad_()
    out = grpo_loss(logits, **{k: v for k, v in batch.items() if k != "logits"}, **extra, backend=backend, **options)
    out.loss.backward()
    assert_close("loss", expected.loss, out.loss, **TOL)
    assert_close("dlogits", expected_grad, logits.grad, **TOL)
    assert set(out.metrics) == set(expected.metrics) and "vespo/phi_seq_mean" in out.metrics
    for name, value in expected.metrics.items():
        assert_close(name, value, out.metrics[name], **TOL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_vespo_from_hidden_states(device, backend):
    g = torch.Generator().manual_seed(42)
    hidden = torch.randn(3, 5, 16, generator=g).to(device)
    weight = (0.3 * torch.randn(300, 16, generator=g)).to(device)
    batch = make_batch(device=device, seed=43, V=300)
    inputs = {k: v for k, v in batch.items() if k != "logits"}
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = grpo_loss_reference(h @ w.T, **inputs, loss_type="vespo", beta=0.04)
    expected.loss.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fused_linear_grpo_loss(h2, w2, **inputs, loss_type="vespo", beta=0.04, backend=backend)
    out.loss.backward()
    assert_close("loss", expected.loss, out.loss, **TOL)
    assert_close("d hidden", h.grad, h2.grad, **TOL)
    assert_close("d weight", w.grad, w2.grad, **TOL)


def test_vespo_needs_token_level_ratios():
    with pytest.raises(
        ValueError,
        match=r"loss_type='vespo' makes its own ratio from the token log-ratios: use importance_sampling_level in "
        r"\['token'\], got 'sequence'",
    ):
        GRPOOptions(loss_type="vespo", importance_sampling_level="sequence")
    with pytest.raises(TypeError, match="vespo_k_pos must be a finite number, got inf"):
        GRPOOptions(loss_type="vespo", vespo_k_pos=float("inf"))
