"""Our losses against Liger-Kernel's, where Liger implements the same loss: value and every gradient.

Liger is a peer, not the specification; agreeing with it is a second, independent check of
the conventions (ratio, clipping, k3 KL, each loss_type's reduction) on the paths users
compare us with: ``LigerFusedLinearGRPOLoss`` (from hidden states, run eagerly here) and
``triton_grpo_loss`` (from logits, in Triton's interpreter on a CPU machine).
"""

import pytest
import torch
from helpers import assert_close

from grpo_kernels import fused_linear_grpo_loss, grpo_loss

pytest.importorskip("liger_kernel")  # CI installs it (scripts/setup.sh); skipped only where absent

B, T, H, V = 3, 6, 24, 101
TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = 0.4 * torch.randn(V, H, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[0, 4:] = 0
    with torch.no_grad():
        lp = torch.log_softmax(hidden @ weight.T / 0.7, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    old = lp + 0.3 * torch.randn(B, T, generator=g)
    ref = lp + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    return {
        k: v.to(device)
        for k, v in dict(hidden=hidden, weight=weight, ids=ids, mask=mask, old=old, ref=ref, adv=adv).items()
    }


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_fused_linear_matches_liger_fused_linear_grpo_loss(device, backend, loss_type, level):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    x = _inputs(device)
    options = dict(
        beta=0.04, loss_type=loss_type, temperature=0.7, importance_sampling_level=level, max_completion_length=T
    )
    liger = LigerFusedLinearGRPOLoss(
        compiled=False, epsilon_low=0.2, epsilon_high=0.28, **{k: v for k, v in options.items()}
    )
    results = []
    for run in ("liger", "ours"):
        h, w = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
        if run == "liger":
            loss = liger(
                h, w, x["ids"], x["mask"], x["adv"], ref_per_token_logps=x["ref"], old_per_token_logps=x["old"]
            )[0]
        else:
            loss = fused_linear_grpo_loss(
                h,
                w,
                x["ids"],
                x["mask"],
                x["adv"],
                x["old"],
                x["ref"],
                backend=backend,
                epsilon=0.2,
                epsilon_high=0.28,
                **options,
            ).loss
        loss.backward()
        results.append((loss, h.grad, w.grad))
    for name, expected, actual in zip(("loss", "d hidden", "d weight"), *results, strict=True):
        assert_close(name, expected, actual, **TOL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_logits_path_matches_liger_triton_grpo_loss(device, backend):
    """Liger's kernel takes the [B, T + 1, V] logits (the last position predicts nothing) and reduces
    with grpo's per-sequence mean."""
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    x = _inputs(device, seed=1)
    full = torch.randn(B, T + 1, V, generator=torch.Generator().manual_seed(2)).to(device)
    expected_grad = actual_grad = None
    losses = []
    for run in ("liger", "ours"):
        leaf = full.clone().requires_grad_()
        if run == "liger":
            loss = triton_grpo_loss(
                leaf,
                x["old"],
                x["ref"],
                x["ids"],
                x["adv"],
                x["mask"],
                temperature=0.7,
                beta=0.04,
                eps_low=0.2,
                eps_high=0.2,
                loss_type="grpo",
                reduce=True,
            )[0]
        else:
            loss = grpo_loss(
                leaf[:, :-1],
                x["ids"],
                x["mask"],
                x["adv"],
                x["old"],
                x["ref"],
                beta=0.04,
                temperature=0.7,
                backend=backend,
            ).loss
        (grad,) = torch.autograd.grad(loss, leaf)
        losses.append(loss)
        expected_grad, actual_grad = (grad, actual_grad) if run == "liger" else (expected_grad, grad)
    assert_close("loss", losses[0], losses[1], **TOL)
    assert_close("dlogits", expected_grad, actual_grad, **TOL)
