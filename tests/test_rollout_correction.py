"""The train / rollout mismatch correction in the loss call (``rollout_correction``, ``grpo_kernels/
rollout_correction.py``), held to the trainers' own code: verl 0.9's ``RolloutCorrectionConfig`` presets and
``compute_rollout_correction_and_rejection_mask`` (weights, rejection mask and every metric, by name), verl's
policy losses on the corrected batch (decoupled, and bypass through ``compute_policy_loss_bypass_mode``), and TRL
1.16's vLLM importance-sampling lines, run from its installed source; on both backends, from logits and from
hidden states, padded and packed; the errors by name."""

import collections
import inspect
import math
import textwrap
import types

import pytest
import torch
from gloo_ranks import run_ranks

from grpo_kernels import GRPOLoss, GRPOOptions, fused_linear_grpo_loss, grpo_loss, grpo_loss_reference
from grpo_kernels.rollout_correction import (
    RS_OPTIONS,
    TRL_MODES,
    VERL_REINFORCE_PRESETS,
    OpenRLHFCorrection,
    TRLImportanceSampling,
    VerlRolloutCorrection,
)

verl_helper = pytest.importorskip(
    "verl.trainer.ppo.rollout_corr_helper", reason="verl is not installed (pip install --no-deps verl)"
)
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402

LENGTHS = (1, 9, 4, 0, 7, 3, 9, 6)
T, V = max(LENGTHS), 23
BACKENDS = ["torch", "triton"]
FP32 = dict(atol=1e-6, rtol=1e-5)
# how far each row's sampler is from the old policy: some rows within every rejection's bounds, some out
ROW_SCALE = torch.tensor([0.0005, 0.3, 0.02, 0.6, 0.001, 2.0, 0.0002, 0.1])
VERL_FIELDS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold")


def _log_probs(seed=0, spread=0.3):
    """Old and sampler log-probs [B, T] whose log-ratios spread over tokens and rows (so that TIS truncates, IcePop
    zeroes, and each rejection keeps some rows and drops others), a ragged mask with an empty row."""
    g = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    old = -(0.05 + 2.5 * torch.rand(B, T, generator=g))
    sampling = old + spread / 0.3 * ROW_SCALE[:, None] * torch.randn(B, T, generator=g)
    return old * mask, sampling * mask, mask


def _verl(config: VerlRolloutCorrection, old, sampling, mask):
    weights, new_mask, metrics = verl_helper.compute_rollout_correction_and_rejection_mask(
        old, sampling, mask, *(getattr(config, name) for name in VERL_FIELDS)
    )
    return (None if weights is None else weights.batch["rollout_is_weights"]), new_mask, metrics


def _assert_metrics(expected: dict, actual: dict):
    assert set(expected) <= set(actual), set(expected) - set(actual)
    for key, value in expected.items():
        assert float(actual[key]) == pytest.approx(float(value), rel=1e-5, abs=1e-6), key


# ---- verl's presets and function ----------------------------------------------------------------------------------


def test_presets_are_verls():
    """Every preset name of verl 0.9.1's RolloutCorrectionConfig is ours with its fields (with non-default
    arguments too), or refused by name (the bypass REINFORCE presets: verl's own loss)."""
    verl_presets = {
        name
        for name, member in inspect.getmembers(RolloutCorrectionConfig, inspect.ismethod)
        if name.startswith(("decoupled", "bypass", "disabled"))
    }
    assert verl_presets == set(VerlRolloutCorrection.PRESETS) | set(VERL_REINFORCE_PRESETS)
    for name in VerlRolloutCorrection.PRESETS:
        build = getattr(RolloutCorrectionConfig, name)
        values = dict(
            threshold=4.0, threshold_lower=0.6, is_threshold=3.0, rs_threshold=0.02 if "k3" in name else "0.8_1.3"
        )
        arguments = {p: values[p] for p in inspect.signature(build).parameters}
        for args in ({}, arguments):
            theirs, ours = build(**args), VerlRolloutCorrection.from_preset(name, **args)
            for field in (*VERL_FIELDS, "bypass_mode", "loss_type"):
                assert getattr(ours, field) == getattr(theirs, field), (name, args, field)
            assert VerlRolloutCorrection.from_config(theirs) == ours
    for name in VERL_REINFORCE_PRESETS:
        with pytest.raises(ValueError, match="bypass REINFORCE"):
            GRPOOptions(rollout_correction=name)


