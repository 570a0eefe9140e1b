"""The loss families other trainers run (``grpo_kernels/policy_terms.py``: DPPO-TV / -KL, GPG, GMPO, DRO, Clip-Cov,
KL-Cov) through ``grpo_loss`` and ``fused_linear_grpo_loss``: against the specification on both backends (the loss,
d logits / d hidden / d weight, the log-probs and every metric; fp32 tight, bf16 within its rounding), against
verl's own functions on the same log-probs, and Clip-Cov / KL-Cov's selection over the whole batch of two
processes equal to one process's over the concatenated batch."""

import pytest
import torch
from gloo_ranks import run_ranks
from helpers import assert_close, make_batch

from grpo_kernels import GRPOOptions, fused_linear_grpo_loss, grpo_loss, grpo_loss_reference
from grpo_kernels.options import LOSS_TYPE_REGISTRY

FAMILIES = tuple(
    name
    for name, t in LOSS_TYPE_REGISTRY.items()
    if t.policy_term
    in (
        "tv_trust_region",
        "kl_trust_region",
        "log_prob",
        "geometric_mean",
        "log_ratio_penalty",
        "covariance_clip",
        "covariance_kl",
    )
)
# each family's options: DPPO's ratio cap, DRO's beta, Clip-Cov / KL-Cov choosing about a quarter of the tokens
OPTIONS = {
    "dppo_tv": dict(delta=3.0, log_ratio_clamp=20.0, epsilon=0.05, epsilon_high=0.08),
    "dppo_kl": dict(delta=3.0, epsilon=0.01, epsilon_high=0.02),
    "gmpo": dict(epsilon=0.3, epsilon_high=0.3),
    "dro": dict(dro_beta=0.3),
    "clip_cov": dict(clip_cov_ratio=0.25, clip_cov_lb=-2.0, clip_cov_ub=2.0),
    "kl_cov": dict(kl_cov_ratio=0.25, kl_cov_coef=0.5),
}
FP32 = dict(atol=1e-6, rtol=1e-5)


def _batch(seed=0, B=4, T=6, V=301, per_token_adv=True, dtype=torch.float32):
    """make_batch's inputs with each target's logit raised by 3 to 12, so that token probabilities spread over
    (0, 1) (DPPO compares probabilities), and old log-probs near them on both sides; rollout weights."""
    batch = make_batch(B=B, T=T, V=V, seed=seed, per_token_adv=per_token_adv)
    g = torch.Generator().manual_seed(seed + 1)
    ids = batch["completion_ids"]
    logits = batch["logits"].clone()
    logits.scatter_add_(-1, ids.unsqueeze(-1), 3 + 9 * torch.rand(B, T, 1, generator=g))
    lp = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    batch["logits"] = logits.to(dtype)
    batch["old_logps"] = torch.clamp(lp + 0.4 * torch.randn(B, T, generator=g), max=-1e-4)
    batch["ref_logps"] = lp + 0.3 * torch.randn(B, T, generator=g)
    batch["importance_weights"] = 0.5 + torch.rand(B, T, generator=g)
    return batch


def _run(fn, batch, leaf="logits", seed=1234, **options):
    inputs = {k: (v.detach().clone().requires_grad_() if k == leaf else v) for k, v in batch.items()}
    torch.manual_seed(seed)  # Clip-Cov's draw: the same state of torch's default generator on each path
    out = fn(**inputs, **options)
    out.loss.backward()
    return out, inputs[leaf].grad


