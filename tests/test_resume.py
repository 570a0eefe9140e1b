"""A run killed (SIGKILL) after a checkpoint and resumed is the run that was never interrupted: the same
metrics rows (each step once), evaluations and final weights, for the default recipe, process supervision and
adaptive entropy; a kill during a checkpoint's write leaves the previous checkpoint usable; a run stopped by SIGTERM
with no periodic checkpoint leaves one at the step reached and resumes exactly; a truncated checkpoint is skipped by
name; a resume that could not be exact is refused by name."""

import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from grpo_kernels.training.checkpoint import CHECKPOINT_FORMAT, checkpoint_damage, resume_differences
from grpo_kernels.training.cli import restart_log
from grpo_kernels.training.config import TrainerConfig

# tiny: 6 steps of 4 prompts x 4 completions after a short warm-up, a checkpoint every 2 steps
RUN = [
    "--steps",
    "6",
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--eval-size",
    "10",
    "--warmup-steps",
    "30",
    "--save-every",
    "2",
    "--eval-every",
    "2",
    "--no-progress",
]
RECIPES = {
    "default": [],
    "process supervision": ["--process-rollouts", "2"],
    "adaptive entropy": ["--adaptive-entropy", "--entropy-coef", "0.01"],
    "reward-model example": ["example"],
}


EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "reward_model_grpo.py"
EXAMPLE_RUN = [
    "--rm-steps",
    "10",
    "--grpo-steps",
    "6",
    "--warmup-steps",
    "30",
    "--eval-size",
    "10",
    "--save-every",
    "2",
]


def _command(out, extra):
    if extra[:1] == ["example"]:  # the reward-model example
        return [sys.executable, str(EXAMPLE), *EXAMPLE_RUN, *extra[1:], "--output-dir", str(out)]
    return [sys.executable, "-m", "grpo_kernels", "train", *RUN, *extra, "--output-dir", str(out)]


def _rows(out):
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _weights(checkpoint):
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


def _run(out, extra, env=None):
    subprocess.run(_command(out, extra), check=True, capture_output=True, env=env, timeout=1800)


def _killed_after_a_checkpoint(out, extra):
    """Start the run, SIGKILL it once a step after its first checkpoint is logged, while it still runs."""
    proc = subprocess.Popen(_command(out, extra), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline:
            if (
                (out / "checkpoint-2").is_dir()
                and (out / "metrics.jsonl").exists()
                and any(r.get("step", 0) >= 3 and "reward" in r for r in _rows(out))
            ):
                break
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "checkpoint-6").exists(), "killed too late: the run had finished"


def assert_same_run(resumed, uninterrupted):
    rows, expected = _rows(resumed), _rows(uninterrupted)
    assert [(r["step"], sorted(r)) for r in rows] == [(r["step"], sorted(r)) for r in expected]
    for row, want in zip(rows, expected, strict=True):
        for key, value in want.items():
            if key.endswith("seconds"):  # a time, not a number of the run
                continue
            if isinstance(value, float):
                assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (row["step"], key)
            else:
                assert row[key] == value, (row["step"], key)
    final, want = _weights(resumed / "checkpoint-6"), _weights(uninterrupted / "checkpoint-6")
    for name, tensor in want.items():
        torch.testing.assert_close(final[name], tensor, atol=1e-5, rtol=0, msg=name)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    runs = {}
    for name, extra in RECIPES.items():
        out = tmp_path_factory.mktemp("uninterrupted")
        _run(out, extra)
        runs[name] = out
    return runs


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_killed_and_resumed_run_is_the_uninterrupted_run(recipe, uninterrupted, tmp_path):
    extra = RECIPES[recipe]
    _killed_after_a_checkpoint(tmp_path, extra)
    killed_rows = _rows(tmp_path)
    _run(tmp_path, [*extra, "--resume"])
    assert_same_run(tmp_path, uninterrupted[recipe])
    rows = _rows(tmp_path)
    assert len({(r["step"], "eval_accuracy" in r) for r in rows}) == len(rows), "a step logged twice"
    checkpoint = max(int(p.name.split("-")[1]) for p in tmp_path.glob("checkpoint-[0-9]") if p.name[11:].isdigit())
    dropped = tmp_path / "metrics.dropped.jsonl"
    if any(r["step"] > 2 for r in killed_rows if "reward" in r) and dropped.exists():
        assert all(json.loads(line)["step"] > 2 for line in dropped.read_text().splitlines())
    assert checkpoint == 6


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_one(uninterrupted, tmp_path):
    """What a kill during checkpoint-6's write leaves: its temporary folder, half written, and the log up to
    step 6. The resume ignores the folder, continues from checkpoint-4 and ends as the uninterrupted run."""
    run = tmp_path / "run"
    shutil.copytree(uninterrupted["default"], run)
    shutil.rmtree(run / "checkpoint-6")
    (run / "checkpoint-6.tmp").mkdir()
    (run / "checkpoint-6.tmp" / "model.safetensors").write_bytes(b"half")
    _run(run, ["--resume"])
    assert_same_run(run, uninterrupted["default"])


