"""Measured kernel configurations: the device sweep's winners, read by the launchers.

``tuned.json`` beside this file is data, written by ``python benchmarks/sweep.py --apply
RESULTS.json`` from a GPU run of ``benchmarks/gpu_suite.sh``: a result becomes the default
by a commit of data, not of code. Each entry was measured on one GPU architecture, dtype
and shape; a launch uses the entry of its architecture and dtype whose vocabulary size is
nearest (in ratio) to its own, and the built-in heuristics where there is none (CPU, the
interpreter, an architecture never measured).

Entries (lists under "logits", "logprobs" and "fused_linear"):

- logits: ``{"arch": "sm_90", "dtype": "bfloat16", "V": 151936, "one_pass": true,
  "BLOCK_V": 4096, "num_warps": 8, "num_stages": 1, "loop_stages": 1, "l2_hints": true,
  "programs_per_sm": null, "measured": "..."}``, the loss's launches (the one-pass kernel, or the two-pass
  forward and backward)
  (``programs_per_sm``: null is one program per token, a number the persistent schedule, "l2" the persistent
  schedule with as many programs as keep the rows in flight within L2 (``logits_launch.l2_programs_per_sm``);
  ``loop_stages``: the vocabulary loops software-pipelined over that many stages (1 or absent: not pipelined);
  ``l2_hints``: the row loops' L2 eviction hints (absent: an entry measured before they existed, run without);
  ``split_row``: null, or the one-pass loss on the split-row kernel with each row over at most that many
  programs, in chunks of whole BLOCK_V blocks: at least the row's blocks is a block a chunk held in registers,
  and 1 with a block as wide as the row is the row held whole by one program)
- logprobs: the same keys but ``one_pass``, ``programs_per_sm`` and ``split_row``: a log-prob pass (old and
  reference log-probs, ``token_logprobs``, the adapters' log-prob functions), which reads each row once and
  writes no gradient, measured on its own; without an entry such a launch takes the heuristic, not the
  loss's entry (the H200's two-pass rows of 2026-12-04, whose passes each read a row once, ran fastest at
  the heuristic's 8 warps and slowest at the one-pass entry's 16)
- fused_linear: ``{"arch": ..., "dtype": ..., "V": ..., "H": ..., "BLOCK_N": 64,
  "BLOCK_V": 128, "BLOCK_H": 64, "num_warps": 8, "num_stages": 3, "measured": "..."}``
"""

from __future__ import annotations

import functools
import json
import math
import pathlib

import torch

TABLE_PATH = pathlib.Path(__file__).with_name("tuned.json")
LOGITS_KEYS = ("BLOCK_V", "num_warps", "num_stages", "loop_stages", "l2_hints", "programs_per_sm", "split_row")
LOGPROBS_KEYS = ("BLOCK_V", "num_warps", "num_stages", "loop_stages", "l2_hints")
FUSED_LINEAR_KEYS = ("BLOCK_N", "BLOCK_V", "BLOCK_H", "num_warps", "num_stages")


@functools.cache
def table() -> dict[str, list]:
    with open(TABLE_PATH) as f:
        return json.load(f)


@functools.cache
def arch_of(device_index: int) -> str:
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


_FOUND: dict[tuple, tuple] = {}  # (table id, kind, device index, dtype, V) -> (that table, its entry or None)


def _nearest(kind: str, device: torch.device, dtype: torch.dtype, V: int) -> dict | None:
    """The entry of this kind, device architecture and dtype whose V is nearest in ratio, or None. Asked on every
    launch, so each answer is kept, by the table it came from (a table read again after ``table.cache_clear()``
    is another object: its answers are found anew; the old table is kept with its answers, so its id is never
    a new table's)."""
    if device.type != "cuda":
        return None
    current = table()
    key = (id(current), kind, device.index or 0, dtype, V)
    found = _FOUND.get(key)
    if found is None:
        arch, name = arch_of(device.index or 0), str(dtype).replace("torch.", "")
        entries = [e for e in current.get(kind, []) if e["arch"] == arch and e["dtype"] == name]
        entry = min(entries, key=lambda e: abs(math.log(max(V, 1) / e["V"]))) if entries else None
        found = _FOUND[key] = (current, entry)
    return found[1]


def logits_entry(device: torch.device, dtype: torch.dtype, V: int, kind: str = "logits") -> dict | None:
    """The measured logits-kernel entry of this kind ("logits": the loss's launches; "logprobs": a log-prob pass)
    for this launch, or None."""
    return _nearest(kind, device, dtype, V)


def fused_linear_entry(device: torch.device, dtype: torch.dtype, V: int) -> dict | None:
    """The measured lm_head tile entry for this launch, or None."""
    return _nearest("fused_linear", device, dtype, V)
