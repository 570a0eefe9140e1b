"""verl adapter against verl's own core_algos functions: policy losses, agg_loss modes, KL estimators."""

import pathlib
import sys
import types

import numpy as np
import pytest
import torch

core_algos = pytest.importorskip(
    "verl.trainer.ppo.core_algos", reason="verl is not installed (pip install --no-deps verl; pip install '.[verl]')"
)

from verl.workers.config import ActorConfig  # noqa: E402

from grpo_kernels.integration import verl as adapter  # noqa: E402

B, T = 5, 7


def _inputs(seed=0, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    log_prob = (-2.0 + 0.5 * torch.randn(B, T, generator=g)).requires_grad_()
    old = (log_prob + spread * torch.randn(B, T, generator=g)).detach()
    adv = torch.randn(B, T, generator=g) * 2  # verl's advantages are per token
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[-1] = 0  # a fully masked row
    return log_prob, old, adv, mask


def _config(**kw):
    return ActorConfig(
        strategy="fsdp",
        rollout_n=2,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        **kw,
    )


def _compare(ours_fn, verl_fn, mode, config, weights=None, seed=0):
    lp, old, adv, mask = _inputs(seed)
    lp2 = lp.detach().clone().requires_grad_()
    expected, expected_metrics = verl_fn(old, lp, adv, mask, mode, config, weights)
    actual, metrics = ours_fn(old, lp2, adv, mask, mode, config, weights)
    expected.backward()
    actual.backward()
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lp2.grad, lp.grad, atol=1e-7, rtol=1e-5)
    for key, value in expected_metrics.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key


@pytest.mark.parametrize("mode", adapter.AGG_MODES)
@pytest.mark.parametrize("weighted", [False, True])
def test_vanilla_matches_verl(mode, weighted):
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(1)) + 0.5 if weighted else None
    _compare(adapter.vanilla_policy_loss, core_algos.compute_policy_loss_vanilla, mode, _config(), weights)


@pytest.mark.parametrize("mode", adapter.AGG_MODES)
def test_gspo_matches_verl(mode):
    _compare(adapter.gspo_policy_loss, core_algos.compute_policy_loss_gspo, mode, _config())


