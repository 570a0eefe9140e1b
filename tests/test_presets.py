"""Each preset is its trainer's loss, held to the trainer's own code: TRL 1.16's ``GRPOTrainer.compute_loss``,
verl 0.9's ``core_algos`` (``compute_policy_loss_vanilla``, ``kl_penalty``, ``agg_loss``) and OpenRLHF 0.11.2's
``PolicyLoss``, ``compute_approx_kl`` and ``aggregate_loss`` (from its wheel, ``tests/openrlhf_code.py``), at the
trainer's defaults and for the flags a GRPO user sets: the loss and the gradient of the logits, on a ragged batch
with an empty row. What one reduction cannot express is refused by name."""

import pytest
import torch
from openrlhf_code import openrlhf_code

from grpo_kernels import GRPOLoss
from grpo_kernels.options import GRPOOptions

LENGTHS = (1, 9, 4, 0, 7, 3)
T, V = max(LENGTHS), 23
BACKENDS = ["torch", "triton"]


def batch(seed=0, spread=0.4):
    """Logits [B, T, V] (with gradient), ids, mask, per-token advantages, old and reference log-probs."""
    g = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    logits = (torch.randn(B, T, V, generator=g) * 1.5).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    with torch.no_grad():
        lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    old = (lp + spread * torch.randn(B, T, generator=g)) * mask
    ref = (lp + 2 * spread * torch.randn(B, T, generator=g)) * mask
    adv = (torch.randn(B, 1, generator=g) * 1.5).expand(B, T).clone()
    return logits, ids, mask, adv, old, ref


def their_logps(logits, ids, mask):
    """The trainers' log-probs of the same logits (fp32 log_softmax, gathered), 0 at padding."""
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None])[..., 0] * mask


def ours(preset, logits, ids, mask, adv, old, ref, backend, normalizer=None, **overrides):
    loss = GRPOLoss(preset=preset, backend=backend, **overrides)
    out = loss(
        logits, ids, mask, adv, old_logps=old, ref_logps=ref if loss.options.beta else None, normalizer=normalizer
    )
    return out.loss


def assert_same(preset, theirs_fn, backend, normalizer=None, seed=0, **overrides):
    logits, ids, mask, adv, old, ref = batch(seed)
    twin = logits.detach().clone().requires_grad_()
    expected = theirs_fn(their_logps(logits, ids, mask), old, ref, adv, mask)
    actual = ours(preset, twin, ids, mask, adv, old, ref, backend, normalizer, **overrides)
    expected.backward()
    actual.backward()
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(twin.grad, logits.grad, atol=1e-7, rtol=1e-5)


# ---- verl ----------------------------------------------------------------------------------------------------------

VERL_FLAGS = {  # (our overrides, verl's actor config and KL loss)
    "defaults": ({}, dict(), None),
    "low_var_kl": (dict(beta=0.01), dict(), "low_var_kl"),
    "k1 KL": (dict(beta=0.01, kl_estimator="k1"), dict(), "kl"),
    "low_var_kl+": (dict(beta=0.01, kl_estimator="k3+"), dict(), "low_var_kl+"),
    "k1+": (dict(beta=0.01, kl_estimator="k1+"), dict(), "k1+"),
    "k2 KL": (dict(beta=0.01, kl_estimator="k2"), dict(), "mse"),
    "clip-higher": (dict(epsilon=0.2, epsilon_high=0.28), dict(clip_ratio_low=0.2, clip_ratio_high=0.28), None),
    "dual-clip 10": (dict(dual_clip=10.0), dict(clip_ratio_c=10.0), None),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dp", [1, 2], ids=["one rank", "two ranks"])
@pytest.mark.parametrize("flags", list(VERL_FLAGS))
def test_verl_preset_is_verls_loss(flags, dp, backend):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed")
    from verl.workers.config import ActorConfig

    overrides, config_kw, kl_penalty = VERL_FLAGS[flags]
    _, _, mask, *_ = batch()
    tokens = mask.sum() * dp  # the other rank's tokens: as many
    info = dict(dp_size=dp, batch_num_tokens=float(tokens), global_batch_size=5.0 * dp)
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=2,
        ppo_micro_batch_size_per_gpu=1,
        global_batch_info=info,
        **{"clip_ratio": 0.2, **config_kw},
    )

    def verl(lp, old, ref, adv, mask):
        loss, _ = core_algos.compute_policy_loss_vanilla(old, lp, adv, mask, "token-mean", config)
        if kl_penalty is not None:
            kl = core_algos.agg_loss(core_algos.kl_penalty(lp, ref, kl_penalty), mask, "token-mean", **info)
            loss = loss + overrides["beta"] * kl
        return loss

    assert_same("verl", verl, backend, normalizer=tokens / dp, **overrides)


