"""The entropy bonus (TRL's ``entropy_coef``): loss - coef * mean entropy over the active tokens.

Its gradient goes into the kernels' backward formula: in the one-pass kernel (each token's
dLoss/dH is known up front, like dLoss/dlogp), in the two-pass backward kernel and in the torch
path (the entropy is a differentiable output there). Every path is checked against autograd of
the reference in fp64, for the loss value and the gradient of the logits.
"""

import pytest
import torch
from helpers import assert_close, check_lm_head_against_reference, make_batch

from grpo_kernels import GRPOOptions, grpo_loss, grpo_loss_reference
from grpo_kernels.reference import token_logprobs_and_entropy

TOL = dict(atol=2e-6, rtol=1e-5)
# (backend, one_pass): the torch path, the one-pass kernel, the two-pass kernels
PATHS = [("torch", None), ("triton", True), ("triton", False)]


def _fp64_reference(batch, **options):
    """(loss, d loss / d logits) of the reference, computed in fp64 from the same values."""
    logits = batch["logits"].detach().double().requires_grad_()
    up = {
        k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "completion_mask" else v)
        for k, v in batch.items()
        if k != "logits"
    }
    out = grpo_loss_reference(logits, **up, **options)
    out.loss.backward()
    return out.loss.detach(), logits.grad


def _ours(batch, backend, one_pass, **kwargs):
    logits = batch["logits"].detach().clone().requires_grad_()
    out = grpo_loss(
        logits, **{k: v for k, v in batch.items() if k != "logits"}, backend=backend, one_pass=one_pass, **kwargs
    )
    out.loss.backward()
    return out, logits.grad


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
@pytest.mark.parametrize("backend, one_pass", PATHS)
def test_entropy_bonus_matches_the_fp64_reference(device, backend, one_pass, loss_type, level):
    batch = make_batch(device=device, seed=21, V=1003)
    options = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=0.04,
        temperature=0.8,
        entropy_coef=0.05,
        **({"epsilon_high": 1.1} if loss_type == "cispo" else {}),
    )
    expected_loss, expected_grad = _fp64_reference(batch, **options)
    out, grad = _ours(batch, backend, one_pass, **options)
    assert_close("loss", expected_loss, out.loss, **TOL)
    assert_close("dlogits", expected_grad, grad, **TOL)


@pytest.mark.parametrize("normalizer", [None, 17.0], ids=["local tokens", "normalizer"])
@pytest.mark.parametrize("backend, one_pass", PATHS)
def test_an_entropy_bonus_divided_as_the_loss_is_matches_the_fp64_reference(device, backend, one_pass, normalizer):
    """``entropy_reduction="loss"`` (OpenRLHF's entropy loss: aggregate_loss with its global token count): the
    bonus's sum divided by the token-count loss's normalizer (else the active tokens), on every path."""
    batch = make_batch(device=device, seed=23, V=1003)
    options = dict(loss_type="dapo", beta=0.04, entropy_coef=0.05, entropy_reduction="loss")
    expected_loss, expected_grad = _fp64_reference(dict(batch, normalizer=normalizer), **options)
    out, grad = _ours(dict(batch, normalizer=normalizer), backend, one_pass, **options)
    assert_close("loss", expected_loss, out.loss, **TOL)
    assert_close("dlogits", expected_grad, grad, **TOL)
    with pytest.raises(
        ValueError,
        match=r"entropy_reduction='loss' .* loss_type in \['dapo', 'cispo', 'vespo', 'dppo_tv', 'dppo_kl', 'gpg', "
        r"'dro', 'clip_cov', 'kl_cov'\], "
        r"got loss_type='grpo'",
    ):
        GRPOOptions(loss_type="grpo", entropy_coef=0.05, entropy_reduction="loss")


