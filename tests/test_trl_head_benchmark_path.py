"""The benchmarks' "stock TRL" path (``benchmarks/trl_head.py``: TRL 1.16's own fused LM head with TRL's GRPO
loss) computes the loss ours does: the same value and gradients as ``fused_linear_grpo_loss`` on the CPU, so that
a benchmark row compares the speed and memory of one loss, never of two."""

import sys
from pathlib import Path

import pytest
import torch

from grpo_kernels import fused_linear_grpo_loss

pytest.importorskip("trl", reason="the trl extra is not installed (pip install 'grpo-kernels[trl]')")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import trl_head


def test_the_chunk_size_is_trls():
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    assert trl_head.CHUNK_SIZE == _CHUNKED_LOGPROB_CHUNK_SIZE


@pytest.mark.parametrize("by_file", [False, True])  # True: as on the GPU machine, TRL's module loaded by file
@pytest.mark.parametrize("off_policy", [False, True])
def test_stock_trl_path_is_our_loss(off_policy, by_file):
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 3, 7, 16, 1003
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64).float()
    weight = torch.randn(V, H, generator=g) * 0.5
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor([[7], [3], [5]])).float()
    adv = torch.randn(B, generator=g)
    ref = -7.0 + 0.3 * torch.randn(B, T, generator=g)
    old = (-7.0 + 0.3 * torch.randn(B, T, generator=g)) if off_policy else None
    grads = []
    losses = []
    for fn in ("trl", "ours"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fn == "trl":
            loss = trl_head.trl_fused_grpo_loss(
                h, w, ids, mask, adv, old, ref, beta=0.04, temperature=0.7, by_file=by_file
            )
        else:
            loss = fused_linear_grpo_loss(h, w, ids, mask, adv, old, ref, beta=0.04, temperature=0.7).loss
        losses.append(loss.detach())
        grads.append(torch.autograd.grad(loss, (h, w)))
    torch.testing.assert_close(losses[0], losses[1], atol=1e-6, rtol=1e-5)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert grads[1][0].abs().max() > 1e-4  # a gradient to compare


def test_without_trls_trainer_the_stand_in_runs_the_backward(monkeypatch):
    """On the GPU machine ``trl.kernels`` imports but ``trl.trainer.utils`` does not (no datasets): the module's
    backward imports it, so the benchmark path must take the stand-in, not fail in the backward."""
    monkeypatch.setitem(sys.modules, "trl.trainer.utils", None)  # any import of it now raises ImportError
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    weight = torch.randn(301, 8, generator=g, requires_grad=True)
    ids = torch.randint(0, 301, (2, 5), generator=g)
    mask = torch.ones(2, 5)
    logps = trl_head.trl_token_logprobs(hidden, weight, ids, mask, temperature=1.0)
    d_hidden, d_weight = torch.autograd.grad(logps.sum(), (hidden, weight))
    expected = torch.log_softmax(hidden @ weight.T, -1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=1e-5)
    e_hidden, e_weight = torch.autograd.grad(expected.sum(), (hidden, weight))
    torch.testing.assert_close(d_hidden, e_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(d_weight, e_weight, atol=1e-5, rtol=1e-5)
