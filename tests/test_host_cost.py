"""The host-work benchmark (benchmarks/host_cost.py) runs, and the counts it reports stay bounded.

The counts (aten ops dispatched, Triton launches) are deterministic for a torch version: a ceiling
catches a change that adds small ops around the kernels. Timings are reported, never asserted."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host_cost

# measured with torch 2.13 (benchmarks/README.md, "Host work"): 7 / 2 on the one-pass path without the ids check
MAX_FORWARD_OPS, MAX_BACKWARD_OPS = 9, 4


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


def _one_pass_launches():
    """(the inputs, the logits, every launch recorded) of one forward + backward of the one-pass path."""
    x = host_cost.inputs()
    call = host_cost.paths()["grpo_loss one-pass, check_ids=False"]
    with host_cost.no_op_launches() as launches:
        launches["launched"] = []
        logits = x["logits"].clone().requires_grad_()
        call(x, logits).backward()
        return x, logits, launches["launched"]


def test_jit_binding_is_timed_on_the_recorded_launches():
    """The binder column times Triton's sm_90 binder on each recorded launch's own arguments (the four kernels of
    a one-pass call, in order); no launch, no time."""
    _, _, launched = _one_pass_launches()
    names = [interpreted.fn.__name__ for interpreted, _, _ in launched]
    assert names == ["token_weights_kernel", "grpo_forward_kernel", "loss_metrics_kernel", "scale_in_place_kernel"]
    assert host_cost.jit_binding_us([], 2, 1) == 0
    assert host_cost.jit_binding_us(launched[1:2], 2, 1) > 0


def test_positional_launches_bind_as_the_launchers_mean_them():
    """The hot launches pass their arguments positionally, in the kernels' signature order (host time): bound to
    the kernels' own signatures, every argument lands on the parameter the launcher means (a parameter added or
    moved in a kernel without its launch fails here, not as a silent wrong pointer)."""
    import inspect

    import torch

    x, logits, launched = _one_pass_launches()
    bound = {
        interpreted.fn.__name__: inspect.signature(interpreted.fn)
        .bind(*args, **{k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")})
        .arguments
        for interpreted, args, kwargs in launched
    }
    B, T1, V = logits.shape
    T, N = T1 - 1, B * (T1 - 1)
    forward, weights = bound["grpo_forward_kernel"], bound["token_weights_kernel"]
    metrics, scale = bound["loss_metrics_kernel"], bound["scale_in_place_kernel"]
    assert forward["logits_ptr"] is logits and forward["ids_ptr"] is x["completion_ids"]
    assert (forward["stride_b"], forward["stride_t"], forward["T"], forward["V"], forward["N"]) == (
        logits.stride(0),
        logits.stride(1),
        T,
        V,
        N,
    )
    assert forward["mask_ptr"] is x["completion_mask"] and forward["old_ptr"] is x["old_logps"]
    assert forward["ref_ptr"] is x["ref_logps"] and forward["iw_ptr"] is None
    assert forward["adv_ptr"] is weights["adv_out"] and forward["grad_weight_ptr"] is weights["weight_out"]
    assert forward["grad_logits_ptr"].shape == logits.shape and forward["flags_out"].dtype == torch.int8
    assert forward["inv_temperature"] == 1.0 / host_cost.TEMPERATURE and forward["softcap"] is None
    assert forward["loss_scalars"][4] == host_cost.BETA and forward["ROW_ALIGN"] == 1 and not forward["PERSISTENT"]
    assert weights["mask_ptr"] is x["completion_mask"] and weights["adv_ptr"] is x["advantages"]
    assert (weights["T"], weights["S"], weights["N"], weights["V"]) == (T, B, N, V) and weights["ADV_PER_ROW"]
    assert weights["dropped_ptr"] is forward["grad_logits_ptr"] and weights["divisor"] == 1.0
    assert metrics["mask_ptr"] is x["completion_mask"] and metrics["N"] == N
    assert metrics["loss_ptr"] is forward["loss_out"] and metrics["weight_ptr"] is weights["weight_out"]
    assert metrics["kl_ptr"] is forward["kl_out"] and metrics["flags_ptr"] is forward["flags_out"]
    assert metrics["loss_out"].dim() == 0 and metrics["metrics_out"].shape == (5,)
    assert scale["x_ptr"] is forward["grad_logits_ptr"] and scale["numel"] == logits.numel()
