"""The thin trainer under faults: a checkpoint that would run code on load, a damaged checkpoint (refused by name,
the previous intact one taken), a non-finite reward (refused naming its function, or its group dropped) and a
non-finite loss (the optimizer step skipped, the weights finite, the run stopped after a few). The whole-run cases
(a scheduler's SIGTERM, a truncated checkpoint on --resume) are in tests/test_resume.py, beside the runs they are
compared with."""

import copy
import os
import signal
import warnings

import pytest
import torch

from grpo_kernels.training import trainer as trainer_module
from grpo_kernels.training.checkpoint import (
    CHECKPOINT_FORMAT,
    checkpoint_damage,
    latest_intact_checkpoint,
    read_trainer_state,
    write_manifest,
)
from grpo_kernels.training.rewards import numeric_match
from grpo_kernels.training.tasks import compare
from grpo_kernels.training.trainer import GRPOTrainer, TrainerConfig


@pytest.fixture(scope="module")
def tiny():
    tokenizer = compare.build_tokenizer()
    return compare.build_model(tokenizer, hidden_size=32), tokenizer


def _trainer(tiny, reward_funcs, **config):
    model, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    rows = compare.make_rows(8, held_out=False, seed=0)
    return GRPOTrainer(model, tokenizer, reward_funcs, rows, TrainerConfig(group_size=2, prompts_per_step=2, **config))


# ---- checkpoints that would run code, damaged checkpoints --------------------------------------------------------


class _RunsCode:
    """Unpickling this calls ``pathlib.Path.touch`` on a marker: what a planted checkpoint could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def test_a_state_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    torch.save({"step": 2, "payload": _RunsCode(str(marker))}, checkpoint / "trainer_state.pt")
    write_manifest(str(checkpoint))  # an altered checkpoint whose manifest was rewritten too
    with pytest.raises(ValueError, match=r"checkpoint-2/trainer_state.pt holds objects that only running code"):
        read_trainer_state(str(checkpoint))
    assert checkpoint_damage(str(checkpoint)) is None  # intact by its manifest: the load itself refuses it
    assert not marker.exists()
    os.remove(checkpoint / "manifest.json")  # no manifest: the format is read as safely, and the file refused
    assert "trainer_state.pt is unreadable" in checkpoint_damage(str(checkpoint))
    assert not marker.exists()


def test_a_damaged_checkpoint_is_named_and_the_previous_intact_one_taken(tmp_path):
    for step in (2, 4):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"weights" * 100)
        torch.save({"format": CHECKPOINT_FORMAT, "step": step}, folder / "trainer_state.pt")
        write_manifest(str(folder))
    assert checkpoint_damage(str(tmp_path / "checkpoint-4")) is None
    weights = tmp_path / "checkpoint-4" / "model.safetensors"
    weights.write_bytes(b"weights" * 50)  # cut short
    warned = []
    assert latest_intact_checkpoint(str(tmp_path), warned.append) == str(tmp_path / "checkpoint-2")
    assert warned == [
        f"skipping a damaged checkpoint: {tmp_path}/checkpoint-4/model.safetensors has 350 bytes, its "
        "manifest says 700 (cut short?)"
    ]
    weights.write_bytes(b"WEIGHTS" * 100)  # the same size, other bytes
    assert "differs from the file its manifest describes" in checkpoint_damage(str(tmp_path / "checkpoint-4"))
    weights.unlink()
    assert checkpoint_damage(str(tmp_path / "checkpoint-4")) == f"{tmp_path}/checkpoint-4 lacks model.safetensors"
    (tmp_path / "checkpoint-2" / "trainer_state.pt").unlink()
    assert latest_intact_checkpoint(str(tmp_path), warned.append) is None


def test_a_checkpoint_with_pickled_weights_is_not_loaded(tmp_path):
    """A checkpoint folder holding pytorch_model.bin (a pickle) instead of safetensors: the weights are never read
    from it (safetensors only)."""
    from grpo_kernels.training.cli import _load_pretrained

    tokenizer = compare.build_tokenizer()
    model = compare.build_model(tokenizer, hidden_size=32)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(OSError, match="safetensors|model.safetensors"):
        _load_pretrained(str(tmp_path))


# ---- non-finite rewards and losses --------------------------------------------------------------------------------


def _infinite_once(prompts, completions, **_):
    return [float("inf")] + [1.0] * (len(completions) - 1)


def test_an_infinite_reward_is_refused_naming_its_function(tiny):
    trainer = _trainer(tiny, [numeric_match, _infinite_once])
    with pytest.raises(ValueError, match=r"reward function _infinite_once returned inf for completion 0 \("):
        trainer.train_step()


def test_an_infinite_rewards_group_is_dropped_when_asked(tiny):
    trainer = _trainer(tiny, [numeric_match, _infinite_once], nonfinite_rewards="drop_group", learning_rate=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rollout = trainer.sample_groups()
    assert any("reward function _infinite_once returned a non-finite reward" in str(w.message) for w in caught)
    assert rollout.zero_std[0] and torch.all(rollout.advantages[:2] == 0) and torch.isnan(rollout.rewards[:2]).all()
    assert torch.isfinite(rollout.advantages).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train_step()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_non_finite_loss_skips_the_step_and_stops_the_run_after_a_few(tiny, monkeypatch):
    trainer = _trainer(tiny, [numeric_match], max_nonfinite_steps=2, learning_rate=1e-2)
    real = trainer.accumulate_gradients

    def nan_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        next(trainer.model.parameters()).grad.fill_(float("nan"))
        return loss * float("nan"), metrics

    monkeypatch.setattr(trainer, "accumulate_gradients", nan_loss)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    record = trainer.train_step()
    assert record["skipped_updates"] == 1 and trainer.step == 1
    for a, b in zip(before, trainer.model.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(FloatingPointError, match=r"non-finite loss or gradient norm 2 steps in a row"):
        trainer.train_step()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    monkeypatch.setattr(trainer, "accumulate_gradients", real)
    trainer._nonfinite_in_a_row = 0
    assert "skipped_updates" not in trainer.train_step()  # finite again: the run goes on


def test_the_preempted_exit_code_and_message():
    stop = trainer_module.Preempted(signal.SIGTERM, 7, "runs/x/checkpoint-7")
    assert stop.exit_code == 143
    assert str(stop).startswith("stopped by SIGTERM at step 7: checkpoint runs/x/checkpoint-7 written")
    assert trainer_module.Preempted(signal.SIGINT, 1, "c").exit_code == 130


def _stop_rank(rank, world):
    """What each rank's loop reads at a step boundary when only rank 0 received SIGTERM."""
    from grpo_kernels import collectives

    return collectives.largest(int(signal.SIGTERM) if rank == 0 else 0)


