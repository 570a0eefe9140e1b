"""The thin trainer and its command line on the built-in task (CPU, tiny shapes)."""

import copy
import dataclasses
import json
import os
import statistics

import pytest
import torch

from grpo_kernels.training import cli, seeds
from grpo_kernels.training.checkpoint import latest_checkpoint
from grpo_kernels.training.rewards import numeric_match, parse_number
from grpo_kernels.training.tasks import compare
from grpo_kernels.training.trainer import GRPOTrainer, TrainerConfig


@pytest.fixture(scope="module")
def tiny():
    tokenizer = compare.build_tokenizer()
    model = compare.build_model(tokenizer, hidden_size=32)
    return model, tokenizer


def _trainer(tiny, reward_funcs=None, **config):
    model, tokenizer = tiny
    rows = compare.make_rows(8, held_out=False, seed=0)
    funcs = reward_funcs or [numeric_match]
    config = dict(group_size=2, prompts_per_step=2) | config
    return GRPOTrainer(model, tokenizer, funcs, rows, TrainerConfig(**config))


def test_task_rows_are_verifiable_and_held_out_is_disjoint():
    train = compare.make_rows(300, held_out=False, seed=0)
    held = compare.make_rows(100, held_out=True, seed=1)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    for r in train[:50]:
        assert r["answer"] == max(r["a"], r["b"], key=float) and float(r["a"]) != float(r["b"])
    assert any(r["a"].split(".")[0] == r["b"].split(".")[0] for r in train)  # the 9.11 vs 9.9 trap


def test_rewards_parse_numbers_in_any_plain_form():
    assert parse_number(" 0.50 ") == 0.5 and parse_number(".5") == 0.5 and parse_number("9.") == 9.0
    assert parse_number("9.9.9") is None and parse_number("nine") is None
    assert numeric_match(["p"] * 4, ["9.9", "9.11", ".5", "x"], ["9.90", "9.9", "0.5", "1"]) == [1.0, 0.0, 1.0, 0.0]
    assert numeric_match(["p"], ["1"], [None]) == [None]


def test_generation_masks_up_to_and_including_eos(tiny):
    trainer = _trainer(tiny, max_new_tokens=6)
    _, _, ids, mask = trainer.generate([r["prompt"] for r in trainer.train_rows[:4]])
    eos, pad = trainer.tokenizer.eos_token_id, trainer.tokenizer.pad_token_id
    for row_ids, row_mask in zip(ids.tolist(), mask.tolist(), strict=True):
        n = sum(row_mask)
        assert row_mask == [1] * n + [0] * (len(row_mask) - n)
        assert eos not in row_ids[: n - 1] and all(t == pad for t in row_ids[n:])


def test_one_step_changes_the_policy_and_logs_metrics(tiny):
    trainer = _trainer(tiny, beta=0.04, num_iterations=2, learning_rate=1e-2)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    record = trainer.train_step()
    assert set(record) >= {"step", "reward", "kl", "accuracy", "loss", "zero_std_groups"}
    assert all(torch.isfinite(torch.tensor(v)) for v in record.values())
    # unless every group had equal rewards (no signal), the weights moved
    moved = any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert moved or record["zero_std_groups"] == 1.0


def test_reward_function_errors_are_named(tiny):
    def broken(prompts, completions, **_):
        raise KeyError("answer")

    def short(prompts, completions, **_):
        return [1.0]

    with pytest.raises(RuntimeError, match="reward function broken raised KeyError"):
        _trainer(tiny, [broken]).train_step()
    with pytest.raises(ValueError, match=r"reward function short must return one score per completion \(4\), got 1"):
        _trainer(tiny, [short]).train_step()


def test_bad_configuration_is_refused(tiny):
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        TrainerConfig(group_size=1)
    with pytest.raises(ValueError, match="reward_funcs must hold at least one"):
        GRPOTrainer(*tiny, [], [], TrainerConfig())
    trainer = _trainer(tiny, max_new_tokens=60)
    with pytest.raises(ValueError, match="exceeds the model's context of 64 positions"):
        trainer.train_step()
    with pytest.raises(FileNotFoundError, match="is not a folder with a saved model"):
        cli.main(["train", "--model", "/nonexistent/model", "--steps", "1"])


