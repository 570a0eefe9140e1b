"""Built-in tasks: each makes its prompts, tokenizer, model, warm-up and rewards with no download."""

from . import compare

TASKS = {compare.NAME: compare}


def get_task(name: str):
    if name not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name]
