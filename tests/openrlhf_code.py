"""OpenRLHF 0.11.2's own loss code, loaded from its wheel: the oracle of the OpenRLHF preset and adapter.

OpenRLHF's package imports flash-attn (a CUDA build) at the top of ``openrlhf.models``, so the tests load the
two files the loss lives in, ``openrlhf/models/loss.py`` and ``openrlhf/models/utils.py``, from the wheel
itself, as modules of a package of their own. ``utils.py`` imports ``deepspeed`` at the top for a function
these tests never call: a stub stands in where DeepSpeed is not installed. ``scripts/setup.sh`` downloads the
wheel into ``.cache/wheels`` (``pip download --no-deps openrlhf==0.11.2``); a test that finds no wheel tries that
download once, and skips saying so when the registry cannot be reached.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import sys
import types
import zipfile

import pytest
from peer_wheels import missing_wheel, peer_wheel

VERSION = "0.11.2"
PACKAGE = "openrlhf_wheel_models"  # the name the two files are loaded under (never "openrlhf")


def _wheel() -> pathlib.Path | None:
    return peer_wheel("openrlhf", VERSION)


@functools.cache
def _load():
    wheel = _wheel()
    if wheel is None:
        return None
    with zipfile.ZipFile(wheel) as archive:

        def source(name):
            (path,) = [p for p in archive.namelist() if p.endswith(f"/openrlhf/models/{name}")]
            return archive.read(path).decode()

        sources = {name: source(f"{name}.py") for name in ("utils", "loss")}
    package = types.ModuleType(PACKAGE)
    package.__path__ = []
    sys.modules[PACKAGE] = package
    stubbed = "deepspeed" not in sys.modules and importlib.util.find_spec("deepspeed") is None
    if stubbed:  # imported at the top of utils.py, used only by set_z3_leaf_modules
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    try:
        modules = {}
        for name, text in sources.items():  # utils first: loss.py imports masked_mean from it
            module = types.ModuleType(f"{PACKAGE}.{name}")
            module.__package__ = PACKAGE
            module.__file__ = f"{wheel.name}/openrlhf/models/{name}.py"
            sys.modules[module.__name__] = module
            exec(compile(text, module.__file__, "exec"), module.__dict__)
            setattr(package, name, module)
            modules[name] = module
    finally:
        if stubbed:
            del sys.modules["deepspeed"]
    return types.SimpleNamespace(**modules)


def openrlhf_code():
    """(OpenRLHF's ``models.utils``, ``models.loss``) from the wheel, or a skip that says why there is none."""
    code = _load()
    if code is None:
        pytest.skip(missing_wheel("openrlhf", VERSION))
    return code.utils, code.loss


# What OpenRLHF's package imports at its modules' tops that this machine cannot install (flash-attn and vLLM are
# CUDA builds) or the tests do not carry (its math grader's latex parser, its agent's HTTP client, torchdata): a
# stand-in module for each, whose every attribute is a class that refuses to be built. Nothing the actor's loss
# runs touches them.
STANDS_IN = ("flash_attn", "vllm", "pylatexenc", "aiohttp", "torchdata")
# left missing, as where flash-attn is built without its Triton ops: OpenRLHF's log_probs_from_logits imports its
# cross-entropy inside a try and falls back to torch's on ImportError
MISSING = ("flash_attn.ops",)
SITECUSTOMIZE = f'''"""Stand-ins for what OpenRLHF imports and this machine lacks (tests/openrlhf_code.py): imported by
every Python process started with this folder on PYTHONPATH, Ray's workers included."""
import importlib.abc
import importlib.machinery
import sys
import types

STANDS_IN = {STANDS_IN!r}
MISSING = {MISSING!r}


class _Missing:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{{type(self).__module__}}.{{type(self).__name__}} is a stand-in (tests/openrlhf_code.py)")


class _StandIn(types.ModuleType):
    __path__ = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (_Missing,), {{"__module__": self.__name__}})
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in STANDS_IN and not name.startswith(MISSING):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandIn(spec.name)

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())
'''


def openrlhf_tree(dest: pathlib.Path) -> pathlib.Path:
    """OpenRLHF's whole package, every file of it from its wheel, under ``dest``, with a ``sitecustomize.py`` that
    stands in for ``STANDS_IN``: with ``dest`` on PYTHONPATH a process (a Ray worker too) imports OpenRLHF's real
    modules, ``openrlhf.trainer.ray.ppo_actor`` among them. Skips, saying why, where there is no wheel."""
    wheel = _wheel()
    if wheel is None:
        openrlhf_code()  # the skip, with its reason
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            inside = name.split("/purelib/", 1)[-1] if "/purelib/" in name else name
            if inside.startswith("openrlhf/") and not name.endswith("/"):
                target = dest / inside
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(name))
    (dest / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return dest
