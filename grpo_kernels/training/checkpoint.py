"""Checkpoint I/O: each checkpoint written atomically (a temporary folder, every file synced, one rename) with a
manifest of its files (sizes, SHA-256), read back without running code (``weights_only``), checked against its
manifest before a resume, and a write that fails said plainly (``CheckpointWriteError``: the checkpoint, the cause,
the bytes it needed) with no partial folder left behind. What the trainer puts in a checkpoint is its own
(``trainer.GRPOTrainer.save_checkpoint``)."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Callable

import torch

from .config import TrainerConfig

# What a checkpoint holds (``save_checkpoint``): 2 added the reference model, the CUDA generators and this number;
# 3 the manifest of its files (sizes, SHA-256)
CHECKPOINT_FORMAT = 3
REFERENCE_FORMAT, MANIFEST_FORMAT = 2, 3  # the formats that first wrote the reference model, the manifest
REFERENCE_DIR = "reference"  # beside the checkpoints: the run's reference model, written once
# Config fields that change no number of the resumed steps: another value continues the run as it was
NUMBER_NEUTRAL_FIELDS = ("steps", "eval_every", "save_every", "output_dir")


def save_pretrained(model_or_tokenizer, folder: str) -> None:
    """``save_pretrained`` into ``folder``, without importing DeepSpeed where this process does not use it:
    transformers unwraps the model through accelerate, which imports DeepSpeed whenever it is installed, only to
    check for its engine, and DeepSpeed's import prints its "Setting accelerator to CPU" warning (and costs a
    second). A run that imported DeepSpeed (ZeRO through the TRL adapter) is left as it is."""
    import sys

    try:
        from accelerate.utils import other
    except ImportError:  # no accelerate: transformers unwraps by hand
        model_or_tokenizer.save_pretrained(folder)
        return
    if "deepspeed" in sys.modules or not hasattr(other, "is_deepspeed_available"):
        model_or_tokenizer.save_pretrained(folder)
        return
    probe = other.is_deepspeed_available
    other.is_deepspeed_available = lambda: False  # (no DeepSpeed engine can wrap a model it never imported)
    try:
        model_or_tokenizer.save_pretrained(folder)
    finally:
        other.is_deepspeed_available = probe


def resume_differences(state: dict, config: TrainerConfig, uses_reference: bool) -> tuple:
    """(why a resume from ``state`` cannot continue the same run, what differs harmlessly): a checkpoint of an
    older format (no reference model, where the run needs one), config fields that change the numbers."""
    refused, noted = [], []
    if state.get("format", 1) < REFERENCE_FORMAT:
        if uses_reference:
            refused.append(
                "the checkpoint was written by an older grpo-kernels, which did not save the reference "
                "model: the KL would be taken to the checkpoint's policy"
            )
        else:
            noted.append("the checkpoint was written by an older grpo-kernels (no format number)")
    saved, now = state.get("config", {}), dataclasses.asdict(config)
    for name in sorted(saved.keys() & now.keys()):
        if saved[name] != now[name]:
            where = noted if name in NUMBER_NEUTRAL_FIELDS else refused
            where.append(f"{name} is {now[name]!r}, the checkpoint's run had {saved[name]!r}")
    return refused, noted


class CheckpointWriteError(OSError):
    """A checkpoint (or the run's reference model) could not be written: the folder, the cause (no space left on
    its file system, with the bytes it needed and the bytes free; else the error itself), and that nothing partial
    was left behind. The earlier checkpoints are as they were: ``--resume`` takes the newest."""


def save_atomically(final: str, write: Callable[[str], object], needed_bytes: int | None = None) -> None:
    """``write(tmp)`` into ``final + ".tmp"``, every file and the folder synced to disk, then one rename (and the
    parent synced): a kill or a power loss during the write leaves the previous ``final`` (or none) and a temporary
    folder that every reader ignores, never a renamed folder whose files are not on disk yet. A write that fails
    (a full disk: torch's serializer says only ``unexpected pos``) removes its temporary folder and raises
    ``CheckpointWriteError`` naming ``final`` and the cause; ``needed_bytes``, the checkpoint's size as its writer
    estimates it, goes into a full disk's message."""
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        _fsync_tree(tmp)
    except (OSError, RuntimeError) as err:
        free_at_failure = _free_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(_why_not_written(final, err, free_at_failure, needed_bytes)) from err
    if os.path.isdir(final):  # a rename cannot replace a non-empty folder: move the old one aside first
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync(os.path.dirname(os.path.abspath(final)))


def tensor_bytes(state) -> int:
    """The bytes of the tensors in ``state`` (a state dict, or nested dicts, lists and tuples holding tensors): what a
    checkpoint of it writes, to within its small metadata."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state)
    return 0


# Less than this free when a write failed: the file system was full (torch's serializer loses the errno)
FULL_DISK_BYTES = 1 << 20


def _free_bytes(path: str) -> int | None:
    """The free bytes of the file system that holds ``path`` (or its nearest existing parent); None if unknown."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _why_not_written(final: str, err: BaseException, free_at_failure: int | None, needed_bytes: int | None) -> str:
    full = getattr(err, "errno", None) == errno.ENOSPC or (
        free_at_failure is not None and free_at_failure < FULL_DISK_BYTES
    )
    cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if full:
        free_now = _free_bytes(final)
        sizes = []
        if needed_bytes is not None:
            sizes.append(f"it needs about {_size(needed_bytes)}")
        if free_now is not None:
            sizes.append(f"{_size(free_now)} free with the partial write removed")
        detail = f" ({', '.join(sizes)})" if sizes else ""
        where = os.path.dirname(os.path.abspath(final))
        cause = f"no space left on the device of {where}{detail}; the writer said: {cause}"
    return (
        f"checkpoint {final} could not be written: {cause}. Nothing partial is left behind and the earlier "
        "checkpoints are intact (--resume takes the newest): free space or choose another --output-dir, then resume"
    )


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB ({n} bytes)"


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: str) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root)


