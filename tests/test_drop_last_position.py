"""Logits as the model returns them, [B, T + 1, V] with ``drop_last_position=True``.

The loss, log-probs, metrics and gradient must be those of the aligned view ``logits[:, :-1]``
(the reference on that view is the oracle), the last position's gradient exactly zero, and the
backward must not go through autograd's slice backward (a zero-filled [B, T + 1, V] tensor and a
copy of the whole gradient into it: the point of the option).
"""

import pytest
import torch
from helpers import assert_close, make_batch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_kernels import GRPOLoss, grpo_loss, grpo_loss_reference, token_logprobs

TOL = dict(atol=1e-6, rtol=1e-5)
# (backend, one_pass): the torch path, the one-pass kernel, the two-pass kernels
PATHS = [("torch", None), ("triton", True), ("triton", False)]


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((str(func), out))
        return out


def _full_logits(batch, device):
    """A [B, T + 1, V] leaf whose [:, :-1] view is the batch's logits (the last position random)."""
    B, T, V = batch["logits"].shape
    last = torch.randn(B, 1, V, generator=torch.Generator().manual_seed(5)).to(device)
    return torch.cat([batch["logits"].detach(), last * 3.0], dim=1).requires_grad_()


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("backend, one_pass", PATHS)
def test_full_logits_match_the_aligned_view(device, backend, one_pass, level, in_place):
    batch = make_batch(device=device, seed=4, V=1003)
    options = dict(beta=0.04, temperature=0.8, importance_sampling_level=level)
    inputs = {k: v for k, v in batch.items() if k != "logits"}

    view_leaf = batch["logits"].detach().clone().requires_grad_()
    expected = grpo_loss_reference(view_leaf, **inputs, **options)
    expected.loss.backward()

    leaf = _full_logits(batch, device)
    given = leaf * 1.0 if in_place else leaf  # in place needs a model output (not a leaf) to overwrite
    out = grpo_loss(
        given,
        **inputs,
        **options,
        backend=backend,
        one_pass=one_pass,
        in_place_backward=in_place,
        drop_last_position=True,
    )
    out.loss.backward()
    grad = leaf.grad

    assert grad.shape == leaf.shape
    assert_close("loss", expected.loss, out.loss, **TOL)
    active = batch["completion_mask"] != 0  # masked positions' log-probs are unspecified
    assert_close("per-token log-probs", expected.per_token_logps[active], out.per_token_logps[active], **TOL)
    for name, value in expected.metrics.items():
        assert_close(name, value, out.metrics[name], **TOL)
    assert_close("dlogits", view_leaf.grad, grad[:, :-1], **TOL)
    assert torch.count_nonzero(grad[:, -1]) == 0, "the dropped position must get a zero gradient"


@pytest.mark.parametrize("backend, one_pass", PATHS)
def test_the_backward_writes_the_full_gradient_without_a_slice_copy(device, backend, one_pass):
    """No slice backward, and nothing [B, T + 1, V]-sized is zero-filled: only the last position is."""
    batch = make_batch(device=device, seed=6, V=517)
    inputs = {k: v for k, v in batch.items() if k != "logits"}
    full = _full_logits(batch, device)
    B, T1, V = full.shape
    recorder = _RecordOps()
    with recorder:
        out = grpo_loss(full, **inputs, beta=0.04, backend=backend, one_pass=one_pass, drop_last_position=True)
        torch.autograd.grad(out.loss, full)
    names = [name for name, _ in recorder.ops]
    assert not any("slice_backward" in name for name in names), names
    # (the torch path's masked_fill_ sets the masked tokens' rows of its piece to 0, a guard against their logits'
    # NaN: one op over the whole piece where the batch fits one, as it does here, but no buffer zero-filled)
    fills = [
        name
        for name, result in recorder.ops
        if any(word in name for word in ("zeros", "zero_", "fill_"))
        and "masked_fill" not in name
        and isinstance(result, torch.Tensor)
        and result.numel() >= B * (T1 - 1) * V
    ]
    assert not fills, f"a gradient-sized fill: {fills}"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_token_logprobs_and_the_module_take_full_logits(device, backend):
    batch = make_batch(device=device, seed=8, V=300)
    full = _full_logits(batch, device).detach()
    ids = batch["completion_ids"]
    expected = token_logprobs(batch["logits"], ids, 0.9, backend=backend)
    got = token_logprobs(full, ids, 0.9, backend=backend, drop_last_position=True)
    assert_close("log-probs", expected, got, **TOL)

    inputs = {k: v for k, v in batch.items() if k != "logits"}
    module = GRPOLoss(beta=0.04, backend=backend, drop_last_position=True)
    assert_close(
        "loss", GRPOLoss(beta=0.04, backend=backend)(batch["logits"], **inputs).loss, module(full, **inputs).loss, **TOL
    )


def test_drop_last_position_needs_one_more_position(device):
    batch = make_batch(device=device, seed=9)
    with pytest.raises(
        ValueError,
        match=r"drop_last_position=True needs logits \[B, T \+ 1, V\] for completion_ids "
        r"\[B, T\], got logits \(3, 5, 1003\) and completion_ids \(3, 5\)",
    ):
        grpo_loss(**batch, drop_last_position=True)
    with pytest.raises(TypeError, match="drop_last_position must be a bool, got 1"):
        grpo_loss(**batch, drop_last_position=1)
    from grpo_kernels import FusedLinearGRPOLoss

    with pytest.raises(ValueError, match="drop_last_position=True applies to GRPOLoss on logits"):
        FusedLinearGRPOLoss(drop_last_position=True)
