"""grpo_kernels/integration/README.md's "Which code runs" tables against the code: every TRL loss type, every verl
loss_mode in verl's registry and every OpenRLHF PolicyLoss / KL choice has a row, and a row says "ours" exactly
where an adapter implements that option (the adapters' own tests hold "ours" to the trainers' numbers)."""

import pathlib
import re

import pytest
from helpers import TRL_LOSS_TYPES

from grpo_kernels.integration import openrlhf
from grpo_kernels.options import LOSS_TYPES

README = pathlib.Path(__file__).resolve().parents[1] / "grpo_kernels" / "integration" / "README.md"


def table(heading: str) -> dict:
    """The rows of the table under ``#### {heading}``: first cell -> second cell."""
    text = README.read_text()
    start = text.index(f"#### {heading}")
    rows = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and not set(cells[0]) <= set("-"):
            rows[cells[0]] = cells[1]
    return rows


def test_the_table_reader_reads_the_rows():
    rows = table("OpenRLHF")
    assert rows["`--actor.policy_loss_type ppo`"] == "ours" and "OpenRLHF option" in rows


def test_trl_table():
    trl = pytest.importorskip("trl", reason="the trl extra is not installed")
    import dataclasses

    help_text = next(f for f in dataclasses.fields(trl.GRPOConfig) if f.name == "loss_type").metadata["help"]
    supported = re.search(r"Supported values are (.*?)\.", help_text).group(1)
    trl_loss_types = re.findall(r"'(\w+)'", supported)
    rows = table("TRL")
    assert trl_loss_types and set(trl_loss_types) <= set(LOSS_TYPES), "TRL has a loss type we lack: add its row"
    assert set(trl_loss_types) == set(TRL_LOSS_TYPES), "tests/helpers.py's TRL_LOSS_TYPES are TRL's"
    for name in trl_loss_types:
        assert rows[f'`loss_type="{name}"`'] == "ours", name


def test_verl_table():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed")
    from grpo_kernels.integration import verl

    verl.register()
    rows = table("verl")
    modes = sorted(m for m in core_algos.POLICY_LOSS_REGISTRY if not m.startswith("grpo_kernels"))
    assert len(modes) == 12, modes
    for mode in modes:  # each is ours (tests/test_verl_integration.py holds it to verl's)
        assert rows[f"`{mode}`"].startswith(f"ours, as `grpo_kernels_{mode}`"), mode
        assert core_algos.get_policy_loss_fn(f"grpo_kernels_{mode}") is verl.POLICY_LOSSES[mode]
    assert core_algos.get_policy_loss_fn("grpo_kernels") is verl.vanilla_policy_loss


def test_openrlhf_table():
    rows = table("OpenRLHF")
    choices = (
        [f"--actor.policy_loss_type {t}" for t in openrlhf.POLICY_LOSS_TYPES]
        + [f"--algo.advantage.is_correction_level {v}" for v in openrlhf.IS_CORRECTION_LEVELS if v != "off"]
        + [f"--algo.advantage.is_correction_mode {v}" for v in openrlhf.IS_CORRECTION_MODES]
        + [f"--algo.advantage.is_correction_gating {v}" for v in openrlhf.IS_CORRECTION_GATINGS]
        + [f"--algo.kl.estimator {v}" for v in openrlhf.KL_ESTIMATORS]
        + [
            "--actor.loss_agg_mode token-mean",
            "--actor.loss_agg_mode seq-mean-token-mean",
            "--algo.kl.unbiased_gradient",
        ]
    )
    for choice in choices:
        assert rows[f"`{choice}`"] == "ours", choice
    assert len([r for r in rows.values() if r == "ours"]) == len(choices) + 1  # and the clip options' row