def test_global_batch_info_is_honoured():
    config = _config(global_batch_info={"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 9})
    for mode in adapter.AGG_MODES:
        _compare(adapter.vanilla_policy_loss, core_algos.compute_policy_loss_vanilla, mode, config)


@pytest.mark.parametrize("kl_penalty", ["low_var_kl", "kl", "mse", "k3", "low_var_kl+", "k3+", "kl+", "k1+", "mse+"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_kl_loss_matches_verl(kl_penalty, mode):
    lp, ref, _, mask = _inputs(2, spread=8.0)  # wide enough for verl's clamps to bind
    lp2 = lp.detach().clone().requires_grad_()
    expected = core_algos.agg_loss(core_algos.kl_penalty(lp, ref, kl_penalty), mask, mode)
    actual = adapter.kl_loss(lp2, ref, mask, kl_penalty, mode)
    expected.backward()
    actual.backward()
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lp2.grad, lp.grad, atol=1e-7, rtol=1e-5)


def test_registered_losses_are_found_by_verl():
    adapter.register()
    assert core_algos.get_policy_loss_fn("grpo_kernels") is adapter.vanilla_policy_loss
    assert core_algos.get_policy_loss_fn("grpo_kernels_gspo") is adapter.gspo_policy_loss


def test_patched_logprobs_match_verl_and_use_our_kernel():
    from verl.utils import torch_functional

    logits = torch.randn(11, 503, requires_grad=True)
    labels = torch.randint(0, 503, (11,))
    expected = torch_functional.logprobs_from_logits(logits, labels)
    (g_expected,) = torch.autograd.grad(expected.sum(), logits)
    original = torch_functional.logprobs_from_logits
    try:
        adapter.patch_logprobs()
        assert torch_functional.logprobs_from_logits is not original
        actual = torch_functional.logprobs_from_logits(logits, labels)
        (g_actual,) = torch.autograd.grad(actual.sum(), logits)
    finally:
        torch_functional.logprobs_from_logits = original
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_actual, g_expected, atol=1e-6, rtol=1e-5)


def test_patched_entropy_matches_verl_with_its_gradient():
    """verl's entropy_from_logits (and its chunked form) on our kernel: same values, same gradient."""
    from verl.utils import torch_functional

    logits = 3 * torch.randn(13, 401)
    logits.requires_grad_()
    weights = torch.randn(13)
    expected = torch_functional.entropy_from_logits(logits)
    (g_expected,) = torch.autograd.grad((expected * weights).sum(), logits)
    chunked = torch_functional.entropy_from_logits_with_chunking(logits.detach(), chunk_size=4)
    originals = {
        n: getattr(torch_functional, n)
        for n in ("logprobs_from_logits", "entropy_from_logits", "entropy_from_logits_with_chunking")
    }
    try:
        adapter.patch_logprobs()
        assert torch_functional.entropy_from_logits is not originals["entropy_from_logits"]
        actual = torch_functional.entropy_from_logits(logits)
        (g_actual,) = torch.autograd.grad((actual * weights).sum(), logits)
        actual_chunked = torch_functional.entropy_from_logits_with_chunking(logits.detach(), chunk_size=4)
    finally:
        for name, fn in originals.items():
            setattr(torch_functional, name, fn)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_actual, g_expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(actual_chunked, chunked, atol=1e-5, rtol=1e-5)


def test_unknown_modes_are_named():
    with pytest.raises(ValueError, match="loss_agg_mode must be one of"):
        adapter.aggregate(torch.zeros(2, 2), torch.ones(2, 2), "mean")
    with pytest.raises(ValueError, match="kl_penalty must be one of"):
        adapter.kl_loss(torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2, 2), "abs")


def test_enable_module_registers_and_patches():
    import importlib

    from verl.utils import torch_functional

    originals = {
        n: getattr(torch_functional, n)
        for n in ("logprobs_from_logits", "entropy_from_logits", "entropy_from_logits_with_chunking")
    }
    try:
        importlib.import_module("grpo_kernels.integration.enable")
        assert core_algos.get_policy_loss_fn("grpo_kernels") is adapter.vanilla_policy_loss
        for name, original in originals.items():
            assert getattr(torch_functional, name) is not original, name
    finally:
        for name, fn in originals.items():
            setattr(torch_functional, name, fn)


def test_verls_ray_worker_imports_external_lib_and_calls_our_names(tmp_path):
    """verl trains in Ray workers too; its ``external_lib`` reaches them because each worker builds its model config
    (``HFModelConfig``, in ``ActorRolloutRefWorker.init_model``), whose ``__post_init__`` imports it. In a real Ray
    worker (a local Ray started by a driver that never imports this package), that construction with the
    integration example's ``external_lib``, then the names verl's FSDP engine (``logprobs_from_logits``, imported by
    name) and its losses (``get_policy_loss_fn``, a registry) call are ours."""
    import json
    import os
    import subprocess

    pytest.importorskip("ray")
    from omegaconf import OmegaConf
    from transformers import LlamaConfig

    from grpo_kernels.training.tasks.compare import build_tokenizer

    config = OmegaConf.load(pathlib.Path(__file__).resolve().parents[1] / "integration" / "verl_grpo_kernels.yaml")
    model = tmp_path / "model"  # a tiny model directory: verl's model config reads its config and tokenizer
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(model)
    LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(model)
    script = """
import json, os, sys
import ray

@ray.remote
def in_worker(path, external_lib, loss_mode):
    from verl.workers.config import HFModelConfig
    HFModelConfig(path=path, external_lib=external_lib, override_config={"attn_implementation": "eager"})
    import verl.workers.engine.fsdp.transformer_impl as fsdp_engine
    from verl.trainer.ppo import core_algos
    where = lambda fn: f"{fn.__module__}.{fn.__qualname__}"
    return {"pid": os.getpid(), "fsdp_engine.logprobs_from_logits": where(fsdp_engine.logprobs_from_logits),
            "policy loss": where(core_algos.get_policy_loss_fn(loss_mode))}

ray.init(num_cpus=1, include_dashboard=False)
found = ray.get(in_worker.remote(*sys.argv[1:]))
found["driver imported grpo_kernels"] = any(name.startswith("grpo_kernels") for name in sys.modules)
found["driver pid"] = os.getpid()
ray.shutdown()
print(json.dumps(found))
"""
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            str(model),
            config.actor_rollout_ref.model.external_lib,
            config.actor_rollout_ref.actor.policy_loss.loss_mode,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "RAY_DEDUP_LOGS": "0"},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["pid"] != found["driver pid"] and not found["driver imported grpo_kernels"]
    assert (
        found["fsdp_engine.logprobs_from_logits"]
        == "grpo_kernels.integration.verl.patch_logprobs.<locals>.logprobs_from_logits"
    )
    assert found["policy loss"] == "grpo_kernels.integration.verl.vanilla_policy_loss"


# ---- verl 0.9's whole policy-loss registry, mode by mode -----------------------------------------------------------

