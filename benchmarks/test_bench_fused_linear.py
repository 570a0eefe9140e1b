"""GRPO loss from hidden states: our fused lm_head against the unfused pipeline and Liger's fused-linear loss.

Run with the rest: ``python -m pytest benchmarks/ --benchmark-json=RUN.json`` (GPU: ``bash
benchmarks/gpu_suite.sh``). Paths, all with beta 0.04, temperature 0.7, loss_type grpo:

- ``ours fused``: ``fused_linear_grpo_loss`` (no [N, V] logits; Triton on CUDA, the chunked torch path on CPU)
- ``unfused (lm_head + ours)``: ``hidden @ weight.T`` (cuBLAS on CUDA), then ``grpo_loss`` on the logits
- ``liger fused-linear``: Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (torch.compile'd chunks), when installed
- ``stock TRL fused head``: TRL 1.16's own fused LM head (``ChunkedLogProbFunction``, what its ``GRPOTrainer``
  uses by default) with TRL's GRPO loss in torch (``trl_head.py``), when TRL is installed. On the CPU it runs torch
  tiles of 4096 tokens x 32768 entries, so its CPU memory says nothing of the GPU's

GPU shape: the issue's N = 16384 (16 x 1024), H = 4096, V = 151936 in bf16. Each case records
the median time, TFLOP/s of the useful products (forward 2NVH, forward + backward 6NVH: the
fused path's recompute is not counted, so it shows as lower efficiency), peak memory above
the inputs (GPU), and the time relative to the unfused pipeline measured in the same run.
"""

import pytest
import torch
import trl_head
from cases import BETA, ON_GPU, SMOKE, TEMPERATURE, environment, sync, warm_up_and_time

from grpo_kernels import fused_linear_grpo_loss, grpo_loss

# (B, T, H, V)
GPU_SHAPES = [(16, 1024, 4096, 151936)]
CPU_SHAPES = [(4, 512, 256, 32000)]
SMOKE_SHAPES = [(2, 8, 32, 1003)]
_INPUTS = {}
_MEDIANS = {}


def shapes():
    return SMOKE_SHAPES if SMOKE else GPU_SHAPES if ON_GPU else CPU_SHAPES