MANIFEST = "manifest.json"  # a checkpoint's files with their sizes and SHA-256, written last


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: str) -> None:
    """``manifest.json`` in ``folder``: every other file's size and SHA-256 (``checkpoint_damage`` checks them)."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder)
            if relative != MANIFEST:
                files[relative] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"format": 1, "files": files}, f, indent=1, sort_keys=True)


def checkpoint_damage(checkpoint: str) -> str | None:
    """What is wrong with ``checkpoint`` (a file missing, cut short or changed since its manifest was written, or no
    manifest), naming the file; None for an intact one."""
    path = os.path.join(checkpoint, MANIFEST)
    if not os.path.exists(path):
        try:  # a checkpoint written before manifests (format 2) cannot be verified: it is taken as it is
            if read_trainer_state(checkpoint).get("format", 1) < MANIFEST_FORMAT:
                return None
        except (OSError, RuntimeError, ValueError, EOFError) as err:
            return f"{checkpoint}/trainer_state.pt is unreadable ({str(err).splitlines()[0]})"
        return f"{checkpoint} has no {MANIFEST}, which its format writes"
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as err:
        return f"{checkpoint}/{MANIFEST} is unreadable ({err})"
    for relative, expected in sorted(files.items()):
        file = os.path.join(checkpoint, relative)
        if not os.path.exists(file):
            return f"{checkpoint} lacks {relative}"
        size = os.path.getsize(file)
        if size != expected["bytes"]:
            return f"{checkpoint}/{relative} has {size} bytes, its manifest says {expected['bytes']} (cut short?)"
        if _sha256(file) != expected["sha256"]:
            return f"{checkpoint}/{relative} differs from the file its manifest describes (SHA-256)"
    return None


def read_trainer_state(checkpoint: str) -> dict:
    """A checkpoint's ``trainer_state.pt``, loaded with ``weights_only=True``: tensors, numbers, strings and
    containers of them, never an object whose unpickling runs code. A state that would need more is refused,
    naming the file."""
    path = os.path.join(checkpoint, "trainer_state.pt")
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path} holds objects that only running code could rebuild (not a grpo-kernels checkpoint, or an "
            f"altered one); refused: loading it could run anything. ({str(err).splitlines()[0]})"
        ) from None


def _checkpoints(output_dir: str) -> list[str]:
    """The checkpoint-N folders in output_dir, newest (largest N) first; temporary folders ignored."""
    if not os.path.isdir(output_dir):
        return []
    steps = [
        int(name.split("-")[1])
        for name in os.listdir(output_dir)
        if name.startswith("checkpoint-") and name.split("-")[1].isdigit()
    ]
    return [os.path.join(output_dir, f"checkpoint-{step}") for step in sorted(steps, reverse=True)]


def latest_checkpoint(output_dir: str) -> str | None:
    """The checkpoint-N folder with the largest N in output_dir (temporary folders ignored)."""
    found = _checkpoints(output_dir)
    return found[0] if found else None


def latest_intact_checkpoint(output_dir: str, warn: Callable[[str], None] = print) -> str | None:
    """The newest checkpoint whose files match its manifest (``checkpoint_damage``); each damaged newer one is
    named through ``warn`` and skipped. None if there is none intact."""
    for checkpoint in _checkpoints(output_dir):
        damage = checkpoint_damage(checkpoint)
        if damage is None:
            return checkpoint
        warn(f"skipping a damaged checkpoint: {damage}")
    return None