BYPASS_PRESETS = (
    "bypass_ppo_clip",
    "bypass_ppo_clip_k3_rs",
    "bypass_pg_is",
    "bypass_pg_token_icepop",
    "bypass_pg_geo_rs_token_tis",
)


def _mode_inputs(seed, spread=0.5):
    """Log-probs spread over (0, 1) in probability, so that DPPO's trust regions (which compare probabilities)
    bind on some tokens and not others; a fully masked row."""
    g = torch.Generator().manual_seed(seed)
    log_prob = (-(0.1 + 1.2 * torch.rand(B, T, generator=g))).requires_grad_()
    old = torch.clamp(log_prob + spread * torch.randn(B, T, generator=g), max=-1e-3).detach()
    adv = torch.randn(B, T, generator=g) * 2
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[-1] = 0
    return log_prob, old, adv, mask


def _mode_config(mode, wide, **kw):
    """A verl ActorConfig for ``mode``: dro's beta, bypass_mode's rollout correction; ``wide``: Clip-Cov / KL-Cov
    choosing a third of the tokens (verl's defaults choose one token of these few)."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config.actor import PolicyLossConfig

    loss = dict(loss_mode=mode, dro_beta=0.3)
    if wide:
        loss.update(clip_cov_ratio=0.3, clip_cov_lb=-3.0, clip_cov_ub=3.0, kl_cov_ratio=0.3, ppo_kl_coef=0.5)
    if mode == "bypass_mode":
        loss["rollout_correction"] = getattr(RolloutCorrectionConfig, kw.pop("preset"))()
    return _config(policy_loss=PolicyLossConfig(**loss), tau_pos=1.0, tau_neg=1.5, **kw)


def _compare_mode(mode, agg, config, weights=None, seed=0, spread=0.5):
    """Our ``grpo_kernels_<mode>`` against verl's ``<mode>``: the loss, d loss / d log_prob, and every metric (the
    same keys). The random draws (Clip-Cov's) start from the same state of torch's default generator."""
    adapter.register()
    lp, old, adv, mask = _mode_inputs(seed, spread)
    lp2 = lp.detach().clone().requires_grad_()
    torch.manual_seed(1234)
    expected, expected_metrics = core_algos.get_policy_loss_fn(mode)(old, lp, adv, mask, agg, config, weights)
    torch.manual_seed(1234)
    actual, metrics = core_algos.get_policy_loss_fn(f"grpo_kernels_{mode}")(old, lp2, adv, mask, agg, config, weights)
    (g_expected,) = torch.autograd.grad(expected, lp)
    (g_actual,) = torch.autograd.grad(actual, lp2)
    assert torch.isfinite(expected), "a comparison of NaN with NaN"
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g_actual, g_expected, atol=1e-7, rtol=1e-5)
    assert set(metrics) == set(expected_metrics), set(metrics) ^ set(expected_metrics)
    for key, value in expected_metrics.items():
        assert metrics[key] == pytest.approx(float(value), abs=1e-6), key
    return expected_metrics


def test_every_verl_mode_is_registered_as_ours():
    adapter.register()
    verl_modes = {m for m in core_algos.POLICY_LOSS_REGISTRY if not m.startswith("grpo_kernels")}
    assert verl_modes == set(adapter.POLICY_LOSSES), verl_modes ^ set(adapter.POLICY_LOSSES)
    for mode, fn in adapter.POLICY_LOSSES.items():
        assert core_algos.get_policy_loss_fn(f"grpo_kernels_{mode}") is fn


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("agg", adapter.AGG_MODES)
@pytest.mark.parametrize("mode", [m for m in adapter.POLICY_LOSSES if m != "bypass_mode"])
def test_every_mode_matches_verl(mode, agg, weighted):
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(1)) + 0.5 if weighted else None
    for wide in (False, True):
        _compare_mode(mode, agg, _mode_config(mode, wide), weights, seed=3)


@pytest.mark.parametrize("mode", [m for m in adapter.POLICY_LOSSES if m != "bypass_mode"])
def test_every_mode_honours_global_batch_info(mode):
    info = {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 9}
    for agg in adapter.AGG_MODES:
        _compare_mode(mode, agg, _mode_config(mode, True, global_batch_info=info), seed=4)


@pytest.mark.parametrize("mode", [m for m in adapter.POLICY_LOSSES if m != "bypass_mode"])
def test_masked_positions_never_reach_a_mode(mode):
    """NaN, inf and -inf at masked positions of every input (log-probs, old log-probs, advantages, weights): every
    aggregation's loss, gradient and metrics are verl's on the same batch with finite values there (verl's own
    sequence-level aggregations would carry the NaN), and the gradient there is 0. The KL loss likewise."""
    adapter.register()
    config = _mode_config(mode, True)
    lp, old, adv, mask = _mode_inputs(seed=5)
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(2)) + 0.5
    junk = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(B * T)[: B * T].view(B, T)
    spoiled = [torch.where(mask.bool(), t.detach(), junk) for t in (lp, old, adv, weights)]
    for agg in adapter.AGG_MODES:
        finite = lp.detach().clone().requires_grad_()
        torch.manual_seed(7)
        expected, expected_metrics = core_algos.get_policy_loss_fn(mode)(old, finite, adv, mask, agg, config, weights)
        (g_expected,) = torch.autograd.grad(expected, finite)
        bad = spoiled[0].clone().requires_grad_()
        torch.manual_seed(7)
        actual, metrics = core_algos.get_policy_loss_fn(f"grpo_kernels_{mode}")(
            spoiled[1], bad, spoiled[2], mask, agg, config, spoiled[3]
        )
        (g_actual,) = torch.autograd.grad(actual, bad)
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5, msg=agg)
        torch.testing.assert_close(g_actual, g_expected * mask, atol=1e-7, rtol=1e-5, msg=agg)
        for key, value in expected_metrics.items():
            assert metrics[key] == pytest.approx(float(value), abs=1e-6), (agg, key)
    for kl_penalty in ("low_var_kl", "kl", "mse"):
        bad_lp = spoiled[0].clone().requires_grad_()
        actual = adapter.kl_loss(bad_lp, spoiled[1], mask, kl_penalty, "seq-mean-token-mean")
        finite = lp.detach().clone().requires_grad_()
        kl = core_algos.kl_penalty(finite, old, kl_penalty)
        expected = core_algos.agg_loss(kl, mask, "seq-mean-token-mean")
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
        actual.backward()
        expected.backward()
        torch.testing.assert_close(bad_lp.grad, finite.grad * mask, atol=1e-7, rtol=1e-5)


def test_the_modes_comparisons_bind():
    """The inputs above exercise what each mode's options select: DPPO's regions leave tokens out on both sides,
    Clip-Cov and KL-Cov choose several tokens, GMPO and CISPO clip."""
    seen = {
        mode: _compare_mode(mode, "token-mean", _mode_config(mode, True), seed=3)
        for mode in ("dppo_tv", "dppo_kl", "clip_cov", "geo_mean", "cispo")
    }
    assert 0 < seen["dppo_tv"]["actor/pg_clipfrac"] < 1 and 0 < seen["dppo_kl"]["actor/pg_clipfrac"] < 1
    assert seen["clip_cov"]["actor/pg_clipfrac"] > 0.1
    assert seen["geo_mean"]["actor/pg_clipfrac"] > 0 and seen["geo_mean"]["actor/pg_clipfrac_lower"] > 0
    assert seen["cispo"]["actor/pg_clipfrac"] > 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("preset", BYPASS_PRESETS)
def test_bypass_mode_matches_verl(preset, agg):
    # a rollout close to the trained policy (verl's rejection thresholds keep some of its tokens)
    config = _mode_config("bypass_mode", False, preset=preset)
    metrics = _compare_mode("bypass_mode", agg, config, seed=5, spread=0.02)
    assert any(key.startswith("rollout_") for key in metrics), "the rollout correction's metrics"


def test_modes_refuse_what_verl_refuses():
    from verl.workers.config.actor import PolicyLossConfig

    adapter.register()
    lp, old, adv, mask = _mode_inputs(0)
    config = _config(policy_loss=PolicyLossConfig(loss_mode="dro"))  # dro_beta unset
    with pytest.raises(ValueError, match="dro_beta"):
        adapter.dro_policy_loss(old, lp, adv, mask, "token-mean", config)
    with pytest.raises(ValueError, match="config"):
        adapter.gpg_policy_loss(old, lp, adv, mask, "token-mean", None)


# ---- verl's fused-kernel path (use_fused_kernels=True) on our fused head op -----------------------------------------


VOCAB_PARALLEL_NAMES = (
    "vocab_parallel_log_probs_from_logits",
    "vocab_parallel_entropy",
    "vocab_parallel_entropy_with_chunking",
)


def _megatron_tensor_parallel():
    """verl's Megatron log-prob functions' module, which ``patch_logprobs`` patches too; None without megatron-core."""
    try:
        from verl.utils.megatron import tensor_parallel
    except ImportError:
        return None
    return tensor_parallel


@pytest.fixture
def verl_patches_undone(monkeypatch):
    """What ``patch_logprobs`` replaces (verl's distillation logits processor included: a later test in the process
    compares against verl's own), in every loaded module that holds it by name, and the class forward verl's
    ``patch_forward_with_backends`` replaces (``tiny_llama``'s): each restored after the test."""
    from transformers import LlamaForCausalLM
    from verl.trainer.distillation.fsdp import losses as distillation_losses
    from verl.utils import torch_functional
    from verl.utils.experimental import torch_functional as experimental
    from verl.utils.kernel import linear_cross_entropy as fused_module

    patched = {
        name: getattr(module, name)
        for module, names in (
            (torch_functional, ("logprobs_from_logits", "entropy_from_logits", "entropy_from_logits_with_chunking")),
            (experimental, ("FusedLinearForPPO",)),
            (fused_module, ("linear_cross_entropy",)),
            (distillation_losses, ("compute_forward_kl_topk",)),  # (patch_distillation, which patch_logprobs calls)
            (_megatron_tensor_parallel(), VOCAB_PARALLEL_NAMES),
        )
        if module is not None
        for name in names
    }
    for module in list(sys.modules.values()):
        for name, original in patched.items():
            if module is not None and getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, original)
    monkeypatch.setattr(LlamaForCausalLM, "forward", LlamaForCausalLM.forward)
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    monkeypatch.setattr(FSDPEngineWithLMHead, "prepare_model_outputs", FSDPEngineWithLMHead.prepare_model_outputs)
    return monkeypatch


def _fsdp_engine(model):
    """verl's FSDP actor engine around ``model`` without its FSDP set-up (one CPU process, fp32: no autocast, as
    FSDPEngine sets it from an fp32 mixed-precision config), for its own ``forward_step``."""
    from verl.utils import torch_functional
    from verl.workers.engine.fsdp import transformer_impl as engine_module

    e = object.__new__(engine_module.FSDPEngineWithLMHead)
    e.module, e.pad_to_length, e.use_ulysses_sp, e.ulysses_device_mesh = model, False, False, None
    e._autocast_dtype = torch.float32
    e.engine_config = types.SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    e.compute_entropy_from_logits = torch_functional.entropy_from_logits
    e.get_data_parallel_group = lambda: None
    return e


def _micro_batch(ids, per_sequence=None, **flags):
    """verl's micro-batch of the sequences ``ids`` (nested, as its engine takes them; ``per_sequence``: more nested
    fields, a tensor a sequence), at temperature 0.8 with ``flags`` (use_remove_padding, use_fused_kernels, ...)."""
    from verl.utils import tensordict_utils as tu

    def nested(tensors):
        return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)

    fields = {"input_ids": ids, "position_ids": [torch.arange(len(i)) for i in ids], **(per_sequence or {})}
    return tu.get_tensordict(
        {name: nested(tensors) for name, tensors in fields.items()}, non_tensor_dict=dict(temperature=0.8, **flags)
    )


def _tiny_llama():
    """A 2-layer Llama with an untied head over a vocabulary of 97, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("fused_kernels_backend", ["torch", "triton"])
def test_verls_fused_kernel_forward_runs_our_op_and_equals_its_logits_path(verl_patches_undone, fused_kernels_backend):
    """verl's model patch for ``use_fused_kernels`` (``patch_forward_with_backends``: the model's forward returns
    log-probs and entropy from the hidden states through verl's FusedLinearForPPO or linear_cross_entropy) runs our
    fused head op after ``patch_logprobs()``, and equals verl's logits path (``logprobs_from_logits`` and
    ``entropy_from_logits`` of the unpatched model's logits): the values, and every parameter's gradient of a loss
    on both."""
    from verl.models.transformers.monkey_patch import patch_forward_with_backends
    from verl.utils import torch_functional
    from verl.utils.experimental import torch_functional as experimental
    from verl.utils.kernel import linear_cross_entropy as fused_module

    plain_logprobs, plain_entropy = torch_functional.logprobs_from_logits, torch_functional.entropy_from_logits
    model = _tiny_llama().eval()
    ids = torch.randint(0, 97, (2, 9))
    weights = torch.randn(2, 9)

    def loss_and_grads(log_probs, entropy):
        model.zero_grad()
        ((log_probs + 0.1 * entropy) * weights).sum().backward()
        return log_probs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]

    logits = model(input_ids=ids).logits / 0.8
    rolled = torch.roll(ids, shifts=-1, dims=-1)
    expected = loss_and_grads(plain_logprobs(logits, rolled), plain_entropy(logits))
    adapter.patch_logprobs()
    assert experimental.FusedLinearForPPO is adapter.FusedLinearForPPO
    assert fused_module.linear_cross_entropy is adapter.linear_cross_entropy
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=fused_kernels_backend)
    out = model(input_ids=ids, temperature=0.8, return_dict=True)
    got = loss_and_grads(out.log_probs.reshape(2, 9), out.entropy.reshape(2, 9))
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=1e-5)
    for e, a in zip(expected[2], got[2], strict=True):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize(
    "use_remove_padding,fused_kernels_backend", [(True, "torch"), (True, "triton"), (False, "torch")]
)
def test_verls_fsdp_engine_step_with_fused_kernels_runs_our_op_and_equals_its_logits_path(
    verl_patches_undone, use_remove_padding, fused_kernels_backend
):
    """verl's actor step itself: ``FSDPEngineWithLMHead.forward_step`` (verl 0.9's FSDP engine: its
    ``prepare_model_inputs``, the model's forward, ``prepare_model_outputs`` and a loss function on its nested
    log-probs and entropy), run once with ``use_fused_kernels`` on our fused head op (after ``patch_logprobs()`` and
    verl's ``patch_forward_with_backends``) and once on its logits path, packed (``use_remove_padding``) and padded:
    the log-probs, the entropy and every parameter's gradient agree. The engine object holds what ``forward_step``
    reads (its FSDP wrapping, process groups and device lookup are set-up this CPU test stands in for). Each
    sequence's last position is left out: verl labels it with the next sequence's first token on its padded logits
    path (a roll of the packed ids) and with its own row's first token on the padded fused path (its model forward
    rolls each row), so verl's two paths differ there by construction; no loss reads that position."""
    from verl.models.transformers.monkey_patch import patch_forward_with_backends
    from verl.utils.experimental import torch_functional as experimental
    from verl.utils.kernel import linear_cross_entropy as fused_module
    from verl.workers.engine.fsdp import transformer_impl as engine_module

    verl_patches_undone.setattr(engine_module, "get_device_id", lambda: "cpu")
    verl_patches_undone.setattr(engine_module, "get_device_name", lambda: "cpu")
    model = _tiny_llama()
    lengths = torch.tensor([5, 9, 3])
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 97, (int(n),), generator=g) for n in lengths]
    weights = torch.randn(int(lengths.sum()), generator=g)
    used = torch.ones(int(lengths.sum()), dtype=torch.bool)
    used[lengths.cumsum(0) - 1] = False  # each sequence's last position (see above)

    def step(use_fused_kernels):
        micro_batch = _micro_batch(
            ids, use_remove_padding=use_remove_padding, use_fused_kernels=use_fused_kernels, calculate_entropy=True
        )

        def loss_function(model_output, data, dp_group):
            values = model_output["log_probs"].values() + 0.1 * model_output["entropy"].values()
            return (values * weights * used).sum(), {}

        model.zero_grad()
        loss, output = engine_module.FSDPEngineWithLMHead.forward_step(
            _fsdp_engine(model), micro_batch, loss_function, forward_only=False
        )
        loss.backward()
        out = output["model_output"]
        return out["log_probs"].values(), out["entropy"].values(), [p.grad.clone() for p in model.parameters()]

    expected = step(use_fused_kernels=False)
    adapter.patch_logprobs()
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=fused_kernels_backend)
    assert fused_module.linear_cross_entropy is adapter.linear_cross_entropy
    assert experimental.FusedLinearForPPO is adapter.FusedLinearForPPO
    got = step(use_fused_kernels=True)
    torch.testing.assert_close(got[0][used], expected[0][used], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=1e-5)
    for e, a in zip(expected[2], got[2], strict=True):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-4)


