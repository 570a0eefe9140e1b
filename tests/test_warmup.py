"""The built-in task's format warm-up ends on what it is for: at a check, once the sampled answers are
well-formed at the target (else at the cap, after which a stage of larger batches goes on to the target or its own
cap); the checks sample as the GRPO phase does, on prompts of their own, with a generator of their own; the run
logs the warm-up's steps, rate and time, and the malformed shares."""

import json
import os

import pytest
import torch

from grpo_kernels.training import cli
from grpo_kernels.training.tasks import compare


@pytest.fixture
def tiny():
    tokenizer = compare.build_tokenizer()
    return compare.build_model(tokenizer, hidden_size=32, seed=3), tokenizer


def test_the_warmup_stops_at_the_first_check_that_reaches_the_target(tiny, monkeypatch):
    model, tokenizer = tiny
    rates = iter([0.5, 0.8, 0.95, 0.99])
    seen = []

    def share(model_, tokenizer_, rows, **kwargs):
        seen.append((len(rows), kwargs["temperature"], kwargs["max_new_tokens"]))
        return next(rates)

    monkeypatch.setattr(compare, "well_formed_share", share)
    record = compare.warmup(
        model, tokenizer, steps=40, check_every=5, format_target=0.9, temperature=0.7, max_new_tokens=6
    )
    assert record["warmup_steps"] == 15 and record["warmup_well_formed"] == 0.95
    assert seen == [(compare.WARMUP_CHECK_PROMPTS, 0.7, 6)] * 3
    assert record["warmup_seconds"] >= 0


def _spy_on_stages(monkeypatch):
    stages = []
    run_stage = compare._format_stage

    def spy(model, tokenizer, **kwargs):
        stages.append({k: kwargs[k] for k in ("steps", "batch_size", "lr", "check_every")})
        return run_stage(model, tokenizer, **kwargs)

    monkeypatch.setattr(compare, "_format_stage", spy)
    return stages


def test_a_warmup_that_reaches_the_target_has_no_large_batch_stage(tiny, monkeypatch):
    model, tokenizer = tiny
    stages = _spy_on_stages(monkeypatch)
    rates = iter([0.5, 0.9])
    monkeypatch.setattr(compare, "well_formed_share", lambda *a, **k: next(rates))
    record = compare.warmup(model, tokenizer, steps=10, check_every=5, format_target=0.9)
    assert (record["warmup_steps"], record["warmup_large_batch_steps"], record["warmup_well_formed"]) == (10, 0, 0.9)
    assert stages == [{"steps": 10, "batch_size": 32, "lr": 2e-3, "check_every": 5}]


def test_the_warmup_goes_on_with_large_batches_when_the_cap_comes_first(tiny, monkeypatch):
    model, tokenizer = tiny
    stages = _spy_on_stages(monkeypatch)
    rates = iter([0.5, 0.6, 0.7, 0.95])  # stage one's checks at 5 and 10 (its cap); stage two's every 2 steps
    seen = []

    def share(model_, tokenizer_, rows, **kwargs):
        seen.append(len(rows))
        return next(rates)

    monkeypatch.setattr(compare, "well_formed_share", share)
    record = compare.warmup(model, tokenizer, steps=10, check_every=5, format_target=0.9, large_batch_steps=6)
    assert (record["warmup_steps"], record["warmup_large_batch_steps"], record["warmup_well_formed"]) == (10, 4, 0.95)
    assert stages == [
        {"steps": 10, "batch_size": 32, "lr": 2e-3, "check_every": 5},
        {
            "steps": 6,
            "batch_size": compare.WARMUP_LARGE_BATCH_SIZE,
            "lr": 2e-3 * compare.WARMUP_LARGE_BATCH_LR_SCALE,
            "check_every": 2,
        },
    ]
    assert seen == [compare.WARMUP_CHECK_PROMPTS] * 4  # the same check prompts in both stages


def test_the_warmup_runs_to_both_caps_when_the_target_is_not_reached(tiny, monkeypatch):
    model, tokenizer = tiny
    stages = _spy_on_stages(monkeypatch)
    monkeypatch.setattr(compare, "well_formed_share", lambda *a, **k: 0.1)
    record = compare.warmup(model, tokenizer, steps=12, check_every=5)
    # checked at each cap too; the second stage's cap defaults to a third of the first's
    assert (record["warmup_steps"], record["warmup_large_batch_steps"], record["warmup_well_formed"]) == (12, 4, 0.1)
    assert [stage["steps"] for stage in stages] == [12, 4]
    record = compare.warmup(model, tokenizer, steps=3, check_every=5, large_batch_steps=0)
    assert (record["warmup_steps"], record["warmup_large_batch_steps"]) == (3, 0) and len(stages) == 3


def test_a_negative_large_batch_cap_is_refused(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="large_batch_steps must be >= 0.*got -1"):
        compare.warmup(model, tokenizer, steps=2, large_batch_steps=-1)


def test_the_check_samples_prompts_of_its_own_and_leaves_the_runs_generator(tiny):
    model, tokenizer = tiny
    rows = compare.make_rows(8, held_out=False, seed=5)
    assert not any(compare._held_out(r["a"], r["b"]) for r in rows)
    torch.manual_seed(11)
    state = torch.get_rng_state()
    first = compare.well_formed_share(model, tokenizer, rows, seed=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert compare.well_formed_share(model, tokenizer, rows, seed=2) == first and 0.0 <= first <= 1.0


def test_the_run_logs_the_warmup_and_the_malformed_shares(tmp_path):
    out = str(tmp_path / "run")
    assert (
        cli.main(
            [
                "train",
                "--warmup-steps",
                "6",
                "--steps",
                "2",
                "--eval-size",
                "8",
                "--group-size",
                "2",
                "--prompts-per-step",
                "2",
                "--eval-every",
                "1",
                "--save-every",
                "0",
                "--output-dir",
                out,
                "--no-progress",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert rows[0]["step"] == 0 and rows[0]["warmup_steps"] == 6 and 0 <= rows[0]["warmup_well_formed"] <= 1
    assert rows[0]["warmup_large_batch_steps"] in (0, 1, 2)  # a second stage of up to 6 // 3 steps
    assert all(0 <= r["eval_malformed"] <= 1 for r in rows if "eval_accuracy" in r)
    assert all(0 <= r["malformed"] <= 1 for r in rows if "reward" in r)
