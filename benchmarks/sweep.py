"""The device sweep: every candidate launch configuration, timed forward + backward, checked, winners as data.

    python benchmarks/sweep.py --out OUT/sweep.json --budget 60    # on a GPU: time the candidates
    python benchmarks/sweep.py --out OUT/sweep.json --smoke        # no GPU: list them, run two tiny ones
    python benchmarks/sweep.py --apply OUT/sweep.json              # winners -> grpo_kernels/kernels/tuned.json

Logits kernels, at (N, V) = (16384, 151936) and (16384, 32000) in bf16 (grpo loss, beta 0.04,
old log-probs, entropy on: the benchmark suite's case): one-pass and two-pass, each over
BLOCK_V x num_warps x num_stages, the vocabulary loops pipelined or not (loop_stages), with or
without the L2 eviction hints (l2_hints), a program a token or the persistent schedule that keeps
the rows in flight within L2 (programs_per_sm "l2"). Byte model: one-pass moves 2 S bytes (read the
logits, write the gradient; the second read of each row is counted as an L2 hit), two-pass 3 S.
Each candidate is reported as median ms (CUDA events, after warm-up), GB/s under its byte
model, and the fraction of a device-to-device copy's bandwidth measured in the same run.

Log-prob passes (the old and reference log-probs: no loss, no gradient, no entropy), at the same
shapes: their own configurations (kind "logprobs" in tuned.json), timed forward only, 1 S.

Fused lm_head, at (N, H, V) = (16384, 4096, 151936) in bf16: the 3-product mode, and the
recomputing mode's logits-tile configurations (BLOCK_N, BLOCK_V, BLOCK_H, num_warps,
num_stages) of its forward and dlogits kernels, timed forward + backward; reported as ms and
useful TFLOP/s (6 N V H).

Every candidate is checked against the default configuration on the same inputs (log-probs,
loss and gradient) before it may win: a configuration that computes something else is
reported with its error and never becomes a default. Results are written after every
candidate, so a run stopped by its time limit (SIGINT) keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import pathlib
import statistics
import sys
import time

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from grpo_kernels import GRPOOptions, objective  # noqa: E402
from grpo_kernels.kernels import fused_linear_launch as lm_head_launch  # noqa: E402
from grpo_kernels.kernels import logits_launch, split_row_launch, tuned  # noqa: E402
from grpo_kernels.kernels.contracts import OnePassGradient, TokenInputs  # noqa: E402

TEMPERATURE, BETA = 0.7, 0.04
LOGITS_SHAPES = [(16, 1024, 151936), (16, 1024, 32000)]  # (B, T, V)
FUSED_SHAPES = [(16384, 4096, 151936)]  # (N, H, V)
SMOKE_LOGITS_SHAPES = [(2, 4, 1003)]
SMOKE_FUSED_SHAPES = [(32, 32, 300)]


def _candidate(
    mode="one_pass",
    BLOCK_V=4096,
    num_warps=8,
    num_stages=1,
    loop_stages=1,
    l2_hints=False,
    programs_per_sm=None,
    split_row=None,
) -> dict:
    """A logits candidate with every key of a tuned.json entry set (None: that schedule off)."""
    return {
        "mode": mode,
        "BLOCK_V": BLOCK_V,
        "num_warps": num_warps,
        "num_stages": num_stages,
        "loop_stages": loop_stages,
        "l2_hints": l2_hints,
        "programs_per_sm": programs_per_sm,
        "split_row": split_row,
    }


def logits_candidates():
    """Likeliest winners first, so that a run cut short still measures them.

    programs_per_sm: None is one program per token; a number is the persistent schedule (that many
    programs per SM, each striding over the tokens), which bounds the one-pass kernel's rows in flight;
    "l2" that schedule sized so that the rows in flight fit in L2 (logits_launch.l2_programs_per_sm).
    """
    # The H200 runs of 2026-12-01 and -04 (benchmarks/results/gpu/): the one-pass kernel a program a token ran at
    # copy speed for the 2.75 S it moved (ncu: the second read of a row missed L2, 37 % hit rate); 4 persistent
    # programs a SM (157 MB of rows in flight) lost; the split-row kernel lost at every K; BLOCK_V 8192 never came
    # within 5 % of the best then (64-bit loads at 16 warps; now 128-bit at any warp count). So first the read-once
    # schedule: rows in flight within L2, first read evict_last, second evict_first, streaming gradient stores.
    for block_v, num_warps in ((4096, 16), (8192, 16), (4096, 8), (8192, 8)):
        yield _candidate(BLOCK_V=block_v, num_warps=num_warps, l2_hints=True, programs_per_sm="l2")
    for block_v, num_warps in ((4096, 16), (8192, 16)):  # pipelined (triton 3.6's async copies drop the hints)
        yield _candidate(BLOCK_V=block_v, num_warps=num_warps, loop_stages=3, l2_hints=True, programs_per_sm="l2")
    yield _candidate(BLOCK_V=4096, num_warps=16, l2_hints=True, programs_per_sm=2)
    # a program a token, with the hints and pipelined
    for block_v, num_warps, loop_stages in ((4096, 16, 1), (4096, 8, 1), (2048, 8, 1), (4096, 16, 3), (4096, 8, 3)):
        yield _candidate(BLOCK_V=block_v, num_warps=num_warps, loop_stages=loop_stages, l2_hints=True)
    for block_v in (2048, 4096):  # two-pass with the hints: its passes read a row once each
        yield _candidate("two_pass", BLOCK_V=block_v, num_warps=8, l2_hints=True)
    # the split-row schedule (each row over K programs, read once; lost at every K so far): the streamed and the
    # held variant, one each, as the record
    for split_row, block_v, num_warps in ((8, 4096, 8), (64, 4096, 4)):
        yield _candidate(BLOCK_V=block_v, num_warps=num_warps, split_row=split_row)
    # the grid of the earlier runs (no hints, not pipelined), last
    for mode in ("one_pass", "two_pass"):
        for block_v, num_warps, num_stages in itertools.product((4096, 2048), (16, 8, 4), (1, 3)):
            yield _candidate(mode, BLOCK_V=block_v, num_warps=num_warps, num_stages=num_stages)


def logprobs_candidates():
    """A log-prob pass's configurations (no loss, no gradient, no entropy: the old and reference log-probs).

    Liger's log-prob kernel runs one warp over blocks of 2048 (64 logits a thread in flight, many programs a SM)
    and ran at 0.91 of copy speed on the H200 where ours, on the one-pass kernel's config (16 warps), ran at 0.62:
    so few warps with many logits a thread, pipelined or not, against the heuristic's 8 warps."""
    for block_v, num_warps, loop_stages in (
        (2048, 1, 1),
        (2048, 2, 1),
        (4096, 2, 1),
        (4096, 4, 1),
        (8192, 4, 1),
        (4096, 8, 1),
        (8192, 8, 1),
        (2048, 4, 1),
        (4096, 16, 1),
        (2048, 1, 3),
        (2048, 2, 3),
        (4096, 4, 3),
        (4096, 8, 3),
        (8192, 8, 3),
    ):
        yield {
            "BLOCK_V": block_v,
            "num_warps": num_warps,
            "num_stages": 1,
            "loop_stages": loop_stages,
            "l2_hints": True,
        }
    for block_v, num_warps in ((4096, 8), (2048, 1)):  # without the hints
        yield {"BLOCK_V": block_v, "num_warps": num_warps, "num_stages": 1, "loop_stages": 1, "l2_hints": False}