# ---- Σπ² (verl's calculate_sum_pi_squared, for its optimal token baseline) --------------------------------------


def test_sum_pi_squared_is_verls_from_logits_and_hidden_states():
    """``return_sum_pi_squared`` on the no-grad log-prob ops equals verl's ``calculate_sum_pi_squared_from_logits``
    on the same (temperature-scaled) logits, from logits and from hidden states, on both backends."""
    from verl.utils.torch_functional import calculate_sum_pi_squared_from_logits

    from grpo_kernels import linear_token_logprobs, token_logprobs

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(3, 7, 24, generator=g), torch.randn(211, 24, generator=g) * 0.4
    logits = torch.randn(3, 7, 211, generator=g) * 2
    ids = torch.randint(0, 211, (3, 7), generator=g)
    for backend in ("torch", "triton"):
        _, squares = token_logprobs(logits, ids, 0.8, backend=backend, return_sum_pi_squared=True)
        torch.testing.assert_close(squares, calculate_sum_pi_squared_from_logits(logits / 0.8), atol=1e-6, rtol=1e-5)
        _, _, squares = linear_token_logprobs(
            hidden, weight, ids, None, 0.8, True, backend=backend, return_sum_pi_squared=True
        )
        expected = calculate_sum_pi_squared_from_logits((hidden @ weight.T) / 0.8)
        torch.testing.assert_close(squares, expected, atol=1e-6, rtol=1e-5)


