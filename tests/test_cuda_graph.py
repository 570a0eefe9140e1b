"""A GRPO loss step captured in a CUDA graph and replayed: the host work of a call (its Python, its launches'
argument binding) paid once at capture, none at replay.

With ``check_ids=False`` a call makes no host sync, so forward + backward capture as they are; a replay on new
input values must give what an eager call gives on them. CUDA graphs need a GPU: on a CPU these tests are not
collected as runs (the device suite's test stage runs them, compiled).
"""

import pytest
import torch
from helpers import assert_close, make_batch, split_row

from grpo_kernels import grpo_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (the device suite)")

OPTIONS = dict(beta=0.04, temperature=0.9, entropy_coef=0.02)
TOL = dict(atol=1e-6, rtol=1e-5)


def _inputs(seed):
    return make_batch(device="cuda", V=1003, seed=seed, B=4, T=16)


def _eager(inputs, one_pass, schedule):
    logits = inputs["logits"].detach().clone().requires_grad_()
    with schedule():
        out = grpo_loss(**{**inputs, "logits": logits}, backend="triton", one_pass=one_pass, check_ids=False, **OPTIONS)
    out.loss.backward()
    return out, logits.grad


@pytest.mark.parametrize("one_pass, split", [(True, False), (False, False), (True, True)])
def test_a_captured_forward_and_backward_replays_on_new_inputs(one_pass, split):
    """One-pass, two-pass and the split-row kernel (its cooperative launch captured): the replay's loss, metrics
    and gradient on new values are the eager call's."""
    import contextlib

    schedule = (lambda: split_row(4)) if split else contextlib.nullcontext
    static = _inputs(seed=1)
    logits = static["logits"].detach().clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), schedule():  # warm-up: compiles, caches, the split-row kernel's resident count
        for _ in range(2):
            grpo_loss(
                **{**static, "logits": logits}, backend="triton", one_pass=one_pass, check_ids=False, **OPTIONS
            ).loss.backward()
    torch.cuda.current_stream().wait_stream(side)
    logits.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), schedule():
        out = grpo_loss(**{**static, "logits": logits}, backend="triton", one_pass=one_pass, check_ids=False, **OPTIONS)
        out.loss.backward()

    for seed in (2, 3):  # new values in the captured tensors, then a replay
        fresh = _inputs(seed)
        with torch.no_grad():
            logits.copy_(fresh["logits"])
            for name, tensor in static.items():
                if name != "logits":
                    tensor.copy_(fresh[name])
        graph.replay()
        torch.cuda.synchronize()
        expected, expected_grad = _eager(fresh, one_pass, schedule)
        assert_close("loss", expected.loss, out.loss, **TOL)
        assert_close("dlogits", expected_grad, logits.grad, **TOL)
        for name, value in expected.metrics.items():
            assert_close(f"metric {name}", value, out.metrics[name], atol=1e-5, rtol=1e-5)