def inputs_for(shape):
    if shape not in _INPUTS:
        _INPUTS.clear()
        B, T, H, V = shape
        device, dtype = ("cuda", torch.bfloat16) if ON_GPU else ("cpu", torch.float32)
        g = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(B, T, H, device=device, dtype=dtype, generator=g)
        weight = (torch.randn(V, H, device=device, dtype=dtype, generator=g) * H**-0.5).to(dtype)
        ids = torch.randint(0, V, (B, T), device=device, generator=g)
        mask = torch.ones(B, T, device=device)
        mask[:, T - T // 8 :] = 0  # some padding, as in real batches
        lp = torch.zeros(B, T, device=device)
        with torch.no_grad():
            for b in range(B):  # a row of logits at a time: the fp32 [N, V] would not fit beside the rest
                x = (hidden[b].float() @ weight.float().T) / TEMPERATURE
                lp[b] = torch.log_softmax(x, -1).gather(-1, ids[b].unsqueeze(-1)).squeeze(-1)
        _INPUTS[shape] = dict(
            hidden=hidden,
            weight=weight,
            ids=ids,
            mask=mask,
            adv=torch.randn(B, device=device),
            old=lp + 0.05 * torch.randn(B, T, device=device),
            ref=lp + 0.05 * torch.randn(B, T, device=device),
        )
    return _INPUTS[shape]


def _ours_fused(x, hidden, weight):
    return fused_linear_grpo_loss(
        hidden,
        weight,
        x["ids"],
        x["mask"],
        x["adv"],
        x["old"],
        x["ref"],
        beta=BETA,
        temperature=TEMPERATURE,
        check_ids=False,
    ).loss


def _unfused(x, hidden, weight):
    return grpo_loss(
        hidden @ weight.T,
        x["ids"],
        x["mask"],
        x["adv"],
        x["old"],
        x["ref"],
        beta=BETA,
        temperature=TEMPERATURE,
        check_ids=False,
    ).loss


def _liger():
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss_fn = LigerFusedLinearGRPOLoss(beta=BETA, loss_type="grpo", temperature=TEMPERATURE, compiled=ON_GPU)

    def run(x, hidden, weight):
        return loss_fn(
            hidden, weight, x["ids"], x["mask"], x["adv"], ref_per_token_logps=x["ref"], old_per_token_logps=x["old"]
        )[0]

    return run


def _stock_trl(x, hidden, weight):
    return trl_head.trl_fused_grpo_loss(
        hidden, weight, x["ids"], x["mask"], x["adv"], x["old"], x["ref"], beta=BETA, temperature=TEMPERATURE
    )


def paths():
    """The baseline first (its time is each row's "x unfused"), then ours, stock TRL's own head (TRL's default, what
    users already run), Liger's (about a second a call: last, where a time limit cuts first)."""
    found = {"unfused (lm_head + ours)": _unfused, "ours fused": _ours_fused}
    if trl_head.available():
        found["stock TRL fused head"] = _stock_trl
    try:
        found["liger fused-linear"] = _liger()
    except ImportError:
        pass
    return found


def _cases():
    for shape in shapes():
        for name in paths():
            for backward in (False, True):
                yield pytest.param(
                    name, shape, backward, id=f"{name}-{'x'.join(map(str, shape))}-{'fwd+bwd' if backward else 'fwd'}"
                )


@pytest.mark.parametrize("name, shape, backward", list(_cases()))
def test_fused_linear_grpo_loss(benchmark, name, shape, backward):
    x = inputs_for(shape)
    fn = paths()[name]

    def step():
        if backward:
            hidden = x["hidden"].detach().requires_grad_()
            weight = x["weight"].detach().requires_grad_()
            torch.autograd.grad(fn(x, hidden, weight), (hidden, weight))
        else:
            with torch.no_grad():
                fn(x, x["hidden"], x["weight"])
        sync()

    peak_extra = warm_up_and_time(benchmark, step, rounds=10 if ON_GPU else 3)
    if benchmark.stats is None:  # --benchmark-disable
        return
    seconds = benchmark.stats.stats.median
    B, T, H, V = shape
    N = B * T
    flops = 2 * N * V * H * (3 if backward else 1)
    _MEDIANS[(shape, name, backward)] = seconds
    unfused = _MEDIANS.get((shape, "unfused (lm_head + ours)", backward))
    benchmark.extra_info.update(
        {
            "suite": "fused_linear",
            "path": name,
            "N": N,
            "B": B,
            "T": T,
            "H": H,
            "V": V,
            "dtype": str(x["hidden"].dtype).replace("torch.", ""),
            "pass": "fwd+bwd" if backward else "fwd",
            "median_ms": seconds * 1e3,
            "useful_TFLOPs": flops / seconds / 1e12,
            "vs_unfused": None if unfused is None else seconds / unfused,
            "peak_extra_bytes": peak_extra,
            "logits_bytes": N * V * x["hidden"].element_size(),
            **environment(),
        }
    )


ACTIVE_SHARES = (1.0, 0.1)  # every token counted, and an agentic batch's tenth (its turns scattered)


@pytest.mark.parametrize(
    "share, compaction",
    [
        pytest.param(s, c, id=f"{100 * s:g}%-{'compacted' if c else 'every row'}")
        for s in ACTIVE_SHARES
        for c in (False, True)
    ],  # fmt: skip
)
def test_active_tokens(benchmark, share, compaction):
    """The fused head's loss, forward + backward, with ``share`` of its tokens active (scattered), with the active-token
    compaction (``grpo_kernels.inputs.compacted``: the head's products over the active rows) and without it (every
    row's products, as before it): time and the useful TFLOP/s of the active rows' products (6 n V H)."""
    from grpo_kernels import inputs as call_inputs

    shape = shapes()[0]
    x = dict(inputs_for(shape))
    B, T, H, V = shape
    g = torch.Generator().manual_seed(1)
    x["mask"] = (torch.rand(B, T, generator=g) < share).float().to(x["mask"].device)
    n = int(x["mask"].sum())

    def step():
        hidden = x["hidden"].detach().requires_grad_()
        weight = x["weight"].detach().requires_grad_()
        loss = fused_linear_grpo_loss(
            hidden, weight, x["ids"], x["mask"], x["adv"], x["old"], x["ref"], beta=BETA, temperature=TEMPERATURE
        ).loss  # (check_ids on: the compaction counts the active tokens in the call's one host sync)
        torch.autograd.grad(loss, (hidden, weight))
        sync()

    share_before = call_inputs.COMPACTION_SHARE
    call_inputs.COMPACTION_SHARE = share_before if compaction else 0.0
    try:
        peak_extra = warm_up_and_time(benchmark, step, rounds=10 if ON_GPU else 3)
    finally:
        call_inputs.COMPACTION_SHARE = share_before
    if benchmark.stats is None:
        return
    seconds = benchmark.stats.stats.median
    benchmark.extra_info.update(
        {
            "suite": "active_tokens",
            "path": f"ours fused, {'compacted' if compaction else 'every row'}",
            "active_share": share,
            "active_tokens": n,
            "N": B * T,
            "H": H,
            "V": V,
            "dtype": str(x["hidden"].dtype).replace("torch.", ""),
            "pass": "fwd+bwd",
            "median_ms": seconds * 1e3,
            "useful_TFLOPs": 6 * n * V * H / seconds / 1e12,
            "peak_extra_bytes": peak_extra,
            **environment(),
        }
    )
