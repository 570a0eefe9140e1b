"""SkyRL 0.3.0's own loss code, loaded from its wheel: the oracle of ``aggregation="prompt_mean"``.

SkyRL's ``ppo_utils`` imports Ray, jaxtyping, loguru and its trainer's config at the top, none of which its loss math
runs, so the tests take the functions they run from the wheel's files as written: each one's source, parsed with
``ast``, executed in a namespace of its own (its signature's annotations left off; the decorators that register a policy
loss in SkyRL's Ray-backed registry left off). They are

- ``apply_loss_reduction_to_advantages_minibatch`` and ``compute_prompt_boundaries``: the prompt mean as SkyRL's
  trainer applies it, to the advantages of a mini-batch, given its prompts' slices (from the rows' uids);
- ``ppo_policy_loss`` and ``reduce_loss``: its "regular" and "dual_clip" policy loss, a sum over the tokens of the
  scaled advantages' loss, and what they call (``safe_exp_delta``, ``masked_mean``, ``apply_off_policy_correction``).

``scripts/setup.sh`` downloads the wheel into ``.cache/wheels`` (``pip download --no-deps skyrl==0.3.0``).
"""

from __future__ import annotations

import ast
import functools
import types
import zipfile

import pytest
import torch
from peer_wheels import missing_wheel, peer_wheel

VERSION = "0.3.0"
FUNCTIONS = {  # file in the wheel: the functions taken from it, in an order that defines each before its callers run
    "skyrl/backends/skyrl_train/utils/torch_utils.py": ("masked_mean", "safe_exp_delta"),
    "skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py": ("apply_off_policy_correction",),
    "skyrl/backends/skyrl_train/utils/ppo_utils.py": (
        "reduce_loss",
        "ppo_policy_loss",
        "apply_loss_reduction_to_advantages_minibatch",
    ),
    "skyrl/train/dataset/preprocess.py": ("compute_prompt_boundaries",),
}


@functools.cache
def _load():
    wheel = peer_wheel("skyrl", VERSION)
    if wheel is None:
        return None
    namespace: dict = {"torch": torch, "__name__": "skyrl_wheel_code"}
    exec("from typing import Dict, List, Optional, Tuple, Union", namespace)
    with zipfile.ZipFile(wheel) as archive:
        for path, names in FUNCTIONS.items():
            tree = ast.parse(archive.read(path).decode(), filename=path)
            found = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
            for name in names:
                node = found[name]
                node.decorator_list, node.returns = [], None
                for arg in ast.walk(node.args):  # (their types name modules not loaded here: jaxtyping, SkyRL's)
                    if isinstance(arg, ast.arg):
                        arg.annotation = None
                exec(compile(ast.Module(body=[node], type_ignores=[]), f"{wheel.name}/{path}", "exec"), namespace)
    return types.SimpleNamespace(**{name: namespace[name] for names in FUNCTIONS.values() for name in names})


def skyrl_code():
    """SkyRL's functions (``FUNCTIONS``) from the wheel, or a skip that says why there is none."""
    code = _load()
    if code is None:
        pytest.skip(missing_wheel("skyrl", VERSION))
    return code