# ---- OpenRLHF ------------------------------------------------------------------------------------------------------

OPENRLHF_FLAGS = {  # (our overrides, PolicyLoss's arguments, the KL loss's estimator or None)
    "defaults: k1 KL loss": (dict(beta=0.01), dict(), "k1"),
    "no KL loss": ({}, dict(), None),
    "k3 KL": (dict(beta=0.01, kl_estimator="k3"), dict(), "k3"),
    "k2 KL": (dict(beta=0.01, kl_estimator="k2"), dict(), "k2"),
    "clip-higher": (dict(epsilon=0.2, epsilon_high=0.28), dict(clip_eps_low=0.2, clip_eps_high=0.28), None),
    "dual-clip": (dict(dual_clip=3.0, beta=0.01), dict(dual_clip=3.0), "k1"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dp", [1, 2], ids=["one rank", "two ranks"])
@pytest.mark.parametrize("flags", list(OPENRLHF_FLAGS))
def test_openrlhf_preset_is_openrlhfs_loss(flags, dp, backend):
    """OpenRLHF's actor: PolicyLoss(...)[0] + kl_ctl * aggregate_loss(compute_approx_kl(...)), token-mean, with
    the global token count of ``dp`` ranks (``batch_num_tokens``) as its trainer passes it."""
    utils, loss_code = openrlhf_code()
    overrides, policy_kw, estimator = OPENRLHF_FLAGS[flags]
    _, _, mask, *_ = batch()
    tokens = mask.sum() * dp
    info = dict(dp_size=dp, batch_num_tokens=tokens, global_batch_size=torch.tensor(5.0 * dp))

    def openrlhf(lp, old, ref, adv, mask):
        loss = loss_code.PolicyLoss(**policy_kw)(lp, old, adv, mask, None, **info)[0]
        if estimator is not None:
            kl = loss_code.aggregate_loss(utils.compute_approx_kl(lp, ref, old, estimator), mask, **info)
            loss = loss + overrides["beta"] * kl
        return loss

    assert_same("openrlhf", openrlhf, backend, normalizer=tokens / dp, **overrides)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("accumulation", [1, 3], ids=["one micro-batch", "three micro-batches"])
def test_openrlhf_preset_entropy_loss_is_openrlhfs(backend, accumulation):
    """``--actor.entropy_coef``: OpenRLHF's actor subtracts ``entropy_coef * aggregate_loss(entropy, mask,
    **loss_batch_info)``, the entropy summed over this micro-batch's tokens and divided by the global token count
    (an uneven second rank's tokens, and with gradient accumulation the other micro-batches' too) times
    ``dp_size``: the preset divides it as its policy loss is (``entropy_reduction="loss"``), not by the local
    tokens."""
    utils, loss_code = openrlhf_code()
    logits, ids, mask, adv, old, ref = batch(seed=4)
    dp, coef = 2, 0.05
    tokens = mask.sum() * accumulation + 17.0  # this rank's window of micro-batches, and another rank's 17 tokens
    info = dict(dp_size=dp, batch_num_tokens=tokens, global_batch_size=torch.tensor(11.0))
    twin = logits.detach().clone().requires_grad_()
    lp = their_logps(logits, ids, mask)
    entropy = getattr(utils.compute_entropy, "_torchdynamo_orig_callable", utils.compute_entropy)(logits.float())
    expected = (
        loss_code.PolicyLoss()(lp, old, adv, mask, None, **info)[0]
        + 0.01 * loss_code.aggregate_loss(utils.compute_approx_kl(lp, ref, old, "k1"), mask, **info)
        - coef * loss_code.aggregate_loss(entropy, mask, **info)
    )
    actual = ours(
        "openrlhf", twin, ids, mask, adv, old, ref, backend, normalizer=tokens / dp, beta=0.01, entropy_coef=coef
    )
    expected.backward()
    actual.backward()
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(twin.grad, logits.grad, atol=1e-7, rtol=1e-5)
    # the local mean (TRL's bonus) is another number here
    local = ours(
        "openrlhf",
        logits.detach(),
        ids,
        mask,
        adv,
        old,
        ref,
        backend,
        normalizer=tokens / dp,
        beta=0.01,
        entropy_coef=coef,
        entropy_reduction="token_mean",
    )
    assert abs(float(local) - float(expected)) > 1e-4


def test_openrlhf_k3_clamps_bind_and_match():
    """k3 far from the reference: OpenRLHF clamps log(pi / pi_ref) at -10 from below, then the value to +-10."""
    utils, loss_code = openrlhf_code()
    logits, ids, mask, adv, old, _ = batch(4)
    ref = their_logps(logits, ids, mask).detach() + 12 * torch.randn(
        mask.shape, generator=torch.Generator().manual_seed(9)
    )
    twin = logits.detach().clone().requires_grad_()
    lp = their_logps(logits, ids, mask)
    assert float((lp - ref).detach().abs().max()) > 11
    expected = loss_code.PolicyLoss()(lp, old, adv, mask)[0] + 0.1 * loss_code.aggregate_loss(
        utils.compute_approx_kl(lp, ref, old, "k3"), mask
    )
    actual = ours("openrlhf", twin, ids, mask, adv, old, ref, "torch", beta=0.1, kl_estimator="k3")
    expected.backward()
    actual.backward()
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(twin.grad, logits.grad, atol=1e-7, rtol=1e-5)


# ---- TRL -----------------------------------------------------------------------------------------------------------

TRL_FLAGS = {  # GRPOConfig's keywords, which are also the preset's overrides
    "defaults": dict(),
    "k3 KL, clip-higher": dict(beta=0.04, epsilon_high=0.28),
    "delta": dict(delta=1.5, beta=0.04),
    "sequence level": dict(importance_sampling_level="sequence"),
    "grpo": dict(loss_type="grpo", beta=0.04),
}


@pytest.mark.parametrize("flags", list(TRL_FLAGS))
def test_trl_preset_is_trls_loss(flags, tmp_path):
    """Stock GRPOTrainer.compute_loss on a tiny model against GRPOLoss(preset="trl") on the same model's logits
    (TRL's normalizer for dapo: num_items_in_batch over the processes)."""
    pytest.importorskip("trl", reason="the trl extra is not installed")
    from datasets import Dataset
    from test_trl_integration import T as TRL_T
    from test_trl_integration import _batch, _trainer
    from trl import GRPOTrainer

    from grpo_kernels.training.tasks import compare

    path = tmp_path / "model"
    tokenizer = compare.build_tokenizer()
    compare.build_model(tokenizer, hidden_size=32, seed=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    rows = compare.make_rows(16, held_out=False, seed=0)
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    config = TRL_FLAGS[flags]
    stock = _trainer(GRPOTrainer, str(path), data, tmp_path, **config)
    inputs = _batch(stock, off_policy=True, beta=config.get("beta", 0.0))
    stock.model.train()
    stock.current_gradient_accumulation_steps = 1
    stock.model.zero_grad(set_to_none=True)
    stock.compute_loss(stock.model, dict(inputs)).backward()
    expected = [p.grad.clone() for p in stock.model.parameters()]
    stock.model.zero_grad(set_to_none=True)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logits = stock.model(input_ids=ids, attention_mask=attention, logits_to_keep=TRL_T + 1).logits
    options = GRPOOptions.from_preset("trl", **config, temperature=stock.temperature)
    assert options.loss_type == config.get("loss_type", stock.args.loss_type)  # the preset's default is TRL's
    out = GRPOLoss(options=options, drop_last_position=True)(
        logits,
        inputs["completion_ids"],
        inputs["completion_mask"],
        inputs["advantages"],
        old_logps=inputs["old_per_token_logps"],
        ref_logps=inputs.get("ref_per_token_logps"),
        normalizer=inputs["num_items_in_batch"] if options.loss.takes_normalizer else None,
    )
    out.loss.backward()
    for e, a in zip(expected, stock.model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, e, atol=1e-6, rtol=1e-4)


# ---- refusals ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset, overrides, names",
    [
        ("openrlhf", dict(loss_type="grpo"), "seq-mean-token-mean"),
        ("openrlhf", dict(importance_sampling_level="sequence"), "policy_loss_type gspo"),
        ("verl", dict(loss_type="bnpo"), "loss_agg_modes"),
        ("verl", dict(importance_sampling_level="sequence_token"), "'gspo' loss_mode"),
    ],
)
def test_a_loss_one_reduction_cannot_express_is_refused_by_name(preset, overrides, names):
    with pytest.raises(ValueError, match=f"preset='{preset}' takes") as err:
        GRPOLoss(preset=preset, **overrides)
    assert names in str(err.value) and f"grpo_kernels.integration.{preset}" in str(err.value)


def test_verl_clamps_only_its_k3():
    assert GRPOOptions.from_preset("verl").kl_clamp == 10.0
    assert GRPOOptions.from_preset("verl", kl_estimator="k1").kl_clamp is None
    assert GRPOOptions.from_preset("openrlhf", kl_estimator="k2").kl_clamp == 10.0
