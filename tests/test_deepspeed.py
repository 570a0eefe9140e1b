"""The TRL adapter inside DeepSpeed ZeRO-2 and ZeRO-3 (through accelerate, on 2 CPU ranks over gloo) equals stock
TRL under the same config: the loss and every logged metric at each step (the gradient's norm, gathered from
ZeRO's partitions, among them) and the parameters after the steps; the logits path and the fused lm_head, tied and
untied heads. Each run is its own ``torchrun`` (tests/distributed_train.py)."""

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/setup.sh installs it)")
pytest.importorskip("trl", reason="the trl extra is not installed")

from distributed_runs import assert_same_training, save_tiny_models, train_run  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_tiny_models(tmp_path_factory.mktemp)


@pytest.mark.parametrize("head", ["tied", "untied"])
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_matches_stock_trl(stage, head, models, tmp_path):
    stock = train_run(f"zero{stage}", "stock", models[head], tmp_path / "stock.pt")
    for which in ("logits", "fused"):
        ours = train_run(f"zero{stage}", which, models[head], tmp_path / f"{which}.pt")
        assert_same_training(stock, ours, f"ZeRO-{stage} {head} {which}")