def _configs():
    """Each preset, each rejection option alone (one- and two-sided thresholds), two chained, IcePop per
    sequence, batch normalization per token and per sequence."""
    configs = {name: VerlRolloutCorrection.from_preset(name) for name in VerlRolloutCorrection.PRESETS}
    for option in RS_OPTIONS:
        threshold = "0.9_1.15" if option.endswith("k1") else {"k2": 0.004, "k3": 0.004}[option[-2:]]
        if option.startswith("seq_sum"):
            threshold = "0.6_1.8" if option.endswith("k1") else 0.05
        configs[option] = VerlRolloutCorrection(rollout_is=None, rollout_rs=option, rollout_rs_threshold=threshold)
    configs["token_k1 one number"] = VerlRolloutCorrection(rollout_rs="token_k1", rollout_rs_threshold=1.2)
    configs["chained"] = VerlRolloutCorrection(
        rollout_is="token", rollout_rs="token_k2,seq_max_k3", rollout_rs_threshold="0.01,0.02"
    )
    configs["sequence icepop"] = VerlRolloutCorrection(rollout_is="sequence", rollout_is_threshold="0.7_1.5")
    for level in ("token", "sequence"):
        configs[f"{level} batch-normalized"] = VerlRolloutCorrection(
            rollout_is=level, rollout_is_threshold=1.3, rollout_is_batch_normalize=True
        )
    return configs


CONFIGS = _configs()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_weights_mask_and_metrics_are_verls(name):
    config = CONFIGS[name]
    old, sampling, mask = _log_probs()
    weights, new_mask, metrics = _verl(config, old, sampling, mask)
    ours = config.compute(old, sampling, mask)
    torch.testing.assert_close(ours.mask, new_mask.float(), atol=0, rtol=0)
    if config.applies_weights():
        torch.testing.assert_close(ours.weights, weights, **FP32)
    else:
        assert ours.weights is None
    assert set(ours.metrics) == set(metrics), set(ours.metrics) ^ set(metrics)
    _assert_metrics(metrics, ours.metrics)


def test_the_comparisons_bind():
    """The inputs make each correction act: TIS truncates, IcePop zeroes, each rejection option keeps some active
    rows and rejects others."""
    old, sampling, mask = _log_probs()
    active_rows = mask.sum(-1) > 0
    for option in RS_OPTIONS:
        kept = CONFIGS[option].compute(old, sampling, mask).mask
        rows_kept = (kept.sum(-1) == mask.sum(-1)) & active_rows
        assert 0 < int(rows_kept.sum()) < int(active_rows.sum()), option
    for name in ("decoupled_token_is", "decoupled_seq_is"):
        metrics = CONFIGS[name].compute(old, sampling, mask).metrics
        assert float(metrics["rollout_corr/rollout_is_ratio_fraction_high"]) > 0, name
    assert (
        float(
            CONFIGS["decoupled_token_icepop"].compute(old, sampling, mask).metrics["rollout_corr/rollout_is_oob_ratio"]
        )
        > 0
    )


# ---- the loss with the correction, against verl's losses on the corrected batch ----------------------------------


def _logits_batch(seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    B = len(LENGTHS)
    old, sampling, mask = _log_probs(seed)
    logits = torch.randn(B, T, V, generator=g) * 1.5
    ids = torch.randint(0, V, (B, T), generator=g)
    lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    old = (lp + 0.2 * torch.randn(B, T, generator=g)) * mask  # the old policy near the current one
    sampling = (old + (sampling - _log_probs(seed)[0])) * mask  # the sampler off the old one as above
    adv = (torch.randn(B, 1, generator=g) * 1.5).expand(B, T).clone()
    return logits, ids, mask, adv, old, sampling


def _their_logps(logits, ids, mask):
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None])[..., 0] * mask


