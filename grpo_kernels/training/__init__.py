"""The thin trainer, its command line, the built-in task and the rewards: an application of the loss.

Nothing in the loss imports this package (the loss's modules sit one level up); it imports the
loss like any user would. ``grpo-kernels train`` and ``python -m grpo_kernels train`` run it. Its progress bars
(tqdm) and figures (matplotlib) come with the ``train`` extra, which a user of the loss alone does not install.
"""

from __future__ import annotations

import importlib.util

TRAIN_EXTRA = 'pip install "grpo-kernels[train]"'
TRAIN_EXTRA_PACKAGES = ("tqdm", "matplotlib")


def require_train_extra(what: str) -> None:
    """Raise an ImportError naming the ``train`` extra where one of its packages is missing; ``what`` needs it."""
    missing = [name for name in TRAIN_EXTRA_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"{what} needs {' and '.join(missing)}, which the train extra installs: {TRAIN_EXTRA}")


def progress_bar(*args, **kwargs):
    """``tqdm.auto.tqdm(*args, **kwargs)``, or the ``train`` extra named where tqdm is missing."""
    require_train_extra("a progress bar of the thin trainer")
    from tqdm.auto import tqdm

    return tqdm(*args, **kwargs)