def _sharded_sum_pi_squared(rank, world, logits, hidden, weight, ids, backend):
    from grpo_kernels import linear_token_logprobs, token_logprobs

    group, V = torch.distributed.group.WORLD, logits.shape[-1]
    lo, hi = rank * V // world, (rank + 1) * V // world
    _, squares = token_logprobs(
        logits[..., lo:hi].contiguous(),
        ids,
        0.8,
        backend=backend,
        vocab_parallel_group=group,
        return_sum_pi_squared=True,
    )
    _, linear = linear_token_logprobs(
        hidden, weight[lo:hi], ids, None, 0.8, backend=backend, vocab_parallel_group=group, return_sum_pi_squared=True
    )
    return squares, linear


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sum_pi_squared_over_a_vocabulary_split_is_verls_on_the_whole(backend):
    """Two gloo processes each holding half the vocabulary (logits, or the lm_head weight's rows): every rank's
    Σπ² is verl's on the whole logits."""
    from gloo_ranks import run_ranks
    from verl.utils.torch_functional import calculate_sum_pi_squared_from_logits

    g = torch.Generator().manual_seed(1)
    logits, hidden = torch.randn(2, 5, 64, generator=g) * 2, torch.randn(2, 5, 16, generator=g)
    weight, ids = torch.randn(64, 16, generator=g) * 0.4, torch.randint(0, 64, (2, 5), generator=g)
    expected = calculate_sum_pi_squared_from_logits(logits / 0.8)
    expected_linear = calculate_sum_pi_squared_from_logits((hidden @ weight.T) / 0.8)
    for squares, linear in run_ranks(_sharded_sum_pi_squared, 2, logits, hidden, weight, ids, backend):
        torch.testing.assert_close(squares, expected, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(linear, expected_linear, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("use_remove_padding", [True, False])
def test_verls_fsdp_engine_serves_sum_pi_squared_with_fused_kernels(verl_patches_undone, use_remove_padding):
    """verl's FSDP engine's no-grad step (``compute_log_prob``'s: ``forward_only``) with ``calculate_sum_pi_squared``
    and ``use_fused_kernels``, which verl refuses with its own fused kernels, runs on our fused head op after
    ``patch_logprobs()`` and gives its logits path's Σπ² (``calculate_sum_pi_squared_from_logits``), packed and
    padded; verl's ``compute_optimal_token_baseline_advantage`` on ours equals it on verl's own."""
    from verl.models.transformers.monkey_patch import patch_forward_with_backends
    from verl.trainer.ppo.core_algos import compute_optimal_token_baseline_advantage
    from verl.workers.engine.fsdp import transformer_impl as engine_module

    verl_patches_undone.setattr(engine_module, "get_device_id", lambda: "cpu")
    verl_patches_undone.setattr(engine_module, "get_device_name", lambda: "cpu")
    model = _tiny_llama()
    lengths = torch.tensor([5, 9, 3, 7])
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, 97, (int(n),), generator=g) for n in lengths]
    used = torch.ones(int(lengths.sum()), dtype=torch.bool)
    used[lengths.cumsum(0) - 1] = False  # each sequence's last position differs on verl's two paths (see above)

    def step(use_fused_kernels):
        micro_batch = _micro_batch(
            ids,
            use_remove_padding=use_remove_padding,
            use_fused_kernels=use_fused_kernels,
            calculate_entropy=False,
            calculate_sum_pi_squared=True,
        )
        with torch.no_grad():
            _, output = engine_module.FSDPEngineWithLMHead.forward_step(
                _fsdp_engine(model),
                micro_batch,
                lambda model_output, data, dp_group: (torch.zeros(()), {}),
                forward_only=True,
            )
        out = output["model_output"]
        return out["log_probs"].values(), out["sum_pi_squared"].values()

    expected_logp, expected = step(use_fused_kernels=False)
    adapter.patch_logprobs()
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
    logp, squares = step(use_fused_kernels=True)
    torch.testing.assert_close(logp[used], expected_logp[used], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(squares[used], expected[used], atol=1e-6, rtol=1e-5)

    def padded(values):  # the (bs, T) layout verl's advantage estimators read, the last position masked out
        rows = torch.zeros(len(ids), int(lengths.max()))
        mask = torch.zeros_like(rows)
        for i, (start, n) in enumerate(zip((lengths.cumsum(0) - lengths).tolist(), lengths.tolist(), strict=True)):
            rows[i, :n] = values[start : start + n]
            mask[i, : n - 1] = 1.0
        return rows, mask

    rewards, mask = padded(torch.randn(int(lengths.sum()), generator=g))
    index = np.array([0, 0, 1, 1])
    ours = compute_optimal_token_baseline_advantage(rewards, mask, index, padded(logp)[0], padded(squares)[0])
    theirs = compute_optimal_token_baseline_advantage(
        rewards, mask, index, padded(expected_logp)[0], padded(expected)[0]
    )
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_remove_padding", [True, False])
def test_verls_fsdp_engine_serves_top_k_distillation_with_fused_kernels(verl_patches_undone, use_remove_padding):
    """verl's FSDP engine's training step with top-k distillation (``distillation_use_topk``, the teacher's top-k in
    the micro-batch, verl's distillation loss bound with its config as its actor binds it) under
    ``use_fused_kernels``, where verl's own FSDP fused path gives no distillation outputs (it reads a
    ``fused_linear_aux`` only veomni's kernels make; its dense branch none), runs on our fused head after
    ``patch_logprobs()``: its per-token distillation loss and both top-k masses, and the model's gradient from them,
    equal verl's logits path (its own ``compute_forward_kl_topk`` on the [N, V] logits), packed and padded."""
    import functools

    from verl.models.transformers.monkey_patch import patch_forward_with_backends
    from verl.trainer.distillation import losses as verl_losses
    from verl.workers.config import DistillationConfig, DistillationLossConfig
    from verl.workers.engine.fsdp import transformer_impl as engine_module

    verl_patches_undone.setattr(engine_module, "get_device_id", lambda: "cpu")
    verl_patches_undone.setattr(engine_module, "get_device_name", lambda: "cpu")
    model = _tiny_llama()
    lengths, K = torch.tensor([5, 9, 3, 7]), 4
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 97, (int(n),), generator=g) for n in lengths]
    teacher = []
    for n in lengths:  # the teacher's top K - 1 and its least likely id, which the clamp at -6 binds
        logps = torch.log_softmax(3 * torch.randn(int(n), 97, generator=g), -1)
        top = torch.cat([logps.topk(K - 1, -1).indices, logps.argmin(-1, keepdim=True)], -1)
        teacher.append(types.SimpleNamespace(indices=top, values=logps.gather(-1, top)))
    assert all((t.values[:, -1] < -6).all() for t in teacher)
    actor = _config()
    distillation_config = DistillationConfig(
        distillation_loss=DistillationLossConfig(
            loss_mode="forward_kl_topk", topk=K, use_policy_gradient=False, log_prob_min_clamp=-6.0
        )
    )

    def distillation_loss(model_output=None, data=None, dp_group=None, student_logits=None, *, config,
                          distillation_config):  # fmt: skip
        """verl's logits processor on the logits path (``compute_topk_loss``), then a loss of the per-token values."""
        if student_logits is not None:
            return verl_losses.compute_topk_loss(config, distillation_config, data, student_logits, "thd")
        return model_output["distillation_losses"].values().sum(), {}

    loss_function = functools.partial(distillation_loss, config=actor, distillation_config=distillation_config)

    def step(use_fused_kernels):
        micro_batch = _micro_batch(
            ids,
            {"teacher_ids": [t.indices for t in teacher], "teacher_logprobs": [t.values for t in teacher]},
            use_remove_padding=use_remove_padding,
            use_fused_kernels=use_fused_kernels,
            calculate_entropy=False,
            distillation_use_topk=True,
            distillation_only=True,
        )
        model.zero_grad()
        loss, output = engine_module.FSDPEngineWithLMHead.forward_step(
            _fsdp_engine(model), micro_batch, loss_function, forward_only=False
        )
        loss.backward()
        out = output["model_output"]
        values = {name: out[name].values() for name in ("distillation_losses", "student_mass", "teacher_mass")}
        return values, {name: p.grad.clone() for name, p in model.named_parameters()}

    expected, expected_grads = step(use_fused_kernels=False)
    adapter.patch_logprobs()
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
    ours, grads = step(use_fused_kernels=True)
    for name, value in expected.items():
        torch.testing.assert_close(ours[name], value, atol=1e-5, rtol=1e-5, msg=name)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
