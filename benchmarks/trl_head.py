"""Stock TRL 1.16's own fused LM head with TRL's GRPO loss: what TRL users already have, as a benchmark path.

TRL 1.16's ``GRPOTrainer`` patches the model with ``trl.trainer.utils.add_fused_lm_head``: the backbone's hidden
states at the completion's positions go through ``ChunkedLogProbFunction`` (cuBLAS products of 4096 tokens x
32768 vocabulary entries, a Triton online log-sum-exp over each tile, the tiles recomputed in the backward;
torch tiles where there is no Triton device), and ``GRPOTrainer._compute_loss`` computes the loss from those
per-token log-probs in torch. ``trl_fused_grpo_loss`` is that pipeline on given hidden states, for
``loss_type="grpo"`` (token-level ratio, clip epsilon both sides, k3 KL to the reference, each sequence's mean
over its tokens, the batch's mean), as ``add_fused_lm_head``'s forward calls it: only the positions with a label
on a Triton device, every position elsewhere.

``tests/test_trl_head_benchmark_path.py`` checks it against our ``fused_linear_grpo_loss`` (loss and gradients),
so that a benchmark compares two computations of the same loss.
"""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import sys
import types

import torch

# trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in TRL 1.16: the vocabulary entries of a tile
CHUNK_SIZE = 32768


def load_chunked_logprob(by_file: bool = False):
    """TRL's ``trl/kernels/chunked_logprob.py`` module. With TRL and its trainer importable, as TRL imports it; else
    (``by_file``, or the GPU machine, where the trl wheel is unpacked without datasets, pandas and pyarrow, which
    ``import trl`` needs) loaded by file under a stand-in package whose ``trainer.utils`` gives the one name the
    module's backward imports, ``maybe_gather_lm_head_ctx``: a null context (it gathers a ZeRO-3 head; there is
    none here)."""
    if not by_file:
        try:
            # its backward imports trl.trainer.utils, which needs datasets: where that fails (the GPU machine),
            # the module would fail only in the backward, so take the stand-in below instead
            import trl.trainer.utils  # noqa: F401
            from trl.kernels import chunked_logprob

            return chunked_logprob
        except ImportError:
            pass
    spec = importlib.util.find_spec("trl")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("trl is not installed")
    root = "_trl_head_standin"
    if f"{root}.kernels.chunked_logprob" not in sys.modules:
        for name in (root, f"{root}.kernels", f"{root}.trainer"):
            package = types.ModuleType(name)
            package.__path__ = []
            sys.modules[name] = package
        utils = types.ModuleType(f"{root}.trainer.utils")
        utils.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
        sys.modules[utils.__name__] = utils
        path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "kernels" / "chunked_logprob.py"
        module_spec = importlib.util.spec_from_file_location(f"{root}.kernels.chunked_logprob", path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
    return sys.modules[f"{root}.kernels.chunked_logprob"]


def available() -> bool:
    try:
        load_chunked_logprob()
    except ImportError:
        return False
    return True


def trl_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
    bias: torch.Tensor | None = None,
    by_file: bool = False,
) -> torch.Tensor:
    """Per-token log-probs [B, T] of ``hidden`` [B, T, H] under the head ``weight`` [V, H] by TRL's fused head, 0
    where ``mask`` is 0 (``add_fused_lm_head``'s forward, its entropy output not asked for, as the GRPO loss
    without an entropy mask does not)."""
    module = load_chunked_logprob(by_file)
    keep = mask.bool()
    compact = module._use_triton(hidden.device)
    flat_hidden = hidden[keep] if compact else hidden.reshape(-1, hidden.shape[-1])
    flat_ids = ids[keep] if compact else ids.reshape(-1)
    log_probs = module.ChunkedLogProbFunction.apply(
        flat_hidden, weight, bias, flat_ids, temperature, CHUNK_SIZE, None, 1.0, ("log_probs",)
    )[0]
    if compact:
        return log_probs.new_zeros(keep.shape).masked_scatter(keep, log_probs)
    return log_probs.view(keep.shape).masked_fill(~keep, 0)


def trl_fused_grpo_loss(
    hidden,
    weight,
    ids,
    mask,
    advantages,
    old_logps,
    ref_logps,
    *,
    beta: float,
    temperature: float,
    epsilon: float = 0.2,
    by_file: bool = False,
) -> torch.Tensor:
    """TRL 1.16's ``loss_type="grpo"`` on its fused head's log-probs (``GRPOTrainer._compute_loss``)."""
    logps = trl_token_logprobs(hidden, weight, ids, mask, temperature, by_file=by_file)
    mask = mask.float()
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * adv)
    if beta:
        per_token = per_token + beta * (torch.exp(ref_logps - logps) - (ref_logps - logps) - 1)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
