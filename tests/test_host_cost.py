"""The host-work benchmark (benchmarks/host_cost.py) runs, and the counts it reports stay bounded.

The counts (aten ops dispatched, Triton launches) are deterministic for a torch version: a ceiling
catches a change that adds small ops around the kernels. Timings are reported, never asserted."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host_cost  # noqa: E402

# measured with torch 2.13 (benchmarks/README.md, "Host work"): 11 / 2 on the one-pass path without the ids check
MAX_FORWARD_OPS, MAX_BACKWARD_OPS = 14, 4


def test_host_work_is_counted_and_bounded(capsys):
    results = host_cost.main(["--iters", "2", "--repeats", "1"])
    assert "host work of one forward + backward" in capsys.readouterr().out
    one_pass = results["grpo_loss one-pass, check_ids=False"]
    # the token-weights, one-pass and loss-metrics kernels, and the in-place gradient scale
    assert one_pass["triton_launches"] == 4
    assert one_pass["aten_ops_forward"] <= MAX_FORWARD_OPS, one_pass
    assert one_pass["aten_ops_backward"] <= MAX_BACKWARD_OPS, one_pass
    assert results["grpo_loss two-pass"]["triton_launches"] == 4  # the same with the backward kernel for the scale
    for name, r in results.items():
        assert r["host_us"] > 0, name
        # Triton's JIT binder timed on the path's own launches (none in the autograd.Function floor)
        assert (r["jit_binding_us"] > 0) == (r["triton_launches"] > 0), (name, r)


def test_jit_binding_is_timed_on_the_recorded_launches():
    """The binder column times Triton's sm_90 binder on each recorded launch's own arguments (the four kernels of
    a one-pass call, in order); no launch, no time."""
    x = host_cost.inputs()
    call = host_cost.paths()["grpo_loss one-pass, check_ids=False"]
    with host_cost.no_op_launches() as launches:
        launches["launched"] = []
        logits = x["logits"].clone().requires_grad_()
        call(x, logits).backward()
        launched = launches["launched"]
    names = [interpreted.fn.__name__ for interpreted, _, _ in launched]
    assert names == ["token_weights_kernel", "grpo_forward_kernel", "loss_metrics_kernel", "scale_in_place_kernel"]
    assert host_cost.jit_binding_us([], 2, 1) == 0
    assert host_cost.jit_binding_us(launched[1:2], 2, 1) > 0