def test_a_resume_that_could_not_be_exact_is_refused_by_name():
    config = TrainerConfig(beta=0.04, steps=10)
    state = {"format": CHECKPOINT_FORMAT, "config": dataclasses.asdict(config)}
    assert resume_differences(state, config, True) == ([], [])
    refused, noted = resume_differences(state, dataclasses.replace(config, learning_rate=1.0, steps=20), True)
    assert refused == ["learning_rate is 1.0, the checkpoint's run had 0.001"]
    assert noted == ["steps is 20, the checkpoint's run had 10"]
    old = {"config": dataclasses.asdict(config)}  # no format: written before the reference was saved
    assert "did not save the reference model" in resume_differences(old, config, True)[0][0]
    assert resume_differences(old, config, False)[0] == []


def test_the_log_restarts_at_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [
        {"step": 0, "eval_accuracy": 0.1},
        {"step": 1, "reward": 0.5},
        {"step": 2, "reward": 0.6},
        {"step": 2, "eval_accuracy": 0.2},
        {"step": 3, "reward": 0.7},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert restart_log(str(path), 2, 6) == rows[:4]
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:4]
    assert json.loads((tmp_path / "metrics.dropped.jsonl").read_text()) == rows[4]
    # a finished run's last evaluation follows its checkpoint: the resumed run makes it again
    assert restart_log(str(path), 2, 2) == rows[:3]


def test_a_restarted_seeds_sweep_reuses_finished_seeds(tmp_path):
    """A sweep killed after seed 0 finished and while seed 1 ran, started again: seed 0 is not run again (its
    run.json is read), seed 1 runs, each is counted once; another command runs both again."""
    from grpo_kernels.training.seeds import run_seeds

    script = tmp_path / "fake_train.py"
    calls = tmp_path / "calls.txt"
    script.write_text(
        "import argparse, json, os\n"
        "p = argparse.ArgumentParser(); p.add_argument('--seed', type=int); p.add_argument('--output-dir')\n"
        "p.add_argument('--lr', default='1')\n"
        "a = p.parse_args()\n"
        f"open({str(calls)!r}, 'a').write(f'{{a.seed}}\\n')\n"
        "rows = [{'step': 0, 'eval_accuracy': 0.5}, {'step': 1, 'reward': 1.0, 'zero_std_groups': 0.0},\n"
        "        {'step': 1, 'eval_accuracy': 0.5 + a.seed / 10}]\n"
        "open(os.path.join(a.output_dir, 'metrics.jsonl'), 'w').write(''.join(json.dumps(r) + '\\n' for r in rows))\n"
    )
    out = tmp_path / "sweep"
    run_seeds([0, 1], str(out), [], script=str(script))
    os.remove(out / "seed-1" / "run.json")  # killed while seed 1 ran: it never wrote its record
    result = run_seeds([0, 1], str(out), [], script=str(script))
    assert calls.read_text().split() == ["0", "1", "1"]
    assert [r["seed"] for r in result["runs"]] == [0, 1] and result["runs"][0].get("reused")
    assert result["final_eval_accuracy"]["max"] == pytest.approx(0.6)
    run_seeds([0, 1], str(out), ["--lr", "2"], script=str(script))  # another command: nothing reused
    assert calls.read_text().split() == ["0", "1", "1", "0", "1"]


def test_sigterm_writes_a_checkpoint_at_the_step_reached_and_the_resume_is_the_uninterrupted_run(
    uninterrupted, tmp_path
):
    """With no periodic checkpoint (--save-every 0: a setting that changes no number), SIGTERM during step 3 or
    later: the step finishes, its checkpoint is written (intact by its manifest), train.log says why, the exit code
    is 128 + 15; --resume then ends as the run that was never stopped (its rows, evaluations and final weights)."""
    proc = subprocess.Popen(
        _command(tmp_path, ["--save-every", "0"]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline:
            if (tmp_path / "metrics.jsonl").exists() and any(
                r.get("step", 0) >= 3 and "reward" in r for r in _rows(tmp_path)
            ):
                break
            assert proc.poll() is None, "the run ended before the signal"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    step = max(r["step"] for r in _rows(tmp_path) if "reward" in r)
    assert 3 <= step < 6, "stopped too late: the run had finished"
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == [f"checkpoint-{step}"]
    assert checkpoint_damage(str(tmp_path / f"checkpoint-{step}")) is None
    assert f"stopped by SIGTERM at step {step}" in (tmp_path / "train.log").read_text()
    _run(tmp_path, ["--save-every", "0", "--resume"])
    assert_same_run(tmp_path, uninterrupted["default"])


def test_resume_skips_a_truncated_checkpoint_and_ends_as_the_uninterrupted_run(uninterrupted, tmp_path):
    """The last checkpoint's weights cut short (a full disk, an interrupted copy): --resume names the file, goes on
    from the previous intact checkpoint and ends as the run that was never damaged; with every checkpoint damaged
    it stops saying what to do."""
    run = tmp_path / "run"
    shutil.copytree(uninterrupted["default"], run)
    weights = run / "checkpoint-6" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    done = subprocess.run(_command(run, ["--resume"]), capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipping a damaged checkpoint" in done.stderr
    assert "checkpoint-6/model.safetensors has 1000 bytes" in done.stderr
    assert "resuming from" in (run / "train.log").read_text()
    assert_same_run(run, uninterrupted["default"])
    for folder in run.glob("checkpoint-*"):
        (folder / "trainer_state.pt").write_bytes(b"")
    done = subprocess.run(_command(run, ["--resume"]), capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "every checkpoint in" in done.stderr and "is damaged" in done.stderr