def _actor_config(tokens, **policy_loss):
    """verl's actor config for our verl preset (symmetric clip 0.2), with one process's global batch of ``tokens``
    active tokens (the corrected mask's, as verl's trainer counts them)."""
    return ActorConfig(
        strategy="fsdp",
        rollout_n=2,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        policy_loss=PolicyLossConfig(**policy_loss),
        global_batch_info=dict(dp_size=1, batch_num_tokens=float(tokens), global_batch_size=8.0),
    )


DECOUPLED = ["decoupled_seq_is_rs", "decoupled_token_icepop", "decoupled_geo_rs_token_tis", "decoupled_k3_rs_seq_tis"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", DECOUPLED)
def test_decoupled_loss_is_verls(preset, backend):
    """verl's decoupled mode: its trainer corrects the batch (weights, rejected tokens out of the response mask),
    its actor runs compute_policy_loss_vanilla on it with the global token count of the corrected mask. Ours in
    one call with the verl preset: the loss, d logits and the correction's metrics."""
    logits, ids, mask, adv, old, sampling = _logits_batch()
    config = VerlRolloutCorrection.from_preset(preset)
    weights, new_mask, metrics = _verl(config, old, sampling, mask)
    new_mask = new_mask.float()
    assert 0 < new_mask.sum() < mask.sum() or "icepop" in preset, "the rejection binds"
    actor = _actor_config(new_mask.sum())
    twin = logits.detach().clone().requires_grad_()
    logits.requires_grad_()
    expected, _ = core_algos.compute_policy_loss_vanilla(
        old, _their_logps(logits, ids, mask), adv, new_mask, "token-mean", actor, weights
    )
    out = GRPOLoss(preset="verl", backend=backend, rollout_correction=preset)(
        twin, ids, mask, adv, old_logps=old, sampling_logps=sampling
    )
    expected.backward()
    out.loss.backward()
    torch.testing.assert_close(out.loss, expected, **FP32)
    torch.testing.assert_close(twin.grad, logits.grad, atol=1e-7, rtol=1e-5)
    _assert_metrics(metrics, out.metrics)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", ["bypass_ppo_clip", "bypass_ppo_clip_geo_rs", "bypass_ppo_clip_k3_rs"])
def test_bypass_loss_is_verls(preset, backend):
    """verl's bypass mode: the sampler's log-probs are the old ones, the rejection compares the current policy
    with them; compute_policy_loss_bypass_mode, token-mean, against our call with old_logps=None."""
    logits, ids, mask, adv, old, _ = _logits_batch(seed=2)
    noise = ROW_SCALE[:, None] * torch.randn(mask.shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # a sampler near the current policy, nearer on some rows: verl's thresholds keep some
        sampling = (_their_logps(logits, ids, mask) + noise) * mask
    config = getattr(RolloutCorrectionConfig, preset)()
    lp = _their_logps(logits.requires_grad_(), ids, mask)
    _, kept, _ = _verl(VerlRolloutCorrection.from_config(config), lp.detach(), sampling, mask)
    actor = _actor_config(kept.sum(), loss_mode="bypass_mode", rollout_correction=config)
    if config.rollout_rs is not None:
        assert 0 < kept.sum() < mask.sum(), "the rejection binds"
    expected, metrics = core_algos.compute_policy_loss_bypass_mode(sampling, lp, adv, mask, "token-mean", actor)
    twin = logits.detach().clone().requires_grad_()
    out = GRPOLoss(preset="verl", backend=backend, rollout_correction=preset)(
        twin, ids, mask, adv, sampling_logps=sampling
    )
    expected.backward()
    out.loss.backward()
    torch.testing.assert_close(out.loss, expected, **FP32)
    torch.testing.assert_close(twin.grad, logits.grad, atol=1e-7, rtol=1e-5)
    _assert_metrics({k: v for k, v in metrics.items() if k.startswith("rollout_corr/")}, out.metrics)


# ---- TRL's lines, from its installed source ------------------------------------------------------------------------


def _trl_block(source: str, start: str, end: str) -> str:
    begin = source.index(start)
    return textwrap.dedent(source[begin : source.index(end, begin)])


def trl_importance_sampling(mode, clip_max, clip_min, old, sampling, mask):
    """TRL 1.16's ``importance_sampling_ratio`` and ``sampling/`` metrics, by running the lines of
    ``GRPOTrainer._generate_and_score_completions`` that compute them (one process)."""
    from trl.trainer import grpo_trainer

    source = inspect.getsource(grpo_trainer.GRPOTrainer._generate_and_score_completions)
    guard = "if self.use_vllm and self.vllm_importance_sampling_correction:"
    ratio_code = _trl_block(
        source, guard + "\n                mask =", "# Compute the per-token log probabilities for the reference"
    )
    metrics_code = _trl_block(source, guard + "\n            delta =", "output = {")
    recorded = collections.defaultdict(list)
    trainer = types.SimpleNamespace(
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_max=clip_max,
        vllm_importance_sampling_clip_min=clip_min,
        _metrics={"train": recorded},
        accelerator=types.SimpleNamespace(gather=lambda t: t.reshape(-1)),
    )
    scope = dict(vars(grpo_trainer))
    scope.update(
        self=trainer,
        old_per_token_logps=old,
        sampling_per_token_logps=sampling,
        completion_mask=mask,
        tool_mask=None,
        mode="train",
        device=old.device,
        math=math,
        torch=torch,
    )
    exec(compile(ratio_code, "trl_ratio", "exec"), scope)
    exec(compile(metrics_code, "trl_metrics", "exec"), scope)
    return scope["vllm_importance_sampling_ratio"], {k: v[-1] for k, v in recorded.items()}


TRL_BOUNDS = [(2.0, None), (1.2, None), (1.3, 0.8), (None, 0.9)]


@pytest.mark.parametrize("bounds", TRL_BOUNDS, ids=lambda b: f"max {b[0]} min {b[1]}")
@pytest.mark.parametrize("mode", TRL_MODES)
def test_trl_ratio_and_metrics_are_trls(mode, bounds):
    old, sampling, mask = _log_probs(seed=1)
    sampling = sampling.clone()
    sampling[1, 2] = float("nan")  # a token vLLM could not score: ratio 1, out of the difference metrics
    ratio, metrics = trl_importance_sampling(mode, *bounds, old, sampling, mask)
    ours = TRLImportanceSampling(mode, *bounds).compute(old, sampling, mask)
    torch.testing.assert_close(ours.weights, ratio, **FP32)
    assert ours.mask is mask
    assert set(ours.metrics) == set(metrics)
    _assert_metrics(metrics, ours.metrics)
    difference = torch.nan_to_num((old - sampling) * mask)
    unbounded = torch.exp(difference.sum(-1, keepdim=True) if mode.startswith("sequence") else difference)
    assert (ratio != unbounded).any(), "the bounds bind"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", TRL_MODES)
def test_trl_mode_in_the_call_is_the_loss_on_trls_ratio(mode, backend):
    """TRL multiplies its per-token loss by the ratio (``importance_sampling_ratio``): our call with the mode
    equals our call with TRL's ratio as importance_weights (which the TRL adapter's tests hold to TRL's loss)."""
    logits, ids, mask, adv, old, sampling = _logits_batch(seed=3)
    ratio, metrics = trl_importance_sampling(mode, 1.4, 0.7, old, sampling, mask)
    twins = [logits.detach().clone().requires_grad_() for _ in range(2)]
    options = dict(preset="trl", backend=backend, beta=0.0)
    expected = GRPOLoss(**options)(twins[0], ids, mask, adv, old_logps=old, importance_weights=ratio)
    correction = TRLImportanceSampling(mode, 1.4, 0.7)
    actual = GRPOLoss(**options, rollout_correction=correction)(
        twins[1], ids, mask, adv, old_logps=old, sampling_logps=sampling
    )
    expected.loss.backward()
    actual.loss.backward()
    torch.testing.assert_close(actual.loss, expected.loss, **FP32)
    torch.testing.assert_close(twins[1].grad, twins[0].grad, atol=1e-7, rtol=1e-5)
    _assert_metrics(metrics, actual.metrics)
    assert (
        TRLImportanceSampling.from_config(
            types.SimpleNamespace(
                vllm_importance_sampling_mode=mode,
                vllm_importance_sampling_clip_max=1.4,
                vllm_importance_sampling_clip_min=0.7,
            )
        )
        == correction
    )


# ---- OpenRLHF's options, against its PolicyLoss from its wheel -----------------------------------------------------

OPENRLHF_CORRECTIONS = [
    ("token", "mask", "ratio", (0.8, 1.25)),
    ("token", "clip", "ratio", (0.8, 1.25)),
    ("seq", "mask", "ratio", (0.9, 1.1)),
    ("token", "mask", "binary_kl", (0.0, 0.02)),
    ("seq", "mask", "tv", (0.0, 0.1)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("correction", OPENRLHF_CORRECTIONS, ids=lambda c: "-".join(c[:3]))
def test_openrlhf_correction_in_the_call_is_openrlhfs(correction, backend):
    """OpenRLHF's PolicyLoss with its is_correction_* options (from its wheel), token-mean with the global token
    count, against our call with the openrlhf preset and the same options: the loss, d logits, is_filter_ratio
    and vllm_kl."""
    from openrlhf_code import openrlhf_code

    _, loss_code = openrlhf_code()
    logits, ids, mask, adv, old, sampling = _logits_batch(seed=6)
    level, mode, gating, threshold = correction
    tokens = mask.sum()
    info = dict(dp_size=1, batch_num_tokens=tokens, global_batch_size=torch.tensor(8.0))
    theirs = loss_code.PolicyLoss(
        is_correction_level=level,
        is_correction_mode=mode,
        is_correction_gating=gating,
        is_correction_threshold=list(threshold),
    )
    logits.requires_grad_()
    expected, _, _, vllm_kl, filtered = theirs(_their_logps(logits, ids, mask), old, adv, mask, sampling, **info)
    assert 0 < float(filtered) < 1, "the gate binds"
    twin = logits.detach().clone().requires_grad_()
    ours = GRPOLoss(preset="openrlhf", backend=backend, rollout_correction=OpenRLHFCorrection(*correction))
    out = ours(twin, ids, mask, adv, old_logps=old, sampling_logps=sampling, normalizer=tokens)
    expected.backward()
    out.loss.backward()
    torch.testing.assert_close(out.loss, expected, **FP32)
    torch.testing.assert_close(twin.grad, logits.grad, atol=1e-7, rtol=1e-5)
    _assert_metrics({"is_filter_ratio": filtered, "vllm_kl": vllm_kl}, out.metrics)


# ---- the specification ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "correction",
    [
        "decoupled_seq_is_rs",
        "bypass_ppo_clip_k3_rs",
        "token_mask",
        OpenRLHFCorrection("seq", "mask", "ratio", (0.9, 1.1)),
        RolloutCorrectionConfig.decoupled_geo_rs_token_tis(),
    ],
    ids=["verl decoupled", "verl bypass", "trl", "openrlhf", "a verl config"],
)
def test_the_specification_applies_the_correction_as_the_fast_paths(correction, backend):
    logits, ids, mask, adv, old, sampling = _logits_batch(seed=8)
    bypass = correction == "bypass_ppo_clip_k3_rs"
    options = GRPOOptions(loss_type="grpo", beta=0.04, rollout_correction=correction)
    ref = (_their_logps(logits, ids, mask) + 0.1).detach()
    leaves = [logits.detach().clone().requires_grad_() for _ in range(2)]
    inputs = dict(old_logps=None if bypass else old, ref_logps=ref, sampling_logps=sampling, options=options)
    expected = grpo_loss_reference(leaves[0], ids, mask, adv, **inputs)
    actual = grpo_loss(leaves[1], ids, mask, adv, backend=backend, **inputs)
    expected.loss.backward()
    actual.loss.backward()
    torch.testing.assert_close(actual.loss, expected.loss, **FP32)
    torch.testing.assert_close(leaves[1].grad, leaves[0].grad, atol=1e-7, rtol=1e-5)
    assert set(actual.metrics) == set(expected.metrics)
    _assert_metrics(expected.metrics, actual.metrics)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("correction", ["decoupled_seq_is_rs", "sequence_truncate", "bypass_ppo_clip_geo_rs"])
def test_bf16_logits_are_the_specification_within_their_rounding(correction, backend):
    """bf16 logits: the corrected loss and metrics as the fp32 specification on the same values, the bf16 gradient
    within two of its ulps. (In bypass mode the rejection reads this call's log-probs: fp32 from the bf16 inputs on
    both sides, so the same tokens are rejected.)"""
    logits, ids, mask, adv, old, sampling = _logits_batch(seed=9)
    bypass = correction.startswith("bypass")
    if bypass:  # the sampler within the bypass thresholds on some rows
        noise = ROW_SCALE[:, None] * torch.randn(mask.shape, generator=torch.Generator().manual_seed(4))
        sampling = (_their_logps(logits.bfloat16().float(), ids, mask) + noise) * mask
    options = GRPOOptions(loss_type="dapo", rollout_correction=correction)
    inputs = dict(old_logps=None if bypass else old, sampling_logps=sampling, options=options)
    half = logits.bfloat16().requires_grad_()
    full = half.detach().float().requires_grad_()
    expected = grpo_loss_reference(full, ids, mask, adv, **inputs)
    actual = grpo_loss(half, ids, mask, adv, backend=backend, **inputs)
    expected.loss.backward()
    actual.loss.backward()
    assert half.grad.dtype == torch.bfloat16
    torch.testing.assert_close(actual.loss, expected.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(half.grad.float(), full.grad, atol=1e-4, rtol=2 * 2**-8)
    _assert_metrics(expected.metrics, actual.metrics)
    if "rs" in correction:
        assert 0 < float(actual.metrics["rollout_corr/rollout_rs_masked_fraction"]) < 1, "the rejection binds"


# ---- the input forms and layouts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_hidden_states_and_packed_calls_equal_the_padded_logits_call(backend):
    """The fused head with the correction equals the logits call; a packed batch equals the padded one."""
    g = torch.Generator().manual_seed(7)
    B, H = len(LENGTHS), 8
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    logits = hidden @ weight.T
    _, ids, mask, adv, _, _ = _logits_batch(seed=4)
    old, sampling, _ = _log_probs(seed=4)
    lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    old = (lp + 0.2 * torch.randn(B, T, generator=g)) * mask
    sampling = (old + (sampling - _log_probs(seed=4)[0])) * mask
    options = GRPOOptions(loss_type="dapo", rollout_correction="decoupled_geo_rs_seq_tis", beta=0.0)
    reference = grpo_loss(
        logits, ids, mask, adv, old_logps=old, sampling_logps=sampling, options=options, backend=backend
    )
    fused = fused_linear_grpo_loss(
        hidden, weight, ids, mask, adv, old_logps=old, sampling_logps=sampling, options=options, backend=backend
    )
    torch.testing.assert_close(fused.loss, reference.loss, **FP32)
    _assert_metrics(reference.metrics, fused.metrics)
    # packed: the active tokens of each row, one after another
    lengths = mask.sum(-1).long()
    keep = mask.bool()
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()
    packed = grpo_loss(
        logits[keep],
        ids[keep],
        torch.ones(int(lengths.sum())),
        adv[:, 0],
        old_logps=old[keep],
        sampling_logps=sampling[keep],
        options=options,
        backend=backend,
        cu_seqlens=cu,
    )
    torch.testing.assert_close(packed.loss, reference.loss, **FP32)
    for key in ("rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_is_mean", "rollout_corr/kl"):
        assert float(packed.metrics[key]) == pytest.approx(float(reference.metrics[key]), rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_old_logps_the_call_compares_its_own_log_probs(backend):
    """A single update on fresh samples: no old log-probs, the correction compares this call's (detached)."""
    logits, ids, mask, adv, _, sampling = _logits_batch(seed=5)
    lp = _their_logps(logits, ids, mask)
    options = dict(loss_type="dapo", rollout_correction="decoupled_seq_is_rs", backend=backend)
    without = GRPOLoss(**options)(logits, ids, mask, adv, sampling_logps=sampling)
    config = VerlRolloutCorrection.from_preset("decoupled_seq_is_rs")
    weights, new_mask, metrics = _verl(config, lp, sampling, mask)
    expected = GRPOLoss(loss_type="dapo", backend=backend)(logits, ids, new_mask, adv, importance_weights=weights)
    torch.testing.assert_close(without.loss, expected.loss, **FP32)
    _assert_metrics(metrics, without.metrics)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_all_padding_batch_runs(backend):
    logits, ids, mask, adv, old, sampling = _logits_batch()
    for correction in ("decoupled_seq_is_rs", "decoupled_token_icepop", "sequence_mask", "token_truncate"):
        out = GRPOLoss(backend=backend, rollout_correction=correction)(
            logits.requires_grad_(), ids, torch.zeros_like(mask), adv, old_logps=old, sampling_logps=sampling
        )
        out.loss.backward()
        assert float(out.loss.detach()) == 0.0 and torch.isfinite(logits.grad).all() and not logits.grad.any()
        logits.grad = None


def _batch_normalized_rank(rank, world):
    """Each rank's half of the batch: verl's batch normalization takes the mean over both (distributed_masked_mean)."""
    old, sampling, mask = _log_probs(seed=6)
    half = slice(rank * len(LENGTHS) // world, (rank + 1) * len(LENGTHS) // world)
    out = {}
    for level in ("token", "sequence"):
        config = VerlRolloutCorrection(rollout_is=level, rollout_is_threshold=1.3, rollout_is_batch_normalize=True)
        theirs, _, metrics = _verl(config, old[half], sampling[half], mask[half])
        ours = config.compute(old[half], sampling[half], mask[half])
        out[level] = (
            theirs,
            ours.weights,
            metrics["rollout_corr/rollout_is_batch_norm_factor"],
            float(ours.metrics["rollout_corr/rollout_is_batch_norm_factor"]),
        )
    return out


def test_batch_normalization_spans_processes_as_verls():
    results = run_ranks(_batch_normalized_rank, 2)
    for level in ("token", "sequence"):
        (_, _, factor0, ours0), (_, _, factor1, ours1) = (r[level] for r in results)
        assert factor0 == pytest.approx(factor1) and ours0 == pytest.approx(factor0, rel=1e-6), level
        for rank in results:
            theirs, ours, *_ = rank[level]
            torch.testing.assert_close(ours, theirs, **FP32)


# ---- errors by name ------------------------------------------------------------------------------------------------


def test_bad_corrections_and_inputs_are_refused_by_name():
    logits, ids, mask, adv, old, sampling = _logits_batch()
    with pytest.raises(ValueError, match="needs sampling_logps"):
        grpo_loss(logits, ids, mask, adv, old_logps=old, rollout_correction="decoupled_seq_is")
    with pytest.raises(ValueError, match="importance_weights and rollout_correction"):
        grpo_loss(
            logits,
            ids,
            mask,
            adv,
            old,
            importance_weights=torch.ones_like(old),
            sampling_logps=sampling,
            rollout_correction="token_mask",
        )
    with pytest.raises(ValueError, match="pass old_logps=None"):
        grpo_loss(logits, ids, mask, adv, old, sampling_logps=sampling, rollout_correction="bypass_ppo_clip")
    with pytest.raises(ValueError, match="rollout_correction must be one of verl's presets"):
        GRPOOptions(rollout_correction="decoupled_tis")
    with pytest.raises(ValueError, match="rollout_rs option must be one of"):
        GRPOOptions(rollout_correction=dict(rollout_is=None, rollout_rs="seq_max_k1", rollout_rs_threshold=2.0))
    with pytest.raises(ValueError, match="rollout_rs needs rollout_rs_threshold"):
        VerlRolloutCorrection(rollout_rs="token_k2")
    with pytest.raises(ValueError, match=r"rollout_rs_threshold for 'token_k3' must be an upper bound"):
        VerlRolloutCorrection(rollout_rs="token_k3", rollout_rs_threshold="0.5_2")
    with pytest.raises(ValueError, match="rollout_is_threshold needs 0 < lower <= upper"):
        VerlRolloutCorrection(rollout_is="token", rollout_is_threshold="3_2")
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode must be one of"):
        TRLImportanceSampling("token_clip")
    with pytest.raises(TypeError, match="takes"):
        VerlRolloutCorrection.from_preset("decoupled_seq_is", rs_threshold=2.0)


# ---- garbage at masked positions ------------------------------------------------------------------------------------

# what a padded batch may hold at its masked positions, cycled over them
GARBAGE = torch.tensor([float("nan"), float("inf"), -float("inf"), 50.0])


def _every_correction(family: str) -> dict:
    """Every correction of a trainer's convention the tests hold to its code: verl's presets and configs above, TRL's
    modes, OpenRLHF's option sets."""
    if family == "verl":
        return dict(CONFIGS)
    if family == "trl":
        return {mode: TRLImportanceSampling(mode, 1.4, 0.7) for mode in TRL_MODES}
    return {"-".join(c[:3]): OpenRLHFCorrection(*c) for c in OPENRLHF_CORRECTIONS}


TRITON_GARBAGE_CASES = {
    "verl": ("decoupled_seq_is_rs", "token batch-normalized", "sequence batch-normalized", "bypass_ppo_clip_k3_rs"),
    "trl": ("sequence_mask", "token_truncate"),
    "openrlhf": ("seq-mask-ratio", "token-clip-ratio"),
}


def _with_garbage(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    fill = GARBAGE[torch.arange(t.numel()) % len(GARBAGE)].view(t.shape).to(t.dtype)
    return torch.where(mask != 0, t, fill)


# the corrections are the same torch code on both backends: Triton's cases padded (the packed layout, the torch path)
GARBAGE_CASES = [(f, "torch", layout) for f in ("verl", "trl", "openrlhf") for layout in ("padded", "packed")] + [
    (f, "triton", "padded") for f in ("verl", "trl", "openrlhf")
]


@pytest.mark.parametrize("family, backend, layout", GARBAGE_CASES)
def test_garbage_at_masked_positions_changes_no_correction(family, backend, layout):
    """NaN, +-inf or a stale value at the masked positions of every per-token input (the sampler's, old and
    reference log-probs, per-token advantages) changes no correction's loss, gradient or metric: the call equals
    the one with zeros there. (OpenRLHF's sequence-level gate dropped a row and verl's batch normalization was
    skipped on a NaN there.)"""
    logits, ids, mask, adv, old, sampling = _logits_batch(seed=9)
    ref = (_their_logps(logits, ids, mask) + 0.1).detach()
    B = len(LENGTHS)
    packed = {}
    if layout == "packed":  # each row a sequence of T tokens, its padding inside the packed batch
        logits, ids, mask, adv, old, sampling, ref = (
            t.reshape(B * T, *t.shape[2:]) for t in (logits, ids, mask, adv, old, sampling, ref)
        )
        packed = dict(cu_seqlens=torch.arange(0, B * T + 1, T, dtype=torch.int32))
    corrections = _every_correction(family)
    if backend == "triton":  # the corrections are torch on either backend: each kind once through the kernels
        corrections = {name: corrections[name] for name in TRITON_GARBAGE_CASES[family]}
    for name, correction in corrections.items():
        bypass = correction.old_is_sampler()
        clean = dict(old_logps=None if bypass else old, ref_logps=ref, sampling_logps=sampling)
        dirty = {k: None if v is None else _with_garbage(v, mask) for k, v in clean.items()}
        results = []
        for inputs, advantages in ((clean, adv), (dirty, _with_garbage(adv, mask))):
            leaf = logits.clone().requires_grad_()
            out = grpo_loss(
                leaf, ids, mask, advantages, **inputs, **packed, beta=0.04, rollout_correction=correction,
                backend=backend,
            )  # fmt: skip
            out.loss.backward()
            results.append((out, leaf.grad))
        (expected, expected_grad), (actual, grad) = results
        torch.testing.assert_close(actual.loss, expected.loss, atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(grad, expected_grad, atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
        assert set(actual.metrics) == set(expected.metrics), name
        for key, value in expected.metrics.items():
            torch.testing.assert_close(
                actual.metrics[key], value, atol=0, rtol=0, equal_nan=True, msg=lambda m, n=name, k=key: f"{n} {k}: {m}"
            )
