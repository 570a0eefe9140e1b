"""Each trainer's small conventions, defined once: the masked means and the loss aggregations whose exact numbers
(an epsilon in a denominator, an fp32 cast, a NaN for an empty mask) a name that points at that trainer promises.

Used by the loss families (``policy_terms``), the rollout corrections (``rollout_correction``) and the adapters
(``integration.verl``, ``integration.openrlhf``), which re-export them under the trainer's own names; no adapter
imports another. Each is tested against the trainer's own code (tests/test_verl_integration.py,
tests/test_openrlhf_integration.py, tests/test_rollout_correction.py).
"""

from __future__ import annotations

from typing import Any

import torch

# ---- verl 0.9 ------------------------------------------------------------------------------------------------------

# verl's masked mean adds it to the mask's count (``verl.utils.torch_functional.masked_mean``), and its aggregation to
# a row's token count (``agg_loss``'s seq-mean-token-mean)
VERL_MEAN_EPS = 1e-8
# verl's ``loss_agg_mode`` values (``core_algos.agg_loss``)
VERL_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def verl_masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """verl's masked sum: a NaN (or inf) where the mask is 0 never reaches the sum."""
    valid = torch.where(mask.bool(), values, 0.0) * mask
    return valid.sum() if dim is None else valid.sum(dim)


def verl_masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """``verl_F.masked_mean``: the masked sum over the mask's sum plus ``VERL_MEAN_EPS`` (0, not NaN, for an empty
    mask); over every element, or along ``dim``."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return verl_masked_sum(values, mask, dim) / (count + VERL_MEAN_EPS)


def verl_aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Any | None = None,
    global_batch_size: Any | None = None,
    loss_scale_factor: Any | None = None,
) -> torch.Tensor:
    """verl's ``agg_loss``: the loss is invariant to the data-parallel split (its ``global_batch_info``:
    ``dp_size``, ``batch_num_tokens`` for the token modes, ``global_batch_size`` for the sequence modes)."""
    if loss_agg_mode not in VERL_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {list(VERL_AGG_MODES)}, got {loss_agg_mode!r}")
    mask = mask.to(loss_mat.dtype)
    if loss_agg_mode in ("token-mean", "token-sum"):
        if loss_agg_mode == "token-sum":
            return (loss_mat * mask).sum() * dp_size
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("token-mean with dp_size > 1 needs the global batch_num_tokens")
            batch_num_tokens = mask.sum()
        return (loss_mat * mask).sum() / batch_num_tokens * dp_size
    tokens = mask.sum(-1)
    row_loss = (loss_mat * mask).sum(-1)
    if loss_agg_mode == "seq-mean-token-mean":
        row_loss = row_loss / (tokens + VERL_MEAN_EPS)
    non_empty = (tokens > 0).to(loss_mat.dtype)  # verl leaves fully masked rows out of the mean
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError(f"{loss_agg_mode} with dp_size > 1 needs the global_batch_size")
        global_batch_size = non_empty.sum()
    loss = (row_loss * non_empty).sum() / global_batch_size * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


# ---- OpenRLHF 0.11 ---------------------------------------------------------------------------------------------------


def openrlhf_masked_mean(x: torch.Tensor, mask: torch.Tensor | None, dim=None) -> torch.Tensor:
    """OpenRLHF's ``masked_mean``: sum(x mask) / sum(mask) in fp32, NaN where the mask is empty (its convention); the
    plain mean without a mask."""
    if mask is None:
        return x.float().mean(dim=dim)
    return (x.float() * mask.float()).sum(dim=dim) / mask.float().sum(dim=dim)


def openrlhf_aggregate_loss(
    loss: torch.Tensor,
    loss_mask: torch.Tensor,
    token_level_loss: bool = True,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
) -> torch.Tensor:
    """OpenRLHF's ``aggregate_loss``: a token mean (``token_level_loss``: the masked sum over the global
    ``batch_num_tokens``, times ``dp_size``, which DeepSpeed's averaging over ranks cancels), or the mean of the
    non-empty sequences' token means (over ``global_batch_size``, times ``dp_size``): verl's ``token-mean`` and
    ``seq-mean-token-mean`` (``verl_aggregate``). Without the global count, the local mean (OpenRLHF then ignores
    ``dp_size``, where verl refuses). Summed in fp32 whatever the loss's dtype, as OpenRLHF's float mask promotes
    its sums (a 16-bit row count would also turn an empty row's ``0 + 1e-8`` into 0 and its mean into NaN)."""
    mode, count = ("token-mean", batch_num_tokens) if token_level_loss else ("seq-mean-token-mean", global_batch_size)
    return verl_aggregate(
        loss.float(), loss_mask.float(), mode, dp_size if count is not None else 1, batch_num_tokens, global_batch_size
    )