def test_every_rank_stops_at_the_same_step():
    """Under torchrun a signal may reach one rank first: at the step boundary every rank reads the largest signal
    any rank received (``collectives.largest``), so all stop and checkpoint at the same step."""
    from gloo_ranks import run_ranks

    assert run_ranks(_stop_rank, 2) == [int(signal.SIGTERM)] * 2


# ---- a checkpoint that cannot be written (a full disk) ----------------------------------------------------------

# What torch's serializer says when the disk fills under it: the errno is lost
TORCH_FULL_DISK = "[enforce fail at inline_container.cc:672] . unexpected pos 4416 vs 4304"


def _full_disk_after(monkeypatch, saves_that_work: int):
    """``torch.save`` fails as on a full disk after ``saves_that_work`` calls (a partial file written first), and the
    file system reports nothing free while the partial checkpoint is there, 12 MiB once it is removed."""
    from grpo_kernels.training import checkpoint

    real, calls = torch.save, []

    def save(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) > saves_that_work:
            with open(path, "wb") as f:
                f.write(b"partial")
            raise RuntimeError(TORCH_FULL_DISK)
        return real(obj, path, *args, **kwargs)

    def free_bytes(path):
        partial = any(name.endswith(".tmp") for name in os.listdir(os.path.dirname(os.path.abspath(path)) or "."))
        return 4096 if partial or path.endswith(".tmp") else 12 << 20

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(checkpoint, "_free_bytes", free_bytes)


def test_a_checkpoint_that_cannot_be_written_names_the_cause_and_leaves_nothing_partial(tmp_path, monkeypatch):
    """The CLI's run on a disk that fills at its second checkpoint: the run stops (exit 1), ``train.log`` ends with
    the checkpoint, the cause (no space left, the bytes it needed and the bytes free) and what to do; no
    ``checkpoint-N.tmp`` stays behind; the first checkpoint is intact and ``--resume`` takes it."""
    from grpo_kernels.training import cli

    out = str(tmp_path / "run")
    common = ["--warmup-steps", "5", "--eval-size", "8", "--group-size", "2", "--prompts-per-step", "2"]
    common += ["--output-dir", out, "--no-progress", "--save-every", "2", "--eval-every", "0"]
    _full_disk_after(monkeypatch, saves_that_work=1)
    assert cli.main(["train", "--steps", "4", *common]) == 1
    last = open(os.path.join(out, "train.log")).read().strip().splitlines()[-1]
    assert f"ERROR: checkpoint {out}/checkpoint-4 could not be written: no space left on the device of {out}" in last
    assert "it needs about" in last and "bytes), 12.0 MiB (12582912 bytes) free with the partial write removed" in last
    assert TORCH_FULL_DISK in last and "--resume takes the newest" in last
    assert sorted(os.listdir(out)).count("checkpoint-4.tmp") == 0 and not os.path.exists(f"{out}/checkpoint-4")
    assert checkpoint_damage(f"{out}/checkpoint-2") is None
    monkeypatch.undo()
    assert cli.main(["train", "--steps", "4", "--resume", *common]) == 0
    assert read_trainer_state(f"{out}/checkpoint-4")["step"] == 4


def test_a_write_error_other_than_a_full_disk_is_named_as_it_is(tmp_path):
    from grpo_kernels.training.checkpoint import CheckpointWriteError, save_atomically

    def write(tmp):
        os.makedirs(tmp)
        raise PermissionError(13, "Permission denied", os.path.join(tmp, "model.safetensors"))

    final = str(tmp_path / "checkpoint-3")
    with pytest.raises(CheckpointWriteError) as raised:
        save_atomically(final, write)
    assert str(raised.value).startswith(f"checkpoint {final} could not be written: [Errno 13] Permission denied")
    assert os.listdir(tmp_path) == []