@pytest.mark.parametrize("backend, one_pass", PATHS)
def test_the_entropy_gradient_alone_is_autograd_of_the_fp64_entropy(device, backend, one_pass):
    """Zero advantages and no KL leave only the bonus: dlogits = -coef * d mean(H) / dlogits."""
    batch = make_batch(device=device, seed=22, V=517, off_policy=False)
    batch["advantages"] = torch.zeros_like(batch["advantages"])
    coef = 0.3
    _, grad = _ours(batch, backend, one_pass, entropy_coef=coef, temperature=0.7, loss_scale=0.5)

    logits = batch["logits"].detach().double().requires_grad_()
    _, entropy = token_logprobs_and_entropy(logits, batch["completion_ids"], 0.7)
    mask = batch["completion_mask"].double()
    (-coef * 0.5 * (entropy * mask).sum() / mask.sum()).backward()
    assert_close("dlogits", logits.grad, grad, **TOL)
    assert torch.count_nonzero(grad[-1]) == 0, "a fully masked row gets no gradient"


@pytest.mark.parametrize("backend, one_pass", PATHS)
def test_entropy_bonus_with_a_minus_inf_logit_has_a_finite_gradient(device, backend, one_pass):
    """A vocabulary entry masked to -inf has p = 0 and log p = -inf: its gradient is 0, not NaN."""
    batch = make_batch(device=device, seed=23, V=300)
    batch["logits"][0, 1, 7] = float("-inf")
    batch["logits"][1, :, 299] = float("-inf")  # in the last, partial block of every row
    expected_loss, expected_grad = _fp64_reference(batch, entropy_coef=0.1, beta=0.04)
    out, grad = _ours(batch, backend, one_pass, entropy_coef=0.1, beta=0.04)
    assert torch.isfinite(grad).all()
    assert_close("loss", expected_loss, out.loss, **TOL)
    assert_close("dlogits", expected_grad, grad, **TOL)
    assert grad[0, 1, 7] == 0 and torch.count_nonzero(grad[1, :, 299]) == 0


@pytest.mark.parametrize("backend, one_pass", [("triton", False), ("torch", None)])
def test_entropy_bonus_in_place_and_with_the_full_logits(device, backend, one_pass):
    batch = make_batch(device=device, seed=24, V=400)
    options = dict(entropy_coef=0.2, beta=0.04)
    expected_loss, expected_grad = _fp64_reference(batch, **options)
    B, T, V = batch["logits"].shape
    leaf = torch.cat([batch["logits"], torch.randn(B, 1, V, device=device)], 1).requires_grad_()
    given = leaf * 1.0  # in place overwrites the tensor it is given: a model output, not a leaf
    out = grpo_loss(
        given,
        **{k: v for k, v in batch.items() if k != "logits"},
        backend=backend,
        one_pass=one_pass,
        in_place_backward=True,
        drop_last_position=True,
        **options,
    )
    out.loss.backward()
    assert_close("loss", expected_loss, out.loss, **TOL)
    assert_close("dlogits", expected_grad, leaf.grad[:, :-1], **TOL)
    assert torch.count_nonzero(leaf.grad[:, -1]) == 0


@pytest.mark.parametrize("backend, one_pass", PATHS)
def test_entropy_bonus_on_bf16_logits(device, backend, one_pass):
    """Values in fp32 from the same bf16 logits; only the gradient's final cast to bf16 differs."""
    batch = make_batch(device=device, seed=25, V=700, dtype=torch.bfloat16)
    expected_loss, expected_grad = _fp64_reference(batch, entropy_coef=0.1, beta=0.04)
    out, grad = _ours(batch, backend, one_pass, entropy_coef=0.1, beta=0.04)
    assert grad.dtype == torch.bfloat16
    assert_close("loss", expected_loss, out.loss, **TOL)
    assert_close("dlogits", expected_grad.to(torch.bfloat16), grad, atol=1e-7, rtol=2**-7)


def test_entropy_coef_needs_the_entropy():
    with pytest.raises(ValueError, match="entropy_coef=0.1 needs the entropy: compute_entropy=False turns it off"):
        GRPOOptions(entropy_coef=0.1, compute_entropy=False)
    with pytest.raises(TypeError, match="entropy_coef must be a finite number, got nan"):
        GRPOOptions(entropy_coef=float("nan"))


