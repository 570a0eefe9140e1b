"""`grpo-kernels train` as a new user meets it: the help, a short run's warm-up, what the output folder and the
streams hold while and after it runs, the curves (CPU, tiny shapes)."""

import json
import os
import re
import subprocess
import sys

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from grpo_kernels.training import cli, plots
from grpo_kernels.training.tasks import compare


def _train_help() -> str:
    parser = cli.build_parser()
    train = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["train"]
    return train, train.format_help()


def test_train_help_shows_every_default_and_what_runs_before_step_1():
    parser, text = _train_help()
    flat = " ".join(text.split())
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.default in (None, False, "==SUPPRESS==") or not action.option_strings:
            continue
        shown = formatter._expand_help(action)  # the option's help as printed
        assert "default" in shown and " ".join(shown.split()) in flat, (action.option_strings, shown)
    assert "step 1: see below) (default: 200)" in flat and "(G) (default: 8)" in flat  # --steps, --group-size
    assert f"(default: {compare.WARMUP_STEPS}, or {compare.WARMUP_STEPS // 200} x --steps below 200 steps)" in flat
    assert "What runs, in order" in flat and "format warm-up" in flat and "--threads 1" in flat


@pytest.mark.parametrize(
    "steps, warmup_steps, large_batch_steps, expected",
    [
        (200, None, None, (compare.WARMUP_STEPS, compare.WARMUP_STEPS // 3, False)),  # the recipe
        (500, None, None, (compare.WARMUP_STEPS, compare.WARMUP_STEPS // 3, False)),  # longer: the recipe's warm-up
        (20, None, None, (240, 0, True)),  # a short run: 12 a step, no second stage
        (199, None, None, (2388, 0, True)),
        (2, None, None, (compare.WARMUP_CHECK_EVERY, 0, True)),  # at least one check of the format
        (20, 100, None, (100, 0, False)),  # caps given are kept: not scaled
        (20, None, 50, (240, 50, True)),
        (200, 400, None, (400, 133, False)),
    ],
)
def test_a_short_runs_warmup_scales_with_its_steps(steps, warmup_steps, large_batch_steps, expected):
    assert cli.warmup_plan(steps, warmup_steps, large_batch_steps) == expected


def test_the_output_folder_holds_a_log_before_the_warmup_ends(tmp_path, monkeypatch, capsys):
    """train.log is written from the first moment: when the warm-up starts, it already says the command, the
    threads and the phase; the summary is the only line on stdout."""
    out = str(tmp_path / "run")
    seen = {}
    real_warmup = compare.warmup

    def warmup(*args, **kwargs):
        seen["log"] = open(os.path.join(out, "train.log")).read()
        seen["steps"] = kwargs["steps"], kwargs["large_batch_steps"]
        return real_warmup(*args, **kwargs)

    monkeypatch.setattr(compare, "warmup", warmup)
    assert (
        cli.main(
            [
                "train",
                "--steps",
                "1",
                "--eval-size",
                "4",
                "--group-size",
                "2",
                "--prompts-per-step",
                "2",
                "--save-every",
                "0",
                "--output-dir",
                out,
                "--no-progress",
            ]
        )
        == 0
    )
    assert "CPU threads" in seen["log"] and "phase 1/2: format warm-up, up to 200 steps" in seen["log"]
    assert seen["steps"] == (compare.WARMUP_CHECK_EVERY, 0)
    captured = capsys.readouterr()
    summary = json.loads(captured.out)  # one line, the JSON summary alone
    log = open(os.path.join(out, "train.log")).read()
    for line in ("phase 2/2: GRPO, steps 1 to 1", "step 1: reward", "evaluation at step 1", "done: {"):
        assert line in log, line
    below = [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "warmup_well_formed" in r]
    if below[0]["warmup_well_formed"] < compare.WARMUP_FORMAT_TARGET:  # 200 steps: far below, on any machine
        assert "short run (--steps 1 < the recipe's 200)" in summary["warnings"][0]
        assert "WARNING: the format warm-up ended at" in log and "WARNING" in captured.err
        assert below[0]["warmup_below_target"] is True
    else:
        assert summary["warnings"] == []


def test_a_short_run_from_the_command_line_waits_passively_and_prints_its_summary_alone(tmp_path):
    """The command as typed (no OMP_WAIT_POLICY in the environment): it runs again with passive OpenMP waits
    (what keeps a shared machine from crawling), says so in train.log, and stdout holds the JSON summary alone
    (whatever libraries print goes to stderr)."""
    out = str(tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_kernels.training.cli",
            "train",
            "--steps",
            "1",
            "--warmup-steps",
            "2",
            "--eval-size",
            "4",
            "--group-size",
            "2",
            "--prompts-per-step",
            "2",
            "--save-every",
            "0",
            "--threads",
            "1",
            "--output-dir",
            out,
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    summary = json.loads(lines[0])
    assert summary["steps"] == 1 and set(summary) >= {"first_eval_accuracy", "final_eval_accuracy", "warnings"}
    log = open(os.path.join(out, "train.log")).read()
    assert "1 CPU threads (OMP_WAIT_POLICY=PASSIVE)" in log, log
    assert "phase 1/2: format warm-up" in log and "phase 2/2" in log  # --no-progress: the phases on stderr too
    assert "phase 2/2" in done.stderr
    # a run that uses no DeepSpeed neither imports it (accelerate's check at each checkpoint did) nor prints its
    # "Setting accelerator to CPU" warning
    assert "Setting accelerator" not in done.stderr, done.stderr[-2000:]


def test_curves_are_three_labelled_panels_with_integer_steps_and_the_legends_off_the_lines():
    records = [
        {
            "step": 0,
            "warmup_steps": 240,
            "warmup_large_batch_steps": 0,
            "warmup_well_formed": 0.48,
            "warmup_seconds": 12.0,
            "warmup_below_target": True,
        },
        {"step": 0, "eval_accuracy": 0.29, "eval_malformed": 0.4},
    ]
    for step in range(1, 6):
        records.append(
            {
                "step": step,
                "reward": 0.1 * step,
                "accuracy": 0.1 * step,
                "malformed": 0.5 - 0.05 * step,
                "loss": 0.01 * step,
                "kl": 0.001 * step,
                "entropy": 1.0 - 0.1 * step,
            }
        )
    records.append({"step": 5, "eval_accuracy": 0.54, "eval_malformed": 0.2})
    fig = plots.curves_figure(records)
    canvas = FigureCanvasAgg(fig)  # what savefig draws with
    canvas.draw()
    panels = [axis for axis in fig.axes if axis.get_title()]
    assert [axis.get_title() for axis in panels] == [
        "Reward and accuracy",
        "Loss, KL and entropy (each on its own axis)",
        "Malformed answers (not one of the prompt's numbers)",
    ]
    assert all(axis.get_ylabel() for axis in fig.axes)  # every axis, the KL's and entropy's twins too
    assert panels[-1].get_xlabel() == "GRPO step"
    ticks = [t for t in panels[-1].get_xticks() if 1 <= t <= 5]
    assert ticks and all(float(t).is_integer() for t in ticks)
    renderer = canvas.get_renderer()
    for axis in panels:  # each legend lies right of its panel and of the twin axes' labels
        legend = axis.get_legend()
        assert legend is not None, axis.get_title()
        assert legend.get_window_extent(renderer).x0 > axis.get_window_extent(renderer).x1
    middle_labels = [text.get_text() for text in panels[1].get_legend().get_texts()]
    assert middle_labels == ["loss", "KL to the reference", "entropy"]
    marked = [text.get_text() for text in panels[0].texts]
    assert marked == ["29%", "54%"]  # both held-out evaluations of a short run, labelled
    assert any(
        "240 + 0 steps, 48% of sampled answers well-formed (below its target)" in t.get_text() for t in fig.texts
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--num-iterations 0", "argument --num-iterations: must be >= 1, got 0"),
        ("--top-p 0", r"argument --top-p: must be in \(0, 1\], got 0"),
        ("--top-p 1.5", r"argument --top-p: must be in \(0, 1\], got 1.5"),
        ("--top-k -3", "argument --top-k: must be >= 0, got -3"),
        ("--group-size 1", "argument --group-size: must be >= 2"),
        ("--temperature 0", "argument --temperature: must be > 0"),
        ("--loss-type gspo", "argument --loss-type: invalid choice: 'gspo'"),
        ("--fused-lm-head --teacher runs/x --distillation topk", "--fused-lm-head with --teacher"),
        ("--teacher runs/x", "--distillation none needs --teacher CHECKPOINT, and --teacher needs --distillation"),
        (
            "--loss-type dro",
            r"the loss's flags \(--loss-type, --epsilon, --beta, ...\): loss_type='dro' needs dro_beta",
        ),
    ],
)
def test_bad_flags_are_refused_by_name_before_any_work(flags, message, capsys):
    """Each bad setting stops the command at once (argparse's status 2), naming its flag: before the model loads or
    the warm-up runs (minutes), not as a traceback from deep inside them."""
    with pytest.raises(SystemExit) as stopped:
        cli.main(["train", *flags.split()])
    assert stopped.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_distillation_run_names_its_phase():
    """``grpo-kernels distill`` logs its training phase as the distillation it is, not as GRPO."""
    args = cli.build_parser().parse_args(["distill", "--teacher", "runs/x"])
    assert cli.phase_name(args) == "on-policy distillation"
    assert cli.phase_name(cli.build_parser().parse_args(["train"])) == "GRPO"
    with_reward = cli.build_parser().parse_args(["distill", "--teacher", "runs/x", "--with-task-reward"])
    assert cli.phase_name(with_reward) == "GRPO with distillation"
