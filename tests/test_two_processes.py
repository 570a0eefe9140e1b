"""Stock TRL on two processes against our adapter on two processes: whole ``train()`` runs under DDP (accelerate,
torchrun, 2 gloo ranks), SGD, compared step by step (the loss and every logged metric, each step's all-reduced
gradients, the final weights): dapo's and cispo's ``num_items_in_batch`` divided by the processes, grpo with a KL
and ``steps_per_generation`` > 1, the gathered metrics (``clip_ratio/low_min`` / ``high_max``), adaptive entropy's
window reduced across ranks, and the fused lm_head.

Not FSDP2: accelerate 1.16 turns on its FSDP plugin only for multi-accelerator runs, so on CPU ranks a TRL
config's ``fsdp=`` trains as DDP (tests/distributed_train.py). Our fused lm_head under FSDP2's ``fully_shard`` is
held to the unsharded loss in tests/test_trl_integration.py and tests/test_wrapped.py."""

import pytest

pytest.importorskip("trl", reason="the trl extra is not installed")

from distributed_runs import assert_same_training, save_tiny_models, train_runs

CONFIGS = {
    "dapo": dict(loss_type="dapo"),
    "grpo, KL, steps_per_generation 4": dict(
        loss_type="grpo", beta=0.04, steps_per_generation=4, gradient_accumulation_steps=2, max_steps=4
    ),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "adaptive entropy": dict(
        loss_type="grpo", use_adaptive_entropy=True, entropy_coef=0.1, entropy_target=100.0, entropy_coef_delta=0.05
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_tiny_models(tmp_path_factory.mktemp)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_two_process_train_matches_stock_trl(config, models, tmp_path):
    runs = train_runs("ddp", ["stock", "logits"], models["untied"], tmp_path, **CONFIGS[config])
    assert_same_training(runs["stock"], runs["logits"], config)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_process_train_with_the_fused_lm_head_matches_stock_trl(loss_type, models, tmp_path):
    runs = train_runs("ddp", ["stock", "fused"], models["tied"], tmp_path, loss_type=loss_type)
    assert_same_training(runs["stock"], runs["fused"], f"fused lm_head, {loss_type}")
