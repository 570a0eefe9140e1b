"""The OpenRLHF adapter against OpenRLHF 0.11.2's own functions (``tests/openrlhf_code.py``: loaded from its
wheel): ``PolicyLoss`` for every option, ``compute_approx_kl`` for every estimator, ``aggregate_loss``, and the
actor's log-probs and entropy. Values, every metric and the gradient of the log-probs (of the logits for the
actor's functions), on ragged batches with an empty row; the actor's on padded [B, L, V] and packed [1, total, V]
logits."""

import itertools
import pathlib
import sys

import pytest
import torch
from openrlhf_code import openrlhf_code

from grpo_kernels.integration import openrlhf as adapter
from grpo_kernels.loss import selective_log_softmax, token_entropy

LENGTHS = (1, 9, 4, 0, 7, 3)  # ragged, one empty row
T = max(LENGTHS)


def ragged_batch(seed=0, spread=0.5, rollout_spread=0.3):
    """OpenRLHF's loss inputs [B, T]: log-probs (with gradient), old, rollout and reference log-probs, per-token
    advantages, the action mask. Padding holds 0, as OpenRLHF's actor leaves it."""
    g = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    lp = ((-1.5 + 0.6 * torch.randn(B, T, generator=g)) * mask).requires_grad_()
    old = (lp + spread * torch.randn(B, T, generator=g)).detach() * mask
    rollout = (old + rollout_spread * torch.randn(B, T, generator=g)) * mask
    ref = (lp + 3 * spread * torch.randn(B, T, generator=g)).detach() * mask
    adv = (torch.randn(B, 1, generator=g) * 1.5).expand(B, T).clone()
    return lp, old, rollout, ref, adv, mask


def _twin(lp):
    return lp.detach().clone().requires_grad_()


BATCH_INFO = {
    "local": {},
    "two ranks": dict(dp_size=2, batch_num_tokens=torch.tensor(40.0), global_batch_size=torch.tensor(9.0)),
}
CORRECTIONS = (
    [dict()]
    + [
        dict(
            is_correction_level=level,
            is_correction_mode=mode,
            is_correction_gating="ratio",
            is_correction_threshold=[0.8, 1.25],
        )
        for level, mode in (("token", "mask"), ("token", "clip"), ("seq", "mask"))
    ]
    + [
        dict(
            is_correction_level=level,
            is_correction_mode="mask",
            is_correction_gating=gating,
            is_correction_threshold=[0.0, bound],
        )
        for level, (gating, bound) in itertools.product(("token", "seq"), (("binary_kl", 0.02), ("tv", 0.1)))
    ]
)


def _correction_id(c):
    return "off" if not c else f"{c['is_correction_level']}-{c['is_correction_mode']}-{c['is_correction_gating']}"