def fused_candidates():
    # the 3-product mode: cuBLAS logits per chunk, the one-pass logits kernel in place, cuBLAS gradients
    yield {"mode": "three_products", **{k: None for k in ("BLOCK_N", "BLOCK_V", "BLOCK_H", "num_warps", "num_stages")}}
    for block_n, block_v, block_h, num_warps, num_stages in (
        (64, 128, 64, 8, 3),
        (64, 128, 64, 8, 4),
        (128, 128, 64, 8, 3),
        (128, 128, 64, 8, 4),
        (64, 256, 64, 8, 3),
        (128, 256, 64, 8, 3),
        (128, 128, 64, 4, 3),
        (64, 128, 32, 4, 4),
    ):
        yield {
            "mode": "recompute",
            "BLOCK_N": block_n,
            "BLOCK_V": block_v,
            "BLOCK_H": block_h,
            "num_warps": num_warps,
            "num_stages": num_stages,
        }


def _sync():
    if ON_GPU:
        torch.cuda.synchronize()


def median_seconds(step, warmup: int = 2, reps: int = 10) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        if ON_GPU:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def logits_inputs(B, T, V, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    logits = torch.randn(B, T, V, device=device, dtype=dtype, generator=g)
    ids = torch.randint(0, V, (B, T), device=device, generator=g)
    mask = torch.ones(B, T, device=device)
    mask[:, T - T // 8 :] = 0
    with torch.no_grad():
        lp = logits_launch.forward(logits, ids, temperature=TEMPERATURE).logp
    flat = lambda t: t.reshape(-1).contiguous()  # noqa: E731
    old = lp + 0.05 * torch.randn(B * T, device=device, generator=g)
    ref_lp = lp + 0.05 * torch.randn(B * T, device=device, generator=g)
    adv = torch.randn(B, device=device, generator=g).repeat_interleave(T)
    opts = GRPOOptions(beta=BETA, temperature=TEMPERATURE)
    weight = flat(objective.reduction_weights(mask, opts).float())
    return dict(logits=logits, ids=ids, mask=flat(mask), adv=adv, old=old, ref=ref_lp, weight=weight, opts=opts)


def _tokens(x) -> TokenInputs:
    """A case's per-token inputs as the launchers take them."""
    return TokenInputs(mask=x["mask"], advantages=x["adv"], old_logps=x["old"], ref_logps=x["ref"])


def run_logits(x, candidate):
    """(logp, loss per token, dlogits) of one candidate: the one-pass kernel, or the forward + backward pair.

    A candidate's schedule is its own: no split rows, no persistent grid, no pipelining and no hints unless it
    sets them (0, 1 and False, not None, so that a measured default in tuned.json never turns a plain candidate
    into another schedule)."""
    config = {k: candidate.get(k) for k in tuned.LOGITS_KEYS}
    config.update(
        split_row=candidate.get("split_row") or 0,
        programs_per_sm=candidate.get("programs_per_sm") or 0,
        loop_stages=candidate.get("loop_stages") or 1,
        l2_hints=bool(candidate.get("l2_hints")),
    )
    common = dict(
        kernel_loss=x["opts"].kernel_loss,
        temperature=TEMPERATURE,
        tokens=_tokens(x),
        compute_entropy=True,
        config=config,
    )
    if candidate["mode"] == "one_pass":
        r = logits_launch.forward(x["logits"], x["ids"], gradient=OnePassGradient(x["weight"]), **common)
        return r.logp, r.loss, r.grad_logits
    r = logits_launch.forward(x["logits"], x["ids"], **common)
    grad = logits_launch.backward(x["logits"], x["ids"], r.lse, r.dloss_dlogp * x["weight"], TEMPERATURE, config=config)
    return r.logp, r.loss, grad


def copy_seconds(t: torch.Tensor) -> float:
    dst = torch.empty_like(t)
    return median_seconds(lambda: dst.copy_(t), warmup=3, reps=15)


def error_against(expected, got) -> float:
    """Largest absolute difference over the (logp, loss, gradient) triple, in fp32."""
    return max(float((e.float() - g.float()).abs().max()) for e, g in zip(expected, got, strict=True))


# Two candidates agree when they differ by less than this: the block size changes the order of
# the fp32 sums; the bf16 gradient may then round one ulp differently (2^-8 of its magnitude).
AGREE = {"logp": 1e-3, "grad": 2.0**-6}


def _record_candidate(row: dict, measure, rows: list, write) -> None:
    """Run one candidate's check and timing into ``row``; a configuration that does not compile or
    launch is a result too. The results file is rewritten after every candidate."""
    try:
        row.update(measure())
    except Exception as e:
        row.update(status=f"error: {type(e).__name__}: {str(e)[:300]}")
    rows.append(row)
    write()


def _release_memory() -> None:
    if ON_GPU:
        torch.cuda.empty_cache()


def incumbent_candidate(logits) -> dict:
    """What the launchers run today for these logits (tuned.json's entry, else the heuristics), as a candidate.
    The sweep times it first: a run cut short by its budget must not crown a new candidate that was never
    compared with the default it would replace."""
    config = logits_launch.logits_launch_config(logits)
    return _candidate(
        "one_pass" if logits_launch.default_one_pass(logits) else "two_pass",
        BLOCK_V=config["BLOCK_V"],
        num_warps=config["num_warps"],
        num_stages=config.get("num_stages"),
        loop_stages=config.get("loop_stages"),
        l2_hints=config.get("l2_hints"),
        programs_per_sm=config.get("programs_per_sm"),
        split_row=config.get("split_row"),
    )


def incumbent_logprobs(logits) -> dict:
    """What a log-prob pass runs today for these logits, as a logprobs candidate (timed first)."""
    config = logits_launch.logits_launch_config(logits, kind="logprobs")
    return {k: config.get(k) for k in tuned.LOGPROBS_KEYS}


def run_logprobs(x, candidate):
    """The log-probs of one log-prob pass candidate (no loss, no entropy, no gradient)."""
    return logits_launch.forward(
        x["logits"],
        x["ids"],
        temperature=TEMPERATURE,
        config={
            **candidate,
            "loop_stages": candidate.get("loop_stages") or 1,
            "l2_hints": bool(candidate.get("l2_hints")),
        },
    ).logp


def sweep_logits(shapes, results, budget_end, write, smoke, logprobs_seconds: float = 0.0):
    """Each shape's loss candidates until ``budget_end`` less ``logprobs_seconds``, then its log-prob pass's
    candidates for ``logprobs_seconds / len(shapes)``."""
    for index, (B, T, V) in enumerate(shapes):
        shape_end = budget_end - logprobs_seconds * (len(shapes) - index) / len(shapes)
        logprobs_end = shape_end + logprobs_seconds / len(shapes)
        device = "cuda" if ON_GPU else "cpu"
        x = logits_inputs(B, T, V, device)
        S = x["logits"].numel() * x["logits"].element_size()
        copy_s = copy_seconds(x["logits"])
        baseline = run_logits(
            x, {"mode": "two_pass", **logits_launch.block_config(V, x["logits"].element_size()), "num_stages": None}
        )
        incumbent = incumbent_candidate(x["logits"])
        candidates = [incumbent] + [c for c in logits_candidates() if c != incumbent]
        schedules = {}  # a split-row candidate's schedule on this V -> the first candidate that runs it
        for i, candidate in enumerate(candidates):
            if candidate["split_row"]:
                chunks = split_row_launch.split_row_chunks(V, candidate["BLOCK_V"], candidate["split_row"])
                if chunks.K == 1 and not chunks.held:
                    results["logits"].append(
                        {
                            "N": B * T,
                            "V": V,
                            **candidate,
                            "status": "skipped (one chunk of several blocks: not a split)",
                        }
                    )
                    continue
                schedule = (chunks, candidate["BLOCK_V"], candidate["num_warps"], candidate["num_stages"])
                if schedule in schedules:  # at V = 32000, K = 64 is K = 8: 8 blocks held
                    results["logits"].append(
                        {"N": B * T, "V": V, **candidate, "status": f"same schedule as split_row={schedules[schedule]}"}
                    )
                    continue
                schedules[schedule] = candidate["split_row"]
            if smoke and i >= 2:
                results["logits"].append({"N": B * T, "V": V, **candidate, "status": "listed (smoke)"})
                continue
            if time.monotonic() > shape_end:
                results["logits"].append({"N": B * T, "V": V, **candidate, "status": "not run (time budget)"})
                continue
            row = {"N": B * T, "V": V, "dtype": str(x["logits"].dtype).replace("torch.", ""), **candidate}

            def measure(candidate=candidate, x=x, baseline=baseline, S=S, copy_s=copy_s):
                out = run_logits(x, candidate)
                logp_err = error_against(baseline[:2], out[:2])
                grad_err = float((baseline[2].float() - out[2].float()).abs().max())
                del out
                seconds = median_seconds(lambda: run_logits(x, candidate), reps=3 if smoke else 10)
                moved = (2 if candidate["mode"] == "one_pass" else 3) * S
                return dict(
                    logp_err=logp_err,
                    grad_err=grad_err,
                    exact=logp_err <= AGREE["logp"] and grad_err <= AGREE["grad"],
                    status="ok",
                    median_ms=seconds * 1e3,
                    model_bytes=moved,
                    model_GBps=moved / seconds / 1e9,
                    copy_GBps=2 * S / copy_s / 1e9,
                    fraction_of_copy=(moved / seconds) / (2 * S / copy_s),
                )

            _record_candidate(row, measure, results["logits"], write)
        sweep_logprobs(x, B * T, V, S, copy_s, results, logprobs_end, write, smoke)
        x = baseline = None  # free the shape's tensors before the next one
        _release_memory()


def sweep_logprobs(x, N, V, S, copy_s, results, budget_end, write, smoke):
    """The log-prob pass's candidates on a logits sweep's inputs, checked against the heuristic's log-probs."""
    baseline = run_logprobs(x, {**logits_launch.block_config(V, x["logits"].element_size()), "l2_hints": False})
    incumbent = incumbent_logprobs(x["logits"])
    candidates = [incumbent] + [c for c in logprobs_candidates() if c != incumbent]
    for i, candidate in enumerate(candidates):
        row = {"N": N, "V": V, "dtype": str(x["logits"].dtype).replace("torch.", ""), **candidate}
        if smoke and i >= 2:
            results["logprobs"].append({**row, "status": "listed (smoke)"})
            continue
        if time.monotonic() > budget_end:
            results["logprobs"].append({**row, "status": "not run (time budget)"})
            continue

        def measure(candidate=candidate):
            err = float((baseline - run_logprobs(x, candidate)).abs().max())
            seconds = median_seconds(lambda: run_logprobs(x, candidate), reps=3 if smoke else 10)
            return dict(
                logp_err=err,
                exact=err <= AGREE["logp"],
                status="ok",
                median_ms=seconds * 1e3,
                model_bytes=S,
                model_GBps=S / seconds / 1e9,
                copy_GBps=2 * S / copy_s / 1e9,
                fraction_of_copy=(S / seconds) / (2 * S / copy_s),
            )

        _record_candidate(row, measure, results["logprobs"], write)


def fused_inputs(N, H, V, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hidden = torch.randn(N, H, device=device, dtype=dtype, generator=g)
    weight = (torch.randn(V, H, device=device, dtype=dtype, generator=g) * H**-0.5).to(dtype)
    ids = torch.randint(0, V, (N,), device=device, generator=g)
    opts = GRPOOptions(beta=BETA, temperature=TEMPERATURE)
    lp = lm_head_launch.linear_forward(hidden, weight, None, ids, temperature=TEMPERATURE).logp
    return dict(
        hidden=hidden,
        weight=weight,
        ids=ids,
        mask=torch.ones(N, device=device),
        adv=torch.randn(N, device=device, generator=g),
        old=lp + 0.05,
        ref=lp - 0.05,
        weight_per_token=torch.full((N,), 1.0 / N, device=device),
        opts=opts,
    )


def run_fused(x, candidate):
    if candidate["mode"] == "three_products":
        r, dh, dw, _ = lm_head_launch.linear_three_products(
            x["hidden"],
            x["weight"],
            None,
            x["ids"],
            kernel_loss=x["opts"].kernel_loss,
            tokens=_tokens(x),
            compute_entropy=True,
            gradient=OnePassGradient(x["weight_per_token"]),
            compute_weight_grad=True,
        )
        return r.logp, r.loss, dh, dw
    config = {k: candidate[k] for k in tuned.FUSED_LINEAR_KEYS}
    r = lm_head_launch.linear_forward(
        x["hidden"],
        x["weight"],
        None,
        x["ids"],
        kernel_loss=x["opts"].kernel_loss,
        temperature=TEMPERATURE,
        tokens=_tokens(x),
        compute_entropy=True,
        config=config,
    )
    dh, dw, _ = lm_head_launch.linear_backward(
        x["hidden"],
        x["weight"],
        None,
        x["ids"],
        r.lse,
        r.dloss_dlogp * x["weight_per_token"],
        TEMPERATURE,
        True,
        config=config,
    )
    return r.logp, r.loss, dh, dw


def run_unfused(x):
    """The lm_head as a model runs it, then the logits kernel: logits rounded to the input dtype
    (one [N, V] product), the one-pass kernel's dlogits, and the two gradient products in fp32.
    The three-product mode computes exactly this, a chunk at a time, so this is its reference."""
    logits = x["hidden"] @ x["weight"].T
    r = logits_launch.forward(
        logits.unsqueeze(0),
        x["ids"].unsqueeze(0),
        kernel_loss=x["opts"].kernel_loss,
        temperature=TEMPERATURE,
        tokens=_tokens(x),
        compute_entropy=True,
        gradient=OnePassGradient(x["weight_per_token"]),
    )
    del logits
    dlogits = r.grad_logits.reshape(x["ids"].shape[0], -1).float()
    return r.logp, r.loss, dlogits @ x["weight"].float(), dlogits.T @ x["hidden"].float()


def sweep_fused(shapes, results, budget_end, write, smoke):
    """The recomputing mode keeps the logits in fp32 and is judged against its default tiles; the
    three-product mode rounds the logits to the input dtype, as an unfused lm_head does, and is
    judged against that unfused path (``run_unfused``). Each row names its reference."""
    for N, H, V in shapes:
        device = "cuda" if ON_GPU else "cpu"
        x = fused_inputs(N, H, V, device)
        references = {
            "recompute": run_fused(x, {"mode": "recompute", **{k: None for k in tuned.FUSED_LINEAR_KEYS}}),
            "three_products": run_unfused(x),
        }
        reference_names = {
            "recompute": "recompute, default tiles (fp32 logits)",
            "three_products": "unfused lm_head + logits kernel (logits in the input dtype)",
        }
        for i, candidate in enumerate(fused_candidates()):
            row = {"N": N, "H": H, "V": V, "dtype": str(x["hidden"].dtype).replace("torch.", ""), **candidate}
            if smoke and i >= 1:
                results["fused_linear"].append({**row, "status": "listed (smoke)"})
                continue
            if time.monotonic() > budget_end:
                results["fused_linear"].append({**row, "status": "not run (time budget)"})
                continue

            def measure(
                candidate=candidate, x=x, references=references, reference_names=reference_names, N=N, V=V, H=H
            ):
                reference = references[candidate["mode"]]
                out = run_fused(x, candidate)
                err = error_against(reference[:2], out[:2])
                scale = max(float(reference[3].abs().max()), 1e-30)
                dw_err = float((reference[3] - out[3]).abs().max()) / scale
                del out
                seconds = median_seconds(lambda: run_fused(x, candidate), warmup=1, reps=2 if smoke else 3)
                return dict(
                    reference=reference_names[candidate["mode"]],
                    logp_err=err,
                    d_weight_rel_err=dw_err,
                    exact=err <= AGREE["logp"] and dw_err <= 1e-2,
                    status="ok",
                    median_ms=seconds * 1e3,
                    useful_TFLOPs=6 * N * V * H / seconds / 1e12,
                )

            _record_candidate(row, measure, results["fused_linear"], write)
        x = references = None  # free the shape's tensors before the next one
        _release_memory()


def environment() -> dict:
    import triton

    info = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }
    if ON_GPU:
        info["device"] = torch.cuda.get_device_name()
        info["arch"] = tuned.arch_of(torch.cuda.current_device())
    else:
        info["device"], info["arch"] = "cpu (Triton interpreter)", "cpu"
    return info


def winners(results) -> dict:
    """The fastest exact candidate per shape, as tuned.json entries (GPU results only)."""
    env = results["environment"]
    out = {"logits": [], "logprobs": [], "fused_linear": []}
    if env["arch"] == "cpu" or results.get("smoke"):  # interpreter times and tiny shapes decide nothing
        return out
    note = f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}"
    for kind, shape_keys in (("logits", ("N", "V")), ("logprobs", ("N", "V")), ("fused_linear", ("N", "H", "V"))):
        best = {}
        for row in results.get(kind, []):
            if row.get("status") == "ok" and row.get("exact"):
                key = tuple(row[k] for k in shape_keys)
                if key not in best or row["median_ms"] < best[key]["median_ms"]:
                    best[key] = row
        for row in best.values():
            entry = {"arch": env["arch"], "dtype": row["dtype"], "V": row["V"]}
            if kind == "logits":
                entry.update({"one_pass": row["mode"] == "one_pass", **{k: row.get(k) for k in tuned.LOGITS_KEYS}})
                measured = f"{row['median_ms']:.3f} ms fwd+bwd at N={row['N']}, {row['model_GBps']:.0f} GB/s"
            elif kind == "logprobs":
                entry.update({k: row.get(k) for k in tuned.LOGPROBS_KEYS})
                measured = f"{row['median_ms']:.3f} ms log-prob pass at N={row['N']}, {row['model_GBps']:.0f} GB/s"
            else:
                entry.update({"H": row["H"], "mode": row["mode"], **{k: row[k] for k in tuned.FUSED_LINEAR_KEYS}})
                measured = f"{row['median_ms']:.1f} ms fwd+bwd at N={row['N']}, {row['useful_TFLOPs']:.0f} TFLOP/s"
            entry["measured"] = f"{measured}; {note}"
            out[kind].append(entry)
    return out


def apply(path: str) -> None:
    """Merge a sweep's winners into tuned.json (an entry of the same arch, dtype and V is replaced)."""
    with open(path) as f:
        found = json.load(f)["winners"]
    table = json.loads(tuned.TABLE_PATH.read_text())
    for kind in ("logits", "logprobs", "fused_linear"):
        if kind not in found:
            continue
        same = lambda a, b: all(a.get(k) == b.get(k) for k in ("arch", "dtype", "V", "H"))  # noqa: E731
        table[kind] = [e for e in table.get(kind, []) if not any(same(e, w) for w in found[kind])] + found[kind]
    tuned.TABLE_PATH.write_text(json.dumps(table, indent=2) + "\n")
    print(f"{sum(len(v) for v in found.values())} winners written to {tuned.TABLE_PATH}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="the results JSON (written after every candidate)")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds for the whole sweep")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, two candidates run, the rest listed")
    parser.add_argument("--apply", metavar="RESULTS", help="write a sweep's winners into kernels/tuned.json")
    args = parser.parse_args(argv)
    if args.apply:
        apply(args.apply)
        return 0
    if not args.out:
        parser.error("--out is required to run the sweep")
    smoke = args.smoke or not ON_GPU
    results = {"environment": environment(), "smoke": smoke, "logits": [], "logprobs": [], "fused_linear": []}
    out_path = pathlib.Path(args.out)

    def write():
        results["winners"] = winners(results)
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(out_path)

    budget_end = time.monotonic() + args.budget
    try:
        # the logits kernels get two thirds of the budget (a fifth of it the log-prob passes'); the lm_head's
        # products are slower to time
        sweep_logits(
            SMOKE_LOGITS_SHAPES if smoke else LOGITS_SHAPES,
            results,
            time.monotonic() + args.budget * 2 / 3,
            write,
            smoke,
            logprobs_seconds=args.budget * 2 / 15,
        )
        sweep_fused(SMOKE_FUSED_SHAPES if smoke else FUSED_SHAPES, results, budget_end, write, smoke)
    except KeyboardInterrupt:  # the suite's time limit: keep what was measured
        results["interrupted"] = True
    write()
    kinds = ("logits", "logprobs", "fused_linear")
    ran = sum(r.get("status") == "ok" for kind in kinds for r in results[kind])
    print(f"sweep: {ran} candidates timed, {sum(len(results[kind]) for kind in kinds)} listed; results in {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
