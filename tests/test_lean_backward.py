"""The backward of a scaled loss: no host sync and no extra [B, T, V] tensor on any path, the right gradient.

Every trainer scales its loss (gradient accumulation, AMP's scaler). A host sync in the
backward stalls the pipeline once a step; a new [B, T, V] tensor costs 5 GB and a full pass at
(16384, 151936) bf16. Both are caught here on the CPU: ``no_host_sync`` makes every
device-to-host read raise, ``LargeAllocations`` records every op that creates a tensor of at
least B * T * V elements (in-place ops and out= variants excepted).
"""

import contextlib

import pytest
import torch
from helpers import assert_close, make_batch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from grpo_kernels import fused_linear_grpo_loss, grpo_loss, grpo_loss_reference, torch_path

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def small_torch_chunks(monkeypatch):
    """The torch path's temporaries are one chunk of rows: smaller than [B, T, V] here, as at real sizes."""
    monkeypatch.setattr(torch_path, "CHUNK_ELEMENTS", 256)


class LargeAllocations(TorchDispatchMode):
    """Records the ops that return a new tensor of at least ``numel`` elements."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        views = any(r.alias_info is not None for r in func._schema.returns)
        if not (writes or views):
            self.ops += [str(func) for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.numel() >= self.numel]
        return out


@contextlib.contextmanager
def no_host_sync():
    """Every way a tensor's value reaches the host raises inside the block."""

    def refuse(*args, **kwargs):
        raise AssertionError("a host sync (a tensor's value read on the host) inside the backward")

    names = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    try:
        for name in names:
            setattr(torch.Tensor, name, refuse)
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


PATHS = {
    "torch": dict(backend="torch"),
    "triton one-pass": dict(backend="triton", one_pass=True),
    "triton two-pass": dict(backend="triton", one_pass=False),
    "triton sequence level": dict(backend="triton", importance_sampling_level="sequence"),
}
SCALES = {"1": None, "python number": 0.25, "0-d tensor": torch.tensor(0.5)}


def _logits_from_a_head(batch, device):
    """Logits as a model makes them: a matmul's output, whose backward creates nothing [B, T, V]-sized."""
    B, T, V = batch["logits"].shape
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(B, T, 8, generator=g).to(device)
    head = (torch.randn(8, V, generator=g) * 0.5).to(device).requires_grad_()
    return hidden, head


def _backward(loss, scale):
    if scale is None:
        loss.backward()
    elif isinstance(scale, torch.Tensor):
        loss.backward(scale.to(loss.device))
    else:
        (loss * scale).backward()


@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize("path", list(PATHS))
def test_a_scaled_backward_has_no_sync_and_no_extra_tensor(path, scale):
    kwargs = dict(PATHS[path])
    device = "cpu" if kwargs["backend"] == "torch" else DEVICE
    batch = {k: (v.to(device) if v is not None else v) for k, v in make_batch(B=3, T=5, V=203, seed=1).items()}
    del batch["logits"]
    B, T, V = 3, 5, 203
    hidden, head = _logits_from_a_head(make_batch(B=3, T=5, V=203), device)
    level = kwargs.pop("importance_sampling_level", "token")
    out = grpo_loss(hidden @ head, **batch, beta=0.04, importance_sampling_level=level, check_ids=False, **kwargs)
    tracker = LargeAllocations(B * T * V)
    with no_host_sync(), tracker:
        _backward(out.loss, SCALES[scale])
    expected_count = 0 if path == "triton one-pass" else 1  # two-pass and torch: the gradient itself, once
    assert len(tracker.ops) == expected_count, tracker.ops

    head64 = head.detach().double().requires_grad_()
    expected = grpo_loss_reference(hidden.double() @ head64, **batch, beta=0.04, importance_sampling_level=level)
    _backward(expected.loss, SCALES[scale])
    assert_close(f"d head ({path}, scale {scale})", head64.grad, head.grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_fused_lm_head_scales_only_small_tensors(backend):
    device = "cpu" if backend == "torch" else DEVICE
    batch = {k: (v.to(device) if v is not None else v) for k, v in make_batch(B=3, T=5, V=203, seed=2).items()}
    del batch["logits"]
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, 5, 8, generator=g).to(device).requires_grad_()
    weight = (torch.randn(203, 8, generator=g) * 0.5).to(device).requires_grad_()
    counts = {}
    for scale in (None, 0.25):
        hidden.grad = weight.grad = None
        out = fused_linear_grpo_loss(hidden, weight, **batch, beta=0.04, backend=backend, check_ids=False)
        tracker = LargeAllocations(3 * 5 * 203)
        with no_host_sync(), tracker:
            _backward(out.loss, scale)
        counts[scale] = len(tracker.ops)
    assert counts[0.25] == counts[None], counts  # the scale adds no [N, V]-sized tensor


@pytest.mark.parametrize("path", ["triton one-pass", "triton two-pass", "torch"])
def test_loss_scale_is_folded_in_and_exact(path):
    kwargs = dict(PATHS[path])
    device = "cpu" if kwargs["backend"] == "torch" else DEVICE
    batch = {k: (v.to(device) if v is not None else v) for k, v in make_batch(B=3, T=5, V=203, seed=5).items()}
    logits = batch.pop("logits")
    plain_leaf, scaled_leaf = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    plain = grpo_loss(plain_leaf, **batch, loss_type="dapo", **kwargs)
    scaled = grpo_loss(scaled_leaf, **batch, loss_type="dapo", loss_scale=0.125, **kwargs)
    plain.loss.backward()
    tracker = LargeAllocations(logits.numel())
    with no_host_sync(), tracker:
        scaled.loss.backward()
    assert_close("loss", plain.loss * 0.125, scaled.loss, atol=1e-7, rtol=1e-6)
    assert_close("dlogits", plain_leaf.grad * 0.125, scaled_leaf.grad, atol=1e-9, rtol=1e-5)
    for name in plain.metrics:  # metrics are the loss's, not the scaled objective's
        assert_close(name, plain.metrics[name], scaled.metrics[name], atol=0, rtol=0)


@pytest.mark.parametrize("path", list(PATHS))
def test_a_second_backward_is_right_or_refused(path):
    kwargs = dict(PATHS[path])
    device = "cpu" if kwargs["backend"] == "torch" else DEVICE
    level = kwargs.pop("importance_sampling_level", "token")
    batch = {k: (v.to(device) if v is not None else v) for k, v in make_batch(B=2, T=4, V=101, seed=6).items()}
    leaf = batch.pop("logits").requires_grad_()
    out = grpo_loss(leaf * 1.0, **batch, importance_sampling_level=level, **kwargs)
    (out.loss * 0.5).backward(retain_graph=True)
    first = leaf.grad.clone()
    if path == "triton one-pass":
        with pytest.raises(RuntimeError, match="second backward through a retained graph"):
            (out.loss * 0.5).backward()
        return
    (out.loss * 0.5).backward()
    assert_close("accumulated twice", 2 * first, leaf.grad, atol=1e-9, rtol=1e-6)


def test_loss_scale_must_be_a_number_or_a_scalar_tensor():
    batch = make_batch(B=2, T=3, V=11)
    with pytest.raises(ValueError, match="loss_scale must be a finite number"):
        grpo_loss(**batch, loss_scale=float("nan"))
    with pytest.raises(ValueError, match=r"loss_scale must be a number or a one-element float tensor, got shape"):
        grpo_loss(**batch, loss_scale=torch.ones(2))