def test_cli_train_resume_and_eval(tmp_path, capsys):
    out = str(tmp_path / "run")
    common = [
        "--warmup-steps",
        "5",
        "--eval-size",
        "8",
        "--group-size",
        "2",
        "--prompts-per-step",
        "2",
        "--output-dir",
        out,
        "--no-progress",
        "--save-every",
        "2",
        "--eval-every",
        "2",
    ]
    assert cli.main(["train", "--steps", "3", *common]) == 0
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    evals = [r for r in lines if "eval_accuracy" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 3
    assert [r["step"] for r in lines if "reward" in r] == [1, 2, 3]
    assert all({"step", "reward", "kl"} <= set(r) for r in lines if "reward" in r)
    assert os.path.exists(os.path.join(out, "curves.png"))
    assert latest_checkpoint(out).endswith("checkpoint-3")
    assert os.path.isdir(os.path.join(out, "checkpoint-2"))  # the periodic one is kept

    assert cli.main(["train", "--steps", "5", "--resume", *common]) == 0
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in lines if "reward" in r] == [1, 2, 3, 4, 5]
    capsys.readouterr()
    assert cli.main(["eval", latest_checkpoint(out), "--eval-size", "8"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["eval_size"] == 8 and 0.0 <= result["eval_accuracy"] <= 1.0


# The short run's gain over its step-0 accuracy varies with the trajectory a machine draws (floating point
# differs between CPUs, and RL turns a last-bit difference into another run). Re-derived with the warm-up that
# checks the format (capped here at 400 steps): over seeds 0-13 on a 2-core AMD EPYC, two runs at a time beside a
# CI run (`grpo-kernels seeds --seeds 6 --jobs 2 -- --warmup-steps 400 --steps 60 --eval-every 30 --eval-size 300
# --save-every 0`, then `--seeds 8 --first-seed 6`; benchmarks/results/learning/ci-short-run-14-seeds.json) it
# gained +17.3 to +45.7 points (median +29.5): the bar is under half the worst seed's gain, so a run fails it only
# if it learns far less than any measured trajectory did. Those runs had no large-batch stage after the capped
# warm-up (it came later), so this run turns it off (`--warmup-large-batch-steps 0`) to stay the measured recipe.
SHORT_RUN_MIN_GAIN = 0.08


# With --top-p 0.9 (the sampler's kept sets replayed), over seeds 0-5 the same way
# (benchmarks/results/learning/ci-short-run-top-p-0.9-6-seeds.json): +17.4 to +46.3 points, median +30.2, as the
# default's; the same bar holds.
@pytest.mark.parametrize("sampling", [[], ["--top-p", "0.9"]], ids=["default", "top-p 0.9"])
def test_a_short_default_run_learns(tmp_path, capsys, sampling):
    """A shortened `grpo-kernels train` (the default recipe, fewer steps; and sampling with top-p 0.9, trained on
    the replayed kept sets): held-out greedy accuracy rises clearly over its step-0 value on whatever trajectory
    this machine draws."""
    out = str(tmp_path / "learn")
    assert (
        cli.main(
            [
                "train",
                "--warmup-steps",
                "400",
                "--warmup-large-batch-steps",
                "0",
                "--steps",
                "60",
                "--eval-every",
                "30",
                "--eval-size",
                "300",
                "--save-every",
                "0",
                "--output-dir",
                out,
                "--no-progress",
                *sampling,
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    print(summary)
    assert summary["final_eval_accuracy"] >= summary["first_eval_accuracy"] + SHORT_RUN_MIN_GAIN, summary


def test_a_crash_while_saving_loses_no_finished_checkpoint(tiny, tmp_path, monkeypatch):
    trainer = _trainer(tiny, output_dir=str(tmp_path))
    trainer.step = 1
    first = trainer.save_checkpoint()
    trainer.step = 2

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(trainer.model, "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        trainer.save_checkpoint()
    assert latest_checkpoint(str(tmp_path)) == first  # the half-written folder is not a checkpoint
    assert os.path.exists(os.path.join(first, "trainer_state.pt"))
    model, _ = cli._load_pretrained(first)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in trainer.model.parameters())


def test_process_supervision_labels_steps_by_completion(tiny):
    """Every token-step gets the share of sampled completions from it that verify; advantages are [B, T]."""
    trainer = _trainer(tiny, process_rollouts=3, max_new_tokens=6)
    rows = trainer.train_rows[:1] * 2
    _, _, ids, mask = trainer.generate([r["prompt"] for r in rows])
    step_rewards, step_end = trainer.step_labels(rows, ids, mask)
    lengths = mask.sum(1).tolist()
    for b, n in enumerate(lengths):
        assert step_end[b, :n].tolist() == list(range(n))
        scored = step_rewards[b, :n]
        assert ((scored >= 0) & (scored <= 1)).all() and torch.isnan(step_rewards[b, n:]).all()
        # each label is a share of 3 completions, or 0 / 1 for the finished prefix
        assert all(abs(3 * v - round(3 * v)) < 1e-6 for v in scored.tolist())
    rollout = trainer.rollout()
    assert rollout.advantages.shape == rollout.completion_ids.shape
    assert (rollout.advantages[rollout.completion_mask == 0] == 0).all()
    loss, _ = trainer.accumulate_gradients(rollout)
    assert torch.isfinite(loss)


def test_process_labels_are_the_prefixs_shared_by_completions_that_share_it(tiny, monkeypatch):
    """A label is a function of the prefix (and its row): completions of one row that share a prefix get the same
    label, from one set of N continuations (each distinct unfinished prefix is completed once); another row with
    the same completion gets labels of its own."""
    trainer = _trainer(tiny, process_rollouts=3, max_new_tokens=6)
    row, other = trainer.train_rows[0], dict(trainer.train_rows[0])  # equal fields, another row
    _, _, ids, mask = trainer.generate([row["prompt"]])
    completed, generate = [], trainer.generate

    def counting(prompts, **kwargs):
        completed.extend(prompts)
        return generate(prompts, **kwargs)

    monkeypatch.setattr(trainer, "generate", counting)
    step_rewards, _ = trainer.step_labels([row, row, other], ids.repeat(3, 1), mask.repeat(3, 1))
    torch.testing.assert_close(step_rewards[0], step_rewards[1], equal_nan=True)
    n = int(mask.sum())
    unfinished = n - int(ids[0, n - 1] == trainer.tokenizer.eos_token_id)
    assert len(completed) == 2 * unfinished  # once for row's two completions, once for the other row's
    assert len(set(completed)) == unfinished


def test_process_supervision_from_the_command_line(tmp_path, capsys):
    out = str(tmp_path / "process")
    assert (
        cli.main(
            [
                "train",
                "--warmup-steps",
                "5",
                "--steps",
                "2",
                "--eval-size",
                "8",
                "--group-size",
                "2",
                "--prompts-per-step",
                "2",
                "--process-rollouts",
                "2",
                "--output-dir",
                out,
                "--no-progress",
                "--save-every",
                "0",
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in lines if "reward" in r] == [1, 2]


def test_fused_lm_head_option_gives_the_same_gradients(tiny):
    """--fused-lm-head: the update from hidden states and the lm_head weight equals the logits path's."""
    model, _ = tiny
    rollout = _trainer(tiny).rollout()
    grads = []
    for fused in (False, True):
        _trainer(tiny, fused_lm_head=fused).accumulate_gradients(rollout)
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused head"])
def test_the_prompt_mean_is_the_mean_of_each_groups_token_mean(tiny, fused):
    """--aggregation prompt_mean: the update is the mean over the step's prompts of each prompt's token mean, which
    is the mean of the updates on each group alone with bnpo (a batch token mean); and the flag reaches the run."""
    model, _ = tiny
    rollout = _trainer(tiny, prompts_per_step=3, max_new_tokens=12).rollout()
    rollout.advantages = torch.randn(rollout.advantages.shape, generator=torch.Generator().manual_seed(0))
    tokens = rollout.completion_mask.sum(-1).view(3, 2).sum(-1)
    assert len(set(tokens.tolist())) > 1, f"groups of different token counts, got {tokens.tolist()}"
    _trainer(tiny, aggregation="prompt_mean", fused_lm_head=fused).accumulate_gradients(rollout)
    together = [p.grad.clone() for p in model.parameters()]
    each = []
    for g in range(3):
        alone = rollout.groups(torch.arange(3) == g)
        _trainer(tiny, loss_type="bnpo", fused_lm_head=fused).accumulate_gradients(alone)
        each.append([p.grad.clone() for p in model.parameters()])
    for name, got, *per_group in zip(dict(model.named_parameters()), together, *each, strict=True):
        torch.testing.assert_close(got, sum(per_group) / 3, atol=1e-7, rtol=1e-5, msg=name)
    args = cli.build_parser().parse_args(["train", "--aggregation", "prompt_mean"])
    assert args.aggregation == "prompt_mean"


def test_fused_lm_head_folds_in_a_lora_adapter_on_the_head(tiny):
    """A PEFT model with LoRA on lm_head (B given a value: at its zero start any head would match): the fused
    update equals the logits path's, the head's adapter weights included (the base weight alone would drop it)."""
    peft = pytest.importorskip("peft", reason="the peft extra is not installed (pip install 'grpo-kernels[peft]')")
    base, tokenizer = tiny
    model = peft.get_peft_model(
        copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"], lora_dropout=0.0)
    )
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    rollout = _trainer((model, tokenizer)).rollout()
    grads = []
    for fused in (False, True):
        _trainer((model, tokenizer), fused_lm_head=fused).accumulate_gradients(rollout)
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert any("lm_head.lora_B" in name for name in grads[1])
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-4, msg=name)


def test_train_any_local_hugging_face_model(tmp_path, tiny):
    """--model PATH: a causal LM folder (here a Qwen2 config, saved locally) trains with no warm-up."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = compare.build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    path = str(tmp_path / "qwen2-tiny")
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    out = str(tmp_path / "run")
    assert (
        cli.main(
            [
                "train",
                "--model",
                path,
                "--steps",
                "2",
                "--eval-size",
                "8",
                "--group-size",
                "2",
                "--prompts-per-step",
                "2",
                "--output-dir",
                out,
                "--no-progress",
                "--save-every",
                "0",
            ]
        )
        == 0
    )
    assert latest_checkpoint(out).endswith("checkpoint-2")


def test_adaptive_entropy_moves_the_coefficient_and_survives_a_resume(tiny, tmp_path):
    """TRL's rule in the thin trainer: gated off until a step has measured the entropy, then the
    coefficient moves by delta toward the target each step; its state is in the checkpoint."""
    config = dict(
        entropy_coef=0.05,
        adaptive_entropy=True,
        entropy_target=100.0,
        entropy_coef_delta=0.01,
        entropy_coef_max=0.065,
        output_dir=str(tmp_path / "run"),
    )
    trainer = _trainer(tiny, **config)
    first = trainer.train_step()
    assert first["entropy_coef"] == pytest.approx(0.06) and 0.0 < first["entropy"] < 100.0
    second = trainer.train_step()
    assert second["entropy_coef"] == pytest.approx(0.065)  # capped at entropy_coef_max
    checkpoint = trainer.save_checkpoint()
    resumed = _trainer(tiny, **config)
    resumed.load_state(checkpoint)
    assert resumed.entropy_control.state_dict() == trainer.entropy_control.state_dict()
    low = _trainer(tiny, entropy_coef=0.05, adaptive_entropy=True, entropy_target=0.0, entropy_coef_delta=0.01)
    assert low.train_step()["entropy_coef"] == pytest.approx(0.04)  # entropy above the target: down


def test_adaptive_entropy_controller_rules():
    from grpo_kernels.entropy_control import AdaptiveEntropy

    control = AdaptiveEntropy(coef=0.1, target=1.0, coef_min=0.05, coef_max=0.2, delta=0.1)
    assert control.applied_coef() == 0.0  # nothing measured yet
    control.observe(torch.tensor(3.0), torch.tensor(4.0))
    control.observe(torch.tensor(1.0), torch.tensor(2.0))  # the window's mean is 4 / 6, not the last batch's
    assert control.end_window() == pytest.approx(4 / 6)
    assert control.coef == pytest.approx(0.2) and control.applied_coef() == pytest.approx(0.2)
    control.observe(torch.tensor(9.0), torch.tensor(3.0))
    control.end_window(lambda t: t * torch.tensor([1.0, 3.0]))  # another process's tokens, no entropy: mean 1
    assert control.coef == pytest.approx(0.2) and control.last_world_entropy == pytest.approx(1.0)
    with pytest.raises(RuntimeError, match="end_window\\(\\) before any observe\\(\\)"):
        control.end_window()
    with pytest.raises(ValueError, match="coef_min <= coef_max"):
        AdaptiveEntropy(coef=0.1, coef_min=0.5, coef_max=0.2)


def test_entropy_flags_from_the_command_line(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert (
        cli.main(
            [
                "train",
                "--steps",
                "2",
                "--warmup-steps",
                "2",
                "--eval-size",
                "4",
                "--group-size",
                "2",
                "--prompts-per-step",
                "2",
                "--output-dir",
                out,
                "--no-progress",
                "--save-every",
                "0",
                "--entropy-coef",
                "0.01",
                "--adaptive-entropy",
                "--entropy-target",
                "100",
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [round(r["entropy_coef"], 4) for r in lines if "reward" in r] == [0.015, 0.02]


def _scripted_reward(signal_every: int):
    """A reward function whose groups (of 2) carry signal only for every ``signal_every``-th call: the other
    calls score every completion 1.0, so all their groups are zero-std."""
    calls = []

    def scripted(prompts, completions, **_):
        calls.append(len(completions))
        if len(calls) % signal_every:
            return [1.0] * len(completions)
        return [float(i % 2) for i in range(len(completions))]

    return scripted, calls


def test_rollouts_select_and_concatenate_groups(tiny):
    trainer = _trainer(tiny, max_new_tokens=6)
    first, second = trainer.sample_groups(), trainer.sample_groups()
    second.prompt_ids, second.prompt_mask = second.prompt_ids[:, 2:], second.prompt_mask[:, 2:]  # narrower
    second.completion_ids, second.completion_mask = second.completion_ids[:, :3], second.completion_mask[:, :3]
    both = type(first).concat([first, second], trainer.tokenizer.pad_token_id)
    assert both.completion_ids.shape[0] == 8 and both.zero_std.shape == (4,) and len(both.rows) == 8
    width = both.prompt_ids.shape[1]
    assert width == first.prompt_ids.shape[1]
    # the narrower prompts are padded on the left, the shorter completions on the right, masks 0 there
    assert torch.equal(both.prompt_ids[4:, 2:], second.prompt_ids) and not both.prompt_mask[4:, :2].any()
    T = second.completion_ids.shape[1]
    assert torch.equal(both.completion_ids[4:, :T], second.completion_ids)
    assert not both.completion_mask[4:, T:].any()
    picked = both.groups(torch.tensor([False, True, False, True]))
    assert torch.equal(picked.completion_ids[:2], both.completion_ids[2:4])
    assert torch.equal(picked.advantages[2:], both.advantages[6:]) and picked.rows == both.rows[2:4] + both.rows[6:]


def test_dynamic_sampling_keeps_only_groups_with_signal(tiny):
    reward, calls = _scripted_reward(signal_every=3)
    trainer = _trainer(tiny, [reward], dynamic_sampling=True, max_sampling_rounds=5)
    batch = trainer.sample_step()
    assert len(calls) == 3  # two rounds with no signal, the third fills the batch
    assert not batch.update.zero_std.any() and batch.update.zero_std.shape == (2,)
    assert batch.update.advantages.abs().min() > 0 and batch.sampled.zero_std.tolist() == [True] * 4 + [False] * 2
    record = trainer.train_step()
    assert record["groups_sampled"] == 6 and record["groups_kept"] == 2
    assert record["zero_std_groups"] == pytest.approx(4 / 6)  # measured on everything sampled


def test_dynamic_sampling_gives_up_after_its_rounds_and_still_steps(tiny):
    reward, calls = _scripted_reward(signal_every=10**6)  # never any signal
    trainer = _trainer(tiny, [reward], dynamic_sampling=True, max_sampling_rounds=3)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    record = trainer.train_step()
    assert len(calls) == 3 and record["groups_sampled"] == 6 and record["groups_kept"] == 0
    assert record["zero_std_groups"] == 1.0 and all(torch.isfinite(torch.tensor(v)) for v in record.values())
    assert all(
        torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True)
    )  # zero advantages: no move
    with pytest.raises(ValueError, match="max_sampling_rounds must be >= 1"):
        TrainerConfig(max_sampling_rounds=0)


def test_dynamic_sampling_with_process_supervision_labels_the_kept_groups(tiny):
    reward, calls = _scripted_reward(signal_every=2)
    trainer = _trainer(tiny, [reward], dynamic_sampling=True, process_rollouts=2, max_new_tokens=4)
    batch = trainer.sample_step()
    assert batch.update.zero_std.shape == (2,) and not batch.update.zero_std.any()
    assert batch.update.advantages.shape == batch.update.completion_mask.shape  # per-token advantages


def test_steps_log_entropy_and_clip_ratios(tiny):
    record = _trainer(tiny, num_iterations=2, epsilon_high=0.28).train_step()
    assert {"entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl"} <= set(record)
    assert record["entropy"] > 0 and "groups_sampled" not in record


def test_seeds_command_reports_the_spread(tmp_path, capsys):
    out = str(tmp_path / "seeds")
    assert (
        cli.main(
            [
                "seeds",
                "--seeds",
                "2",
                "--first-seed",
                "3",
                "--jobs",
                "2",
                "--output-dir",
                out,
                "--",
                "--warmup-steps",
                "5",
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
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    result = json.load(open(os.path.join(out, "seeds.json")))
    assert [r["seed"] for r in result["runs"]] == [3, 4]
    for run in result["runs"]:
        evals = [
            json.loads(line)["eval_accuracy"]
            for line in open(os.path.join(out, f"seed-{run['seed']}", "metrics.jsonl"))
            if "eval_accuracy" in line
        ]
        assert len(evals) == 3 and run["final_eval_accuracy"] == evals[-1] and run["best_eval_accuracy"] == max(evals)
        assert run["drop_from_best"] == pytest.approx(max(evals) - evals[-1])
    finals = sorted(r["final_eval_accuracy"] for r in result["runs"])
    assert result["final_eval_accuracy"] == {"min": finals[0], "median": sum(finals) / 2, "max": finals[1]}
    assert "2 seeds:" in printed and "min / median / max:" in printed and "seed 3:" in printed
    for seed in (3, 4):  # what each run printed, beside its own train.log, its OpenMP threads waiting passively
        run_dir = os.path.join(out, f"seed-{seed}")
        assert os.path.exists(os.path.join(run_dir, seeds.CONSOLE_LOG))
        log = open(os.path.join(run_dir, "train.log")).read()
        assert f"{result['threads_per_run']} CPU threads (OMP_WAIT_POLICY=PASSIVE)" in log
    with pytest.raises(ValueError, match="--seed is set per run"):
        cli.main(["seeds", "--output-dir", out, "--", "--seed", "1"])


def test_samples_of_a_prompt_share_its_prefill(tiny):
    """generate(prompts, samples_per_prompt=n) runs each prompt's prefill once and continues n samples from
    it: greedy, it gives what generating the repeated prompts gives, left padding included."""
    trainer = _trainer(tiny, max_new_tokens=6)
    rows = trainer.train_rows
    prompts = [rows[0]["prompt"], rows[1]["prompt"][5:], rows[2]["prompt"][9:]]
    shared = trainer.generate(prompts, greedy=True, samples_per_prompt=3)
    repeated = trainer.generate([p for p in prompts for _ in range(3)], greedy=True)
    assert shared[1][:, 0].tolist() == [1] * 3 + [0] * 6  # the shorter prompts are left-padded
    for a, b in zip(shared, repeated, strict=True):
        assert torch.equal(a, b)
    ids, mask = trainer.generate(prompts, samples_per_prompt=4)[2:]
    assert ids.shape[0] == 12 and mask.shape == ids.shape


def _families():
    from test_model_families import FAMILIES

    # transformers 5.24 cannot sample from these two on the CPU (its generate fails in their cache code)
    return [name for name in FAMILIES if name not in ("recurrent_gemma", "xlstm")]


@pytest.mark.parametrize("model_type", _families())
def test_fused_lm_head_applies_the_models_head_transform(model_type):
    """Every family of tests/test_model_families.py (soft-capped, scaled, sliced, plain, MoE heads; tiny configs):
    the fused lm_head's update equals the logits path's, which reads the model's own (transformed) logits."""
    from test_model_families import TOKENIZER, tiny_model

    family = (tiny_model(model_type), TOKENIZER)
    rollout = _trainer(family).rollout()
    grads = []
    for fused in (False, True):
        _trainer(family, fused_lm_head=fused).accumulate_gradients(rollout)
        grads.append([p.grad.clone() for p in family[0].parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4)


def test_seeds_report_the_mean_with_its_interval_sample_efficiency_time_and_memory(tmp_path):
    """Three seeds of a stand-in training script: the final held-out accuracy as mean +- its 95 % interval (Student's
    t with 2 degrees of freedom, 4.303), the completions and tokens each sampled before first reaching the target
    (a seed that never does is counted apart), the time and the peak memory each wrote, and the band plot."""
    from grpo_kernels.training.seeds import format_summary, run_seeds

    script = tmp_path / "fake_train.py"
    script.write_text(
        "import argparse, json, os\n"
        "p = argparse.ArgumentParser(); p.add_argument('--seed', type=int); p.add_argument('--output-dir')\n"
        "a = p.parse_args()\n"
        "final = {0: 0.9, 1: 0.95, 2: 0.7}[a.seed]\n"
        "rows = [{'step': 0, 'eval_accuracy': 0.5}]\n"
        "for step in (1, 2, 3):\n"
        "    rows.append({'step': step, 'reward': 0.5, 'zero_std_groups': 0.0, 'completions_sampled': 10,\n"
        "                 'tokens_sampled': 40 + a.seed})\n"
        "    rows.append({'step': step, 'eval_accuracy': 0.5 if step < 3 - (a.seed == 1) else final})\n"
        "open(os.path.join(a.output_dir, 'metrics.jsonl'), 'w').write(''.join(json.dumps(r) + '\\n' for r in rows))\n"
        "json.dump({'peak_rss_mib': 100.0 + a.seed}, open(os.path.join(a.output_dir, 'summary.json'), 'w'))\n"
    )
    result = run_seeds([0, 1, 2], str(tmp_path / "sweep"), [], script=str(script), target=0.9)
    finals = [0.9, 0.95, 0.7]
    mean = sum(finals) / 3
    half = 4.303 * statistics.stdev(finals) / 3**0.5
    interval = result["final_eval_accuracy_mean"]
    assert interval["mean"] == pytest.approx(mean) and interval["half_width"] == pytest.approx(half)
    assert interval["low"] == pytest.approx(mean - half) and interval["n"] == 3
    # seed 0 reaches 0.9 at its step-3 evaluation (after 3 steps: 30 completions, 120 tokens), seed 1 at step 2
    # (20 completions, 2 x 41 tokens), seed 2 never
    assert [r["completions_to_target"] for r in result["runs"]] == [30, 20, None]
    assert [r["tokens_to_target"] for r in result["runs"]] == [120, 82, None]
    assert result["reached_target"] == 2 and result["completions_to_target"]["median"] == 25
    assert result["peak_rss_mib"] == {"min": 100.0, "median": 101.0, "max": 102.0}
    assert (tmp_path / "sweep" / "curves.png").stat().st_size > 0
    text = format_summary(result)
    assert f"{100 * mean:.1f} % +- {100 * half:.1f} (95 % CI over 3 seeds)" in text
    assert "to 90 % held-out accuracy  median 25 completions / 101 tokens sampled (2 of 3 seeds got there)" in text
    assert "peak memory per run (resident)  100 / 101 / 102 MiB" in text


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (5, 1.0)])
def test_a_truncating_sampler_is_replayed_over_its_kept_sets(tiny, top_k, top_p):
    """With top-p / top-k sampling the sampler records each token's kept ids (the sampled token among them, fewer
    than the vocabulary), and the trainer's log-probs over those sets are the sampler's at the first inner step:
    its ratio to the sampler is 1, where over the whole vocabulary (--no-kept-set-replay) it is not."""
    vocabulary = tiny[0].config.vocab_size
    deviations = {}
    for replay in (True, False):
        trainer = _trainer(tiny, top_k=top_k, top_p=top_p, replay_kept_sets=replay, num_iterations=2, beta=0.04)
        torch.manual_seed(0)
        r = trainer.sample_step().update
        active = r.completion_mask.bool()
        in_set = (r.kept_ids == r.completion_ids.unsqueeze(-1)).any(-1)
        assert in_set[active].all()
        counts = (r.kept_ids >= 0).sum(-1)[active]
        assert counts.min() >= 1 and counts.max() <= (top_k or vocabulary) and (counts < vocabulary).any()
        torch.manual_seed(0)
        deviations[replay] = trainer.train_step()["sampler_ratio_max_deviation"]
    assert deviations[True] < 1e-4, deviations
    assert deviations[False] > 1e-2, deviations


@pytest.mark.parametrize("distillation", ["topk", "reverse_kl"])
def test_distillation_moves_the_student_toward_its_teacher(tiny, distillation):
    """With a teacher (the student's copy with other weights), the updates on a batch of the student's own samples
    bring the distillation loss on it down (the top-k forward KL, or the k3 estimate at the sampled tokens), and
    with the task's reward a step also carries the GRPO loss's metrics."""
    model, tokenizer = tiny
    teacher, student = copy.deepcopy(model), copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # a teacher of other beliefs
        for p in teacher.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    rows = compare.make_rows(8, held_out=False, seed=0)
    config = TrainerConfig(group_size=4, prompts_per_step=4, learning_rate=1e-2, distillation=distillation)
    trainer = GRPOTrainer(student, tokenizer, [numeric_match], rows, config, teacher=teacher)
    torch.manual_seed(0)
    held = trainer.sample_step().update
    losses = []
    for _ in range(12):
        losses.append(float(trainer.accumulate_gradients(held)[1]["distillation/loss"]))
        trainer.optimizer.step()
    assert losses[-1] < 0.7 * losses[0], losses
    assert "distillation/loss" in trainer.train_step()
    both = GRPOTrainer(
        copy.deepcopy(model), tokenizer, [numeric_match], rows,
        dataclasses.replace(config, distillation_with_reward=True, beta=0.04), teacher=teacher,
    )  # fmt: skip
    record = both.train_step()
    assert {"distillation/loss", "kl", "clip_ratio/region_mean"} <= set(record)


def test_distillation_settings_are_refused_by_name(tiny):
    model, tokenizer = tiny
    rows = compare.make_rows(4, held_out=False, seed=0)
    with pytest.raises(ValueError, match="distillation='topk' needs a teacher model"):
        GRPOTrainer(model, tokenizer, [numeric_match], rows, TrainerConfig(distillation="topk"))
    with pytest.raises(ValueError, match="a teacher needs a distillation"):
        GRPOTrainer(model, tokenizer, [numeric_match], rows, TrainerConfig(), teacher=model)
    with pytest.raises(ValueError, match="distillation must be one of"):
        TrainerConfig(distillation="forward")
