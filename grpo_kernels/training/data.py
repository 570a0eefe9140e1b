"""Your own data and rewards for ``grpo-kernels train``: ``--data`` / ``--eval-data`` JSONL and ``--reward
module:function``.

A data row is a JSON object with a ``"prompt"`` and any other columns. The prompt is a string (the text the model
continues) or chat messages (``[{"role": "user", "content": ...}, ...]``, rendered by the tokenizer's chat
template with the generation prompt added, as TRL does for a conversational dataset). A reward function has TRL's
signature, ``f(prompts, completions, **columns) -> list[float | None]``, so a TRL reward function runs unchanged:
it gets every prompt and completion as TRL would give them (strings; for chat prompts, the messages and
``[{"role": "assistant", "content": completion}]``) and each row's other columns by name (``answer=[...]``).
``completion_ids`` and ``trainer_state``, which TRL passes too, are not passed here.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence

AS_GIVEN = "prompt_as_given"  # the trainer's rows keep the data's own prompt under this column (chat messages)


def read_rows(path: str, what: str = "--data") -> list[dict]:
    """The rows of a JSONL file, each an object with a "prompt"; a row that is not is refused naming its line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path!r} is not a file")
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise ValueError(f"{what} {path}, line {number}: not a JSON object ({err})") from None
            if not isinstance(row, dict) or "prompt" not in row:
                got = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(
                    f'{what} {path}, line {number}: each row needs a "prompt" (a string, or chat messages '
                    f'[{{"role": ..., "content": ...}}]), got {got}'
                )
            rows.append(row)
    if not rows:
        raise ValueError(f"{what} {path} holds no rows")
    return rows


def trainer_rows(rows: list[dict], tokenizer, max_positions: int | None, max_new_tokens: int, what: str) -> list[dict]:
    """The rows the trainer samples from: "prompt" the text the model continues (chat messages rendered by the
    tokenizer's chat template), the data's own prompt under ``AS_GIVEN``, the other columns as they are. A prompt
    that, with ``max_new_tokens``, would not fit the model's context is refused naming its row."""
    out = []
    for number, row in enumerate(rows, 1):
        prompt = row["prompt"]
        if isinstance(prompt, list):
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(
                    f"{what} row {number}: a chat prompt (a list of messages), but the tokenizer has no chat "
                    "template to render it: give the prompt as a string, or a tokenizer with a chat template"
                )
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        elif isinstance(prompt, str):
            text = prompt
        else:
            raise ValueError(
                f'{what} row {number}: "prompt" must be a string or chat messages, got {type(prompt).__name__}'
            )
        length = len(tokenizer(text, add_special_tokens=False).input_ids)
        if max_positions is not None and length + max_new_tokens > max_positions:
            raise ValueError(
                f"{what} row {number}: its prompt is {length} tokens, which with --max-new-tokens {max_new_tokens} "
                f"exceeds the model's context of {max_positions} positions"
            )
        out.append({**row, "prompt": text, AS_GIVEN: prompt})
    return out


def load_reward_function(spec: str) -> Callable:
    """``module:function`` (a module on the path or in the working directory, or a ``.py`` file's path) to the
    function, wrapped to be called with TRL's arguments (``trl_signature``); refused by name where it is not one."""
    if ":" not in spec:
        raise ValueError(f"--reward {spec!r}: give module:function (my_rewards:accuracy, or path/to/file.py:accuracy)")
    where, name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location(os.path.basename(where)[:-3], where)
            if module_spec is None or not os.path.isfile(where):
                raise ImportError(f"no file {where}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:  # a module beside the command, as `python -m` would find it
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
    except Exception as err:  # noqa: BLE001 - whatever the import raised, named with the option
        raise ValueError(f"--reward {spec!r}: cannot import {where} ({type(err).__name__}: {err})") from None
    func = getattr(module, name, None)
    if not callable(func):
        raise ValueError(f"--reward {spec!r}: {where} has no function {name!r}")
    return trl_signature(func)


def trl_signature(func: Callable) -> Callable:
    """``func`` called as TRL calls a reward function: keyword arguments, the data's own prompts (chat messages
    where the data gave messages) and, for chat prompts, completions as assistant messages; the internal column
    dropped."""

    @functools.wraps(func)
    def reward(prompts: Sequence, completions: Sequence[str], **columns):
        given = columns.pop(AS_GIVEN, None)
        if given is not None and any(isinstance(p, list) for p in given):
            prompts = given
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        return func(prompts=list(prompts), completions=list(completions), **columns)

    return reward