def _compare_policy_loss(kwargs, batch_info, seed=0):
    _, theirs_loss = openrlhf_code()
    lp, old, rollout, _, adv, mask = ragged_batch(seed)
    lp_ours = _twin(lp)
    theirs = theirs_loss.PolicyLoss(**kwargs)(lp, old, adv, mask, rollout, **batch_info)
    ours = adapter.PolicyLoss(**kwargs)(lp_ours, old, adv, mask, rollout, **batch_info)
    theirs[0].backward()
    ours[0].backward()
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lp_ours.grad, lp.grad, atol=1e-7, rtol=1e-5)
    for name, a, b in zip(("clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio"), ours[1:], theirs[1:], strict=True):
        assert (a is None) == (b is None), name
        if b is not None:
            torch.testing.assert_close(a, b.detach(), atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("batch_info", list(BATCH_INFO), ids=str)
@pytest.mark.parametrize("token_level_loss", [True, False], ids=["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("policy_loss_type", adapter.POLICY_LOSS_TYPES)
@pytest.mark.parametrize(
    "clip",
    [
        dict(),
        dict(clip_eps_low=0.2, clip_eps_high=0.28),
        dict(dual_clip=3.0),
        dict(clip_eps_low=0.1, clip_eps_high=0.3, dual_clip=2.0),
    ],
    ids=["default", "clip-higher", "dual-clip", "both"],
)
def test_policy_loss_matches_openrlhf(policy_loss_type, token_level_loss, clip, batch_info):
    _compare_policy_loss(
        dict(policy_loss_type=policy_loss_type, token_level_loss=token_level_loss, **clip), BATCH_INFO[batch_info]
    )


@pytest.mark.parametrize("correction", CORRECTIONS, ids=_correction_id)
@pytest.mark.parametrize("policy_loss_type", adapter.POLICY_LOSS_TYPES)
@pytest.mark.parametrize("token_level_loss", [True, False], ids=["token-mean", "seq-mean-token-mean"])
def test_rollout_corrections_match_openrlhf(correction, policy_loss_type, token_level_loss):
    _compare_policy_loss(
        dict(policy_loss_type=policy_loss_type, token_level_loss=token_level_loss, dual_clip=3.0, **correction),
        BATCH_INFO["two ranks"],
        seed=3,
    )


def test_the_corrections_filter_something():
    """The thresholds above bind: a correction that dropped nothing would test nothing of its gate."""
    lp, old, rollout, _, adv, mask = ragged_batch(3)
    for correction in CORRECTIONS[1:]:
        _, _, _, vllm_kl, filtered = adapter.PolicyLoss(**correction)(lp, old, adv, mask, rollout)
        assert 0 < float(filtered) < 1, _correction_id(correction)


@pytest.mark.parametrize("unbiased_gradient", [False, True], ids=["plain", "unbiased"])
@pytest.mark.parametrize("kl_estimator", adapter.KL_ESTIMATORS)
@pytest.mark.parametrize("token_level_loss", [True, False], ids=["token-mean", "seq-mean-token-mean"])
def test_kl_loss_matches_openrlhf(kl_estimator, unbiased_gradient, token_level_loss):
    """compute_approx_kl, then aggregate_loss as the actor does; the log-ratios reach past +-11 so that every
    clamp binds (k3's one-sided -10, the value's +-10, the unbiased weight's 10)."""
    theirs_utils, theirs_loss = openrlhf_code()
    lp, old, _, ref, _, mask = ragged_batch(5, spread=6.0)
    assert float((lp - ref).abs().max()) > 11
    lp_ours = _twin(lp)
    info = BATCH_INFO["two ranks"]
    theirs = theirs_loss.aggregate_loss(
        theirs_utils.compute_approx_kl(lp, ref, old, kl_estimator, unbiased_gradient), mask, token_level_loss, **info
    )
    ours = adapter.aggregate_loss(
        adapter.compute_approx_kl(lp_ours, ref, old, kl_estimator, unbiased_gradient), mask, token_level_loss, **info
    )
    theirs.backward()
    ours.backward()
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lp_ours.grad, lp.grad, atol=1e-7, rtol=1e-5)


def test_aggregate_loss_without_global_counts_matches_openrlhf():
    _, theirs_loss = openrlhf_code()
    lp, *_, mask = ragged_batch(7)
    for token_level_loss in (True, False):
        torch.testing.assert_close(
            adapter.aggregate_loss(lp, mask, token_level_loss), theirs_loss.aggregate_loss(lp, mask, token_level_loss)
        )


def test_bad_options_are_refused_by_name():
    with pytest.raises(ValueError, match="policy_loss_type must be one of"):
        adapter.PolicyLoss(policy_loss_type="grpo")
    with pytest.raises(ValueError, match="is_correction_mode='clip' clamps a per-token ratio"):
        adapter.PolicyLoss(is_correction_level="seq", is_correction_mode="clip")
    with pytest.raises(ValueError, match="bounds a divergence from above only"):
        adapter.PolicyLoss(is_correction_level="token", is_correction_gating="tv")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        adapter.PolicyLoss(dual_clip=0.5)
    with pytest.raises(ValueError, match="needs rollout_log_probs"):
        lp, old, _, _, adv, mask = ragged_batch()
        adapter.PolicyLoss(is_correction_level="token")(lp, old, adv, mask)
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        adapter.compute_approx_kl(torch.zeros(2), torch.zeros(2), kl_estimator="k4")


def _logits(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(dtype).requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_actor_log_probs_and_entropy_match_openrlhf(layout, dtype):
    """What Actor.forward calls, on what it passes: the fp32 logits (divided by the temperature) of a padded batch
    [B, L, V], or of a packed one [1, total, V] with the rolled ids. Our log-probs and entropy equal OpenRLHF's
    functions' values and gradients (bf16 logits: OpenRLHF's bf16 branch, a per-row log_softmax)."""
    theirs_utils, _ = openrlhf_code()
    V = 37
    shape = (3, 6, V) if layout == "padded" else (1, 17, V)
    logits = _logits(shape, dtype)
    ids = torch.randint(0, V, shape[:-1], generator=torch.Generator().manual_seed(1))
    ours_logits = _twin(logits)
    entropy = getattr(theirs_utils.compute_entropy, "_torchdynamo_orig_callable", theirs_utils.compute_entropy)
    weights = torch.randn(shape[:-1], generator=torch.Generator().manual_seed(2))
    theirs = theirs_utils.log_probs_from_logits(logits, ids)
    ours = selective_log_softmax(ours_logits, ids)
    (theirs.float() * weights + entropy(logits).float() * weights.flip(-1)).sum().backward()
    (ours * weights + token_entropy(ours_logits) * weights.flip(-1)).sum().backward()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(ours, theirs.float(), **tol)
    torch.testing.assert_close(token_entropy(ours_logits.detach()), entropy(logits.detach()).float(), **tol)
    torch.testing.assert_close(ours_logits.grad.float(), logits.grad.float(), **tol)


def test_use_in_openrlhf_replaces_the_names_openrlhfs_modules_hold(monkeypatch):
    """OpenRLHF's modules import these functions by name (``from .utils import log_probs_from_logits``, ...):
    ``use_in_openrlhf`` replaces them there. OpenRLHF's package cannot be imported on a CPU (flash-attn), so its
    two loss files from the wheel stand as ``openrlhf.models.utils`` / ``.loss``, and an actor module and a PPO
    actor module hold the names as OpenRLHF's do."""
    import types

    utils, loss_code = openrlhf_code()
    actor = types.ModuleType("openrlhf.models.actor")
    actor.log_probs_from_logits, actor.compute_entropy = utils.log_probs_from_logits, utils.compute_entropy
    ppo_actor = types.ModuleType("openrlhf.trainer.ray.ppo_actor")
    ppo_actor.PolicyLoss, ppo_actor.aggregate_loss = loss_code.PolicyLoss, loss_code.aggregate_loss
    ppo_actor.compute_approx_kl = utils.compute_approx_kl
    package, models = types.ModuleType("openrlhf"), types.ModuleType("openrlhf.models")
    package.models, models.utils, models.loss, models.actor = models, utils, loss_code, actor
    for name, module in {
        "openrlhf": package,
        "openrlhf.models": models,
        "openrlhf.models.utils": utils,
        "openrlhf.models.loss": loss_code,
        "openrlhf.models.actor": actor,
        "openrlhf.trainer.ray.ppo_actor": ppo_actor,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    for module, names in (
        (utils, ("log_probs_from_logits", "compute_entropy", "compute_approx_kl")),
        (loss_code, ("PolicyLoss", "aggregate_loss")),
    ):
        for name in names:
            monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    originals = (utils.log_probs_from_logits, utils.compute_entropy)

    adapter.use_in_openrlhf()
    assert ppo_actor.PolicyLoss is adapter.PolicyLoss and ppo_actor.aggregate_loss is adapter.aggregate_loss
    assert ppo_actor.compute_approx_kl is adapter.compute_approx_kl
    assert actor.log_probs_from_logits is utils.log_probs_from_logits is not originals[0]
    logits = _logits((2, 5, 19), torch.float32)
    ids = torch.randint(0, 19, (2, 5), generator=torch.Generator().manual_seed(3))
    entropy = getattr(originals[1], "_torchdynamo_orig_callable", originals[1])
    torch.testing.assert_close(actor.log_probs_from_logits(logits, ids), originals[0](logits.detach(), ids))
    torch.testing.assert_close(actor.compute_entropy(logits), entropy(logits.detach()))


# ---- Where OpenRLHF's own runs and ours once differed (issue 53) --------------------------------------------------

POLICY_MODES = {
    "token-mean": dict(),
    "seq-mean-token-mean": dict(token_level_loss=False),
    "gspo": dict(policy_loss_type="gspo"),
}


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool], ids=["float mask", "bool mask"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", list(POLICY_MODES))
def test_16_bit_log_probs_give_openrlhfs_loss_within_their_rounding_and_no_nan(mode, dtype, mask_dtype):
    """bf16 / fp16 log-probs, a mask of either dtype OpenRLHF's actor passes (its action_mask is a bool tensor), a
    batch with an empty row: our loss and aggregate_loss are fp32 sums (OpenRLHF's float mask promotes its sums to
    fp32), within the input dtype's rounding of OpenRLHF's, its gradient too; never NaN where OpenRLHF is finite
    (a 16-bit row count made the empty row's 0 + 1e-8 a 0, and its mean NaN, in fp16)."""
    _, theirs_loss = openrlhf_code()
    lp, old, _, _, adv, mask = ragged_batch(11)
    mask = mask.to(mask_dtype)
    ours_lp, theirs_lp = (lp.detach().to(dtype).requires_grad_() for _ in range(2))
    args = (old.to(dtype), adv.to(dtype), mask)
    theirs = theirs_loss.PolicyLoss(**POLICY_MODES[mode])(theirs_lp, *args, **BATCH_INFO["two ranks"])
    ours = adapter.PolicyLoss(**POLICY_MODES[mode])(ours_lp, *args, **BATCH_INFO["two ranks"])
    theirs[0].backward()
    ours[0].backward()
    eps = torch.finfo(dtype).eps
    assert torch.isfinite(theirs[0]) and torch.isfinite(ours[0]) and ours[0].dtype == torch.float32
    torch.testing.assert_close(ours[0], theirs[0].float(), atol=2 * eps * max(1.0, abs(float(theirs[0]))), rtol=0)
    scale = float(theirs_lp.grad.float().abs().max())
    torch.testing.assert_close(ours_lp.grad.float(), theirs_lp.grad.float(), atol=2 * eps * scale, rtol=0)
    for token_level_loss in (True, False):
        expected = theirs_loss.aggregate_loss(lp.detach().to(dtype), mask, token_level_loss)
        actual = adapter.aggregate_loss(lp.detach().to(dtype), mask, token_level_loss)
        assert torch.isfinite(actual) and actual.dtype == torch.float32
        torch.testing.assert_close(actual, expected.float(), atol=2 * eps * max(1.0, abs(float(expected))), rtol=0)


def test_gspo_past_exps_range_is_openrlhfs_value_where_openrlhf_has_one():
    """GSPO's ratio is exp of a row's mean log-ratio, inf past about 88.7 in fp32. A row that far off the old policy
    with a positive advantage has a finite loss: the clipped term, the minimum. OpenRLHF gives it where the row has
    no padding, though its gradient is NaN (exp's backward: 0 x inf); where the row has padding, OpenRLHF multiplies
    the inf ratio by the padding's zeros and its loss is NaN too. Decided: ours bounds the mean log-ratio within
    exp's range (``adapter.GSPO_LOG_RATIO_CLAMP``), so that on the padded batch and without padding it is OpenRLHF's
    finite value, with a finite gradient (0 on that row, whose clipped term is constant)."""
    _, theirs_loss = openrlhf_code()
    g = torch.Generator().manual_seed(12)
    B, L, pad = 3, 5, 2
    lp = -1.5 + 0.3 * torch.randn(B, L, generator=g)
    old = lp + 0.2 * torch.randn(B, L, generator=g)
    old[1] = lp[1] - 90.0  # a mean log-ratio of 90: exp overflows
    adv = torch.tensor([[0.7], [1.3], [-0.4]]).expand(B, L).contiguous()
    full = torch.ones(B, L)

    def padded(x, fill=0.0):
        return torch.cat([x, torch.full((B, pad), fill)], dim=1)

    policy = dict(policy_loss_type="gspo")
    unpadded = theirs_loss.PolicyLoss(**policy)(lp.clone().requires_grad_(), old, adv, full)[0]
    assert torch.isfinite(unpadded)
    with_padding = theirs_loss.PolicyLoss(**policy)(
        padded(lp).requires_grad_(), padded(old), padded(adv), padded(full)
    )[0]
    assert torch.isnan(with_padding)  # OpenRLHF's: inf x 0 at the padding
    for x, m in ((lp, full), (padded(lp), padded(full))):
        leaf = x.clone().requires_grad_()
        ours = adapter.PolicyLoss(**policy)(
            leaf, padded(old) if x.shape[1] > L else old, padded(adv) if x.shape[1] > L else adv, m
        )[0]
        ours.backward()
        torch.testing.assert_close(ours, unpadded, atol=1e-6, rtol=1e-6)
        assert torch.isfinite(leaf.grad).all() and not leaf.grad[1].any()


def test_the_openrlhf_advantage_preset_is_openrlhfs_group_norm_with_its_clip_range(tmp_path):
    """``group_advantages(preset="openrlhf")`` against OpenRLHF's own ``compute_advantages_and_returns``
    (``--algo.advantage.estimator group_norm``, its default ``--reward.clip_range`` of +-10), run on its real
    module in a process of its own (``openrlhf_actor_step``): a group of 128 with one success normalizes past 10
    and is clamped there; a random group and a group with no signal (all 0.5) too."""
    import os
    import subprocess

    from openrlhf_code import openrlhf_tree

    from grpo_kernels.advantages import group_advantages

    G = 128
    rewards = torch.zeros(3 * G)
    rewards[0] = 1.0
    rewards[G : 2 * G] = torch.rand(G, generator=torch.Generator().manual_seed(0))
    rewards[2 * G :] = 0.5
    tree = openrlhf_tree(tmp_path / "tree")
    out = tmp_path / "advantages.pt"
    torch.save(rewards, tmp_path / "rewards.pt")
    script = (
        f"import torch, openrlhf_actor_step as s; torch.save(s.group_norm_advantages("
        f"torch.load({str(tmp_path / 'rewards.pt')!r}), {G}), {str(out)!r})"
    )
    tests = pathlib.Path(__file__).resolve().parent
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (tree, tests)))},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = torch.load(out)
    ours = group_advantages(rewards, G, preset="openrlhf").advantages
    assert float(theirs[0]) == 10.0 and float(group_advantages(rewards, G, std="sample", eps=1e-9).advantages[0]) > 11
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="clip must be a positive number"):
        group_advantages(rewards, G, clip=-1.0)
