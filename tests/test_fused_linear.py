"""The fused lm_head path against the materialized one: values, d hidden, d weight, d bias, across options."""

import pytest
import torch
from helpers import assert_close, make_batch

from grpo_kernels import FusedLinearGRPOLoss, fused_linear_grpo_loss, grpo_loss_reference

BACKENDS = ["torch", "triton"]
B, T, H, V = 3, 5, 37, 203  # odd H and V: every tile has a ragged edge


def _inputs(device, dtype=torch.float32, seed=0, **batch_kw):
    g = torch.Generator().manual_seed(seed)
    batch = make_batch(B=B, T=T, V=V, device=device, seed=seed, **batch_kw)
    del batch["logits"]
    hidden = torch.randn(B, T, H, generator=g).to(device=device, dtype=dtype)
    weight = (0.3 * torch.randn(V, H, generator=g)).to(device=device, dtype=dtype)
    bias = (0.1 * torch.randn(V, generator=g)).to(device=device, dtype=dtype)
    return batch, hidden, weight, bias


def _run(fn, batch, hidden, weight, bias, freeze_weight=False, **options):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_(not freeze_weight)
    b = None if bias is None else bias.detach().clone().requires_grad_(not freeze_weight)
    out = fn(h, w, b, batch, options)
    out.loss.backward()
    return out, h.grad, w.grad, None if b is None else b.grad


def fused(backend):
    return lambda h, w, b, batch, options: fused_linear_grpo_loss(h, w, **batch, bias=b, backend=backend, **options)


def materialized(h, w, b, batch, options):
    logits = h @ w.T if b is None else h @ w.T + b
    return grpo_loss_reference(logits, **batch, **options)


def check(backend, batch, hidden, weight, bias, tol=dict(atol=1e-5, rtol=1e-5), freeze_weight=False, **options):
    # the expected values: fp32 math on the same (possibly 16-bit) values, gradients cast back
    up = lambda t: None if t is None else t.float()  # noqa: E731
    expected = _run(materialized, batch, up(hidden), up(weight), up(bias), freeze_weight, **options)
    expected = expected[:1] + tuple(None if e is None else e.to(hidden.dtype) for e in expected[1:])
    actual = _run(fused(backend), batch, hidden, weight, bias, freeze_weight, **options)
    assert_close("loss", expected[0].loss, actual[0].loss, **tol)
    active = batch["completion_mask"] != 0
    assert_close("per_token_logps", expected[0].per_token_logps[active], actual[0].per_token_logps[active], **tol)
    for name in expected[0].metrics:
        assert_close(name, expected[0].metrics[name], actual[0].metrics[name], **tol)
    for name, e, a in zip(("d hidden", "d weight", "d bias"), expected[1:], actual[1:]):
        if e is None:
            assert a is None, name
        else:
            assert a.dtype == e.dtype
            scale = e.float().abs().max().item()
            assert_close(name, e, a, atol=tol["atol"] * max(scale, 1.0), rtol=tol["rtol"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type, level", [("grpo", "token"), ("dapo", "token"), ("cispo", "token"),
                                              ("sapo", "sequence"), ("bnpo", "sequence")])
def test_matches_materialized_logits(device, backend, loss_type, level):
    batch, hidden, weight, bias = _inputs(device)
    options = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, temperature=0.8)
    if loss_type == "cispo":
        options["epsilon_high"] = 1.1
    check(backend, batch, hidden, weight, bias, **options)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_bias_per_token_advantages_and_importance_weights(device, backend):
    batch, hidden, weight, _ = _inputs(device, seed=1, per_token_adv=True)
    batch["importance_weights"] = torch.rand(B, device=device) + 0.5
    check(backend, batch, hidden, weight, None, beta=0.1, delta=1.5, dual_clip=3.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_weight_gets_no_gradient(device, backend):
    batch, hidden, weight, bias = _inputs(device, seed=2)
    check(backend, batch, hidden, weight, bias, freeze_weight=True, beta=0.04)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16(device, backend):
    """bf16 inputs against fp32 math on the same values: the gradients are rounded to bf16, and the
    Triton path feeds bf16-rounded dlogits to its products, so the tolerance is 2^-6 of the largest
    gradient entry (the loss and log-probs stay at fp32 accuracy: the logits are fp32)."""
    batch, hidden, weight, bias = _inputs(device, dtype=torch.bfloat16, seed=3)
    check(backend, batch, hidden, weight, bias, tol=dict(atol=1.6e-2, rtol=1.6e-2), beta=0.04)


def test_module_and_bad_input(device):
    batch, hidden, weight, bias = _inputs(device)
    loss_fn = FusedLinearGRPOLoss(beta=0.04, backend="torch")
    assert torch.isfinite(loss_fn(hidden, weight, **batch, bias=bias).loss)
    with pytest.raises(ValueError, match=r"weight must be the lm_head weight \[V, H\] with H = 37, got \(203, 36\)"):
        loss_fn(hidden, weight[:, :36], **batch)
    with pytest.raises(ValueError, match=r"hidden_states must be \[B, T, H\]"):
        loss_fn(hidden[0], weight, **batch)
    with pytest.raises(ValueError, match=r"bias must be \[V\]"):
        loss_fn(hidden, weight, **batch, bias=bias[:5])
    with pytest.raises(ValueError, match=r"completion_ids must lie in \[0, V\) = \[0, 203\)"):
        loss_fn(hidden, weight, **dict(batch, completion_ids=batch["completion_ids"] + 500))


def test_torch_path_works_in_bounded_chunks(monkeypatch):
    from grpo_kernels import torch_path

    monkeypatch.setattr(torch_path, "CHUNK_ELEMENTS", 450)  # two tokens of V = 203 per chunk
    batch, hidden, weight, bias = _inputs("cpu", seed=4)
    check("torch", batch, hidden, weight, bias, beta=0.04)