@pytest.mark.parametrize(
    "backend, lm_head_mode", [("torch", None), ("triton", "recompute"), ("triton", "three_products")]
)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_entropy_bonus_from_hidden_states(device, backend, lm_head_mode, level):
    """The lm_head paths: the recomputing dlogits kernel, the 3-product mode (the one-pass logits kernel
    on each chunk) and the torch path, against autograd of the reference on materialized logits."""
    g = torch.Generator().manual_seed(27)
    hidden = torch.randn(3, 5, 20, generator=g).to(device)
    weight = (0.5 * torch.randn(333, 20, generator=g)).to(device)
    batch = make_batch(device=device, seed=28, V=333)
    inputs = {k: v for k, v in batch.items() if k != "logits"}
    options = dict(entropy_coef=0.2, beta=0.04, temperature=0.8, importance_sampling_level=level)
    check_lm_head_against_reference(
        hidden, weight, inputs, backend=backend, lm_head_mode=lm_head_mode, options=options, fp64=True, tol=TOL
    )


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_token_entropy_and_the_pair_are_differentiable(device, backend):
    """token_entropy and selective_log_softmax_and_entropy on any leading shape, against autograd in fp64."""
    from grpo_kernels import selective_log_softmax_and_entropy, token_entropy

    g = torch.Generator().manual_seed(29)
    logits = (3 * torch.randn(2, 3, 7, 301, generator=g)).to(device)
    index = torch.randint(0, 301, (2, 3, 7), generator=g).to(device)
    w_lp, w_h = torch.randn(2, 3, 7, generator=g).to(device), torch.randn(2, 3, 7, generator=g).to(device)
    x = logits.double().requires_grad_()
    lp_all = torch.log_softmax(x / 0.8, -1)
    lp = lp_all.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    h = -(lp_all.exp() * lp_all).sum(-1)
    (g_h,) = torch.autograd.grad((h * w_h).sum(), x, retain_graph=True)
    (g_both,) = torch.autograd.grad((h * w_h + lp * w_lp).sum(), x)

    ours = logits.clone().requires_grad_()
    entropy = token_entropy(ours, 0.8, backend=backend)
    assert entropy.shape == (2, 3, 7) and entropy.dtype == torch.float32
    (grad,) = torch.autograd.grad((entropy * w_h).sum(), ours)
    assert_close("entropy", h, entropy, **TOL)
    assert_close("d entropy / d logits", g_h, grad, atol=1e-5, rtol=1e-5)
    lp_ours, h_ours = selective_log_softmax_and_entropy(ours, index, 0.8, backend=backend)
    (grad,) = torch.autograd.grad((h_ours * w_h + lp_ours * w_lp).sum(), ours)
    assert_close("log-probs", lp, lp_ours, **TOL)
    # fp32 on logits / tau up to about 15: log p reaches -40, and p (log p + H) cancels to ~1e-5 absolute
    assert_close("d (both) / d logits", g_both, grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "masks",
    [{}, {"top_entropy_quantile": 0.5}, {"off_policy_mask_threshold": 0.1}],
    ids=["no mask", "high-entropy", "off-policy"],
)
@pytest.mark.parametrize("backend, one_pass", PATHS)
def test_policy_loss_metric_is_the_loss_before_the_bonus(device, backend, one_pass, masks):
    """TRL's ``policy_loss`` (logged with the bonus on): the reduced loss before the bonus and before loss_scale,
    the reference's, on every path; with the high-entropy mask the bonus's entropy is its tokens' mean."""
    batch = make_batch(device=device, seed=24, V=517)
    options = dict(loss_type="grpo", beta=0.04, entropy_coef=0.2, **masks)
    expected = grpo_loss_reference(
        batch["logits"].double(),
        **{
            k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "completion_mask" else v)
            for k, v in batch.items()
            if k != "logits"
        },
        **options,
    )
    out, _ = _ours(batch, backend, one_pass, loss_scale=0.25, **options)
    assert_close("policy_loss", expected.metrics["policy_loss"], out.metrics["policy_loss"], **TOL)
    assert float(expected.metrics["policy_loss"] - expected.loss) > 1e-3, "the bonus moved the loss"
    assert "policy_loss" not in grpo_loss(**batch, backend=backend, beta=0.04).metrics