def _check(expected, actual, expected_grad, actual_grad, mask, tol=FP32, grad_tol=FP32):
    assert torch.isfinite(actual.loss)
    assert_close("loss", expected.loss, actual.loss, **tol)
    assert_close("gradient", expected_grad, actual_grad, **grad_tol)
    active = mask != 0
    assert_close("log-probs", expected.per_token_logps[active], actual.per_token_logps[active], atol=1e-5, rtol=1e-5)
    assert sorted(expected.metrics) == sorted(actual.metrics)
    for name, value in expected.metrics.items():
        assert_close(f"metric {name}", value, actual.metrics[name], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("loss_type", FAMILIES)
def test_family_from_logits_matches_reference(loss_type, backend):
    batch = _batch(seed=len(loss_type))
    options = dict(loss_type=loss_type, beta=0.04, temperature=0.9, **OPTIONS.get(loss_type, {}))
    expected, expected_grad = _run(grpo_loss_reference, batch, **options)
    actual, actual_grad = _run(grpo_loss, batch, backend=backend, **options)
    _check(expected, actual, expected_grad, actual_grad, batch["completion_mask"])


@pytest.mark.parametrize("loss_type", FAMILIES)
def test_family_with_per_row_advantages_and_a_token_count(loss_type):
    batch = _batch(seed=7, per_token_adv=False)
    options = dict(loss_type=loss_type, **OPTIONS.get(loss_type, {}))
    if LOSS_TYPE_REGISTRY[loss_type].takes_normalizer:
        options["normalizer"] = torch.tensor(23.0)
    expected, expected_grad = _run(grpo_loss_reference, batch, **options)
    actual, actual_grad = _run(grpo_loss, batch, backend="triton", **options)
    _check(expected, actual, expected_grad, actual_grad, batch["completion_mask"])


def _hidden_batch(seed, H=16):
    """Hidden states and a head weight whose logits are _batch's kind (targets raised), and the logits path's
    inputs for the reference."""
    batch = _batch(seed=seed, V=97)
    g = torch.Generator().manual_seed(seed + 2)
    B, T = batch["completion_ids"].shape
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(97, H, generator=g) * 0.5
    # the targets' rows of the weight along their hidden state: their logits rise as _batch's do
    boost = 0.6 * torch.rand(B, T, 1, generator=g) * hidden / hidden.norm(dim=-1, keepdim=True)
    weight = weight.index_add(0, batch["completion_ids"].reshape(-1), boost.reshape(-1, H))
    batch.pop("logits")
    return batch, hidden, weight


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("loss_type", FAMILIES)
def test_family_from_hidden_states_matches_reference(loss_type, backend):
    batch, hidden, weight = _hidden_batch(seed=len(loss_type))
    options = dict(loss_type=loss_type, beta=0.04, **OPTIONS.get(loss_type, {}))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    torch.manual_seed(1234)
    actual = fused_linear_grpo_loss(h, w, **batch, backend=backend, **options)
    actual.loss.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    torch.manual_seed(1234)
    expected = grpo_loss_reference(h2 @ w2.T, **batch, **options)
    expected.loss.backward()
    _check(expected, actual, h2.grad, h.grad, batch["completion_mask"], grad_tol=dict(atol=2e-6, rtol=1e-5))
    assert_close("d weight", w2.grad, w.grad, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("loss_type", FAMILIES)
def test_family_in_bf16(loss_type):
    """bf16 logits: the log-probs are fp32 from bf16 inputs, the gradient is bf16 (within two of its ulps of the
    fp32 specification on the same values)."""
    batch = _batch(seed=3, dtype=torch.bfloat16)
    options = dict(loss_type=loss_type, **OPTIONS.get(loss_type, {}))
    reference_batch = {**batch, "logits": batch["logits"].float()}
    expected, expected_grad = _run(grpo_loss_reference, reference_batch, **options)
    actual, actual_grad = _run(grpo_loss, batch, backend="triton", **options)
    assert actual_grad.dtype == torch.bfloat16
    _check(
        expected,
        actual,
        expected_grad,
        actual_grad.float(),
        batch["completion_mask"],
        tol=dict(atol=1e-5, rtol=1e-5),
        grad_tol=dict(atol=1e-4, rtol=2 * 2**-8),
    )


def test_the_families_options_bind():
    """The inputs exercise what each family selects: DPPO's regions leave some tokens out and keep others, Clip-Cov
    and KL-Cov choose several tokens, GMPO clips on both sides."""
    batch = _batch(seed=0)
    seen = {t: grpo_loss(**batch, backend="torch", loss_type=t, **OPTIONS[t]).metrics for t in OPTIONS if t != "dro"}
    assert 0 < seen["dppo_tv"]["dppo/masked_mean"] < 1 and 0 < seen["dppo_kl"]["dppo/masked_mean"] < 1
    assert seen["clip_cov"]["clip_cov/selected_mean"] > 0.1 and seen["kl_cov"]["kl_cov/selected_mean"] > 0.1
    assert seen["gmpo"]["clip_ratio/low_mean"] > 0 and seen["gmpo"]["clip_ratio/high_mean"] > 0


VERL_MODES = {
    "dppo_tv": "dppo_tv",
    "dppo_kl": "dppo_kl",
    "gpg": "gpg",
    "gmpo": "geo_mean",
    "dro": "dro",
    "clip_cov": "clip_cov",
    "kl_cov": "kl_cov",
}


@pytest.mark.parametrize("loss_type", FAMILIES)
def test_family_equals_verls_loss_on_the_same_logits(loss_type):
    """grpo_loss (from logits, on our kernel) against verl's own policy loss on verl's log-probs of the same logits
    (``logprobs_from_logits``), d logits included: verl's settings as our options, its token-mean as our token
    count (gmpo: verl's mean over rows, our row mean)."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed")
    from verl.utils.torch_functional import logprobs_from_logits
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    batch = _batch(seed=11)
    batch.pop("ref_logps")
    weights = batch.pop("importance_weights")
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=2,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        policy_loss=PolicyLossConfig(
            loss_mode=VERL_MODES[loss_type],
            dro_beta=0.3,
            clip_cov_ratio=0.25,
            clip_cov_lb=-2.0,
            clip_cov_ub=2.0,
            kl_cov_ratio=0.25,
            ppo_kl_coef=0.5,
        ),
    )
    ours = dict(
        loss_type=loss_type,
        epsilon=0.2,
        epsilon_high=0.28,
        dro_beta=0.3,
        clip_cov_ratio=0.25,
        clip_cov_lb=-2.0,
        clip_cov_ub=2.0,
        kl_cov_ratio=0.25,
        kl_cov_coef=0.5,
        covariance_selection="micro_batch",
        compute_entropy=False,
    )
    if loss_type.startswith("dppo"):
        ours.update(delta=3.0, log_ratio_clamp=20.0)
    logits = batch["logits"].clone().requires_grad_()
    mask = batch["completion_mask"]
    lp = logprobs_from_logits(logits, batch["completion_ids"])
    torch.manual_seed(99)
    expected, _ = core_algos.get_policy_loss_fn(VERL_MODES[loss_type])(
        batch["old_logps"], lp, batch["advantages"], mask, "token-mean", config, weights
    )
    (expected_grad,) = torch.autograd.grad(expected, logits)
    actual, actual_grad = _run(grpo_loss, {**batch, "importance_weights": weights}, seed=99, backend="triton", **ours)
    assert_close("loss", expected, actual.loss, atol=1e-6, rtol=1e-5)
    assert_close("d logits", expected_grad, actual_grad, atol=1e-6, rtol=1e-5)


def test_refusals_name_the_option():
    with pytest.raises(ValueError, match="dro_beta"):
        GRPOOptions(loss_type="dro")
    with pytest.raises(ValueError, match="importance_sampling_level in \\['token'\\]"):
        GRPOOptions(loss_type="gmpo", importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="cispo_ratio_min .* loss_type='cispo'"):
        GRPOOptions(loss_type="grpo", cispo_ratio_min=0.8)
    with pytest.raises(ValueError, match="covariance_selection must be one of"):
        GRPOOptions(loss_type="kl_cov", covariance_selection="global")
    with pytest.raises(ValueError, match="delta applies to"):
        GRPOOptions(loss_type="gpg", delta=2.0)
    with pytest.raises(TypeError, match="'kl_cov_coef' \\(another trainer's name for it\\)"):
        GRPOOptions(loss_type="kl_cov", ppo_kl_coef=0.5)


# ---- Clip-Cov and KL-Cov over the whole batch of two processes ---------------------------------------------------


def _half_rank(rank, world, loss_type, batch, normalizer):
    """This rank's half of the rows; the loss divided by the whole batch's tokens, so that the ranks' losses add
    up to the one-process loss."""
    rows = slice(rank * 2, rank * 2 + 2)
    half = {k: v[rows] for k, v in batch.items()}
    out, grad = _run(
        grpo_loss, half, seed=1234, backend="torch", loss_type=loss_type, normalizer=normalizer, **OPTIONS[loss_type]
    )
    return out.loss.detach(), grad, out.metrics


@pytest.mark.parametrize("loss_type", ["clip_cov", "kl_cov"])
def test_covariance_selection_over_two_processes_equals_one(loss_type):
    batch = _batch(seed=5)
    tokens = batch["completion_mask"].sum()
    whole, whole_grad = _run(
        grpo_loss, batch, seed=1234, backend="torch", loss_type=loss_type, normalizer=tokens, **OPTIONS[loss_type]
    )
    (l0, g0, m0), (l1, g1, m1) = run_ranks(_half_rank, 2, loss_type, batch, tokens)
    assert_close("loss", whole.loss, l0 + l1, **FP32)
    assert_close("gradient", whole_grad, torch.cat([g0, g1]), **FP32)
    name = f"{loss_type}/selected_mean"
    halves = batch["completion_mask"][:2].sum(), batch["completion_mask"][2:].sum()
    assert_close(name, whole.metrics[name], (m0[name] * halves[0] + m1[name] * halves[1]) / tokens, **FP32)
    assert whole.metrics[name] > 0.1
