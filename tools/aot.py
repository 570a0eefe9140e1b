"""Ahead-of-time compile of every kernel specialization for a GPU target, without a GPU.

``python tools/aot.py --arch 90`` runs the launchers (``grpo_kernels/kernels/logits_launch.py`` and
``fused_linear_launch.py``) on CPU tensors of representative shapes with every kernel
replaced by a recorder, so that what gets compiled is exactly what the launchers pass: the same
arguments, and from them, through Triton's own JIT binder, the same signature (i32 or i64 by value,
as the JIT types integers), divisibility hints and constexprs the JIT would derive at that launch.
Each distinct specialization is compiled for the target with the ptxas in the triton wheel, and the
wheel's cuobjdump reads registers, spills and the SASS. For the streaming logits kernels the SASS of
each hot loop (an innermost loop that loads the logits) gives instructions, MUFU operations (exp2,
log2) and bytes loaded per logit, and from them a static roofline against the H200 (``roofline``).
sm_90 compiles every recorded launch (``primary_launches``: the row kernels in fp32 and fp16 at one vocabulary);
sm_80 and ``--arch gfx942`` (AMD's MI300, with the ROCm backend in the triton wheel) compile
``representative_launches``: every kernel, loss option, schedule and tuned configuration at one dtype and vocabulary;
each vendor's second target of the same code generator, sm_100 (Blackwell) and gfx90a (MI250), ``kind_launches``:
every kernel and tuned configuration once.
AMD's are read for registers, spills and scratch from the AMDGCN kernel descriptor (no hot-loop analysis: that is
NVIDIA's SASS).
It must run without TRITON_INTERPRET (the interpreter has nothing to compile).
tests/test_aot_compile.py runs it in a subprocess and checks the budgets. A developer tool beside the benchmarks, not a
part of the package: it builds the launchers' calls from options, a user of both tiers.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence

import torch

from grpo_kernels.kernels import fused_linear as FL
from grpo_kernels.kernels import fused_linear_launch as lm_head_launch
from grpo_kernels.kernels import kept, kept_launch, logits_launch, reduce, split_row, split_row_launch
from grpo_kernels.kernels import logits as logits_kernels
from grpo_kernels.kernels.contracts import KeptTerms, KeptTokens, LossTokens, OnePassGradient, Sequences, TokenInputs
from grpo_kernels.options import GRPOOptions
from grpo_kernels.pipeline import kernel_reduction

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SOFTCAP = 30.0  # Gemma 2's final_logit_softcapping, for the capped specializations
VOCAB_SIZES = (1003, 32000, 151936)  # one block (small V) and the looping configs
ROWS = 1024  # tokens of the recorded launches: realistic strides, small buffers

# H200 (sm_90): 132 SMs at about 1.98 GHz; 4 schedulers x 32 lanes issue 128 thread-instructions
# a cycle per SM, and the SFU (MUFU) retires 16 a cycle per SM; HBM3e about 4.8 TB/s.
H200 = {"sms": 132, "ghz": 1.98, "issue_per_sm_cycle": 128, "mufu_per_sm_cycle": 16, "hbm_bytes_per_s": 4.8e12}

# CI budgets, thread-instructions per logit in the hot loops (forward + gradient for one-pass;
# entropy on): a kernel above them is issue-bound before it is memory-bound on an H200.
BUDGETS = {"one-pass": 20.0, "forward": 13.0, "backward": 7.0}  # measured: 17.3, 11.1, 6.3 (bf16, sm_90)
# the entropy bonus's gradient: one more FMA and a floor (max) a logit in the gradient loop;
# measured 19.3 (11.1 + 8.2) and 8.4 (bf16, sm_90, 70 and 48 registers)
BUDGETS_ENTROPY_BONUS = {"one-pass": 23.0, "backward": 10.0}
# a split-row chunk held in registers (one block of 4096 over 8 warps: 16 logits a thread): the work item's
# instructions over its logits, both chunk paths and the per-item work counted (an upper bound; measured
# 53.2 and 54.9 with the entropy bonus, bf16, sm_90, triton 3.9; 53.3 and 56.8 with triton 3.6)
BUDGETS_HELD_CHUNK = {"one-pass": 60.0, "one-pass entropy-bonus": 62.0}
# a soft-capped head (Gemma's; its own specialization, the others unchanged): the cap is an exp2, a fast division
# (MUFU.RCP and a multiply) and 3 more instructions a logit in each pass, and the gradient's chain factor 3;
# measured (bf16, V = 32000) 31.3, 16.1, 15.3 with triton 3.9 and 32.2, 17.1, 15.3 with 3.6, on sm_90 and sm_80
BUDGETS_SOFTCAP = {"one-pass": 34.0, "forward": 19.0, "backward": 17.0}
# the row loops software-pipelined (``loop_stages`` > 1, a sweep candidate): the loads become async copies into
# shared memory, read back with LDS behind a barrier, about 2 to 4 instructions a logit more; measured (sm_90, V =
# 32000) 20.5 / 10.8 / 8.1 (bf16) and 22.6 / 11.8 / 8.0 (fp32) with triton 3.9, 22.0 / 11.9 / 7.9 and 24.0 / 12.8 /
# 8.4 with 3.6
BUDGETS_PIPELINED = {"one-pass": 25.0, "forward": 14.0, "backward": 9.0}


@dataclasses.dataclass
class Launch:
    """One kernel launch as a launcher made it: the kernel, its grid and its exact arguments."""

    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict
    label: str = ""


_KERNELS = {
    logits_kernels: ("grpo_forward_kernel", "logprob_backward_kernel", "scale_in_place_kernel"),
    split_row: ("split_row_forward_kernel",),
    reduce: ("token_weights_kernel", "loss_metrics_kernel"),
    FL: (
        "linear_grpo_forward_kernel",
        "linear_grpo_combine_kernel",
        "linear_dlogits_kernel",
        "matmul_kernel",
        "logits_tile_state_kernel",
    ),
    kept: ("kept_state_kernel", "kept_gradient_kernel"),
}


@contextlib.contextmanager
def recorded_launches():
    """Within the block the launchers record their launches instead of running them."""
    launches: list[Launch] = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(Launch(self.fn, tuple(grid), args, dict(kwargs)))

        def __getattr__(self, name):
            return getattr(self.fn, name)

    saved = {(module, name): getattr(module, name) for module, names in _KERNELS.items() for name in names}
    try:
        for (module, name), fn in saved.items():
            setattr(module, name, Recorder(fn))
        yield launches
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)


# AMD targets: MI300 (gfx942) and MI250 (gfx90a) (the ROCm backend in the triton wheel: LLVM's AMDGPU code
# generator and linker). The primary target, sm_90, compiles every recorded launch; the others compile
# ``representative_launches`` (every kernel, loss option, schedule and tuned configuration, one dtype and vocabulary
# each): what differs by target is the code generator, which that set exercises whole
AMD_ARCHS = ("gfx942", "gfx90a")
PRIMARY_ARCH = 90
# A vendor's second target of the same code generator (Blackwell beside Hopper and Ampere, MI250 beside MI300)
# compiles ``kind_launches``: every kernel and every tuned configuration, once each. The loss options and schedules are
# branches of the same kernels, which the first targets compile whole; what a new target can break is its code
# generator, which one specialization of each kernel exercises (and the tuned ones, its own measured configurations).
KINDS_ONLY_ARCHS = ("100", "gfx90a")


def gpu_target(arch):
    """Triton's target for ``arch``: sm_<arch> for a number (90, "80"; warps of 32), an AMD target for a gfx name
    ("gfx942"; wavefronts of 64)."""
    from triton.backends.compiler import GPUTarget

    text = str(arch)
    if text.startswith("gfx"):
        return GPUTarget("hip", text, 64)
    return GPUTarget("cuda", int(text), 32)


def jit_binder(fn, arch):
    """(the binder Triton's JIT makes for a kernel (a ``JITFunction``) on ``arch`` (``gpu_target``), that target's
    backend): what ``JITFunction.run`` calls on every launch to specialize the arguments, before the cache key and
    the driver."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(gpu_target(arch))
    return create_function_from_signature(fn.signature, fn.params, backend), backend


def jit_specialization(launch_: Launch, arch):
    """What Triton's JIT would compile for this launch on ``arch``: (signature, constexprs, attrs, options)."""
    fn = launch_.kernel
    binder, backend = jit_binder(fn, arch)
    bound_args, specialization, options = binder(*launch_.args, **launch_.kwargs)
    return fn._pack_args(backend, launch_.kwargs, bound_args, specialization, options)


def compile_launch(launch_: Launch, arch):
    import triton
    from triton.compiler import ASTSource

    options, signature, constexprs, attrs = jit_specialization(launch_, arch)
    src = ASTSource(launch_.kernel, signature, constexprs, attrs)
    return triton.compile(src, target=gpu_target(arch), options=options.__dict__), options, signature


def _logits_inputs(dtype, V, *, rows=ROWS, aligned=True):
    """[1, rows, V] logits (a view of [1, rows + 1, V] when not aligned: odd V, the model's slice) and the rest."""
    full = torch.empty(1, rows + (0 if aligned else 1), V, dtype=dtype)
    logits = full if aligned else full[:, :-1]
    n = rows
    f32 = lambda: torch.zeros(n)  # noqa: E731
    return dict(
        logits=logits,
        ids=torch.zeros(1, rows, dtype=torch.int64),
        mask=torch.ones(n),
        adv=f32(),
        old=f32(),
        ref=f32(),
        iw=torch.ones(n),
        weight=torch.full((n,), 1.0 / n),
    )


LOSS_OPTIONS = {
    "ppo": GRPOOptions(),
    "ppo+delta+dual_clip+clamps+k3+bias_kl": GRPOOptions(
        beta=0.04, delta=2.0, dual_clip=3.0, log_ratio_clamp=20.0, kl_clamp=10.0, use_bias_correction_kl=True
    ),
    "ppo+k1": GRPOOptions(beta=0.04, kl_estimator="k1"),
    "ppo+k2+kl_clamp": GRPOOptions(beta=0.04, kl_estimator="k2", kl_clamp=10.0),
    # k3's straight-through form (verl's "k3+") here: one specialization fewer than a case of its own
    "cispo+k3+": GRPOOptions(loss_type="cispo", beta=0.04, epsilon_high=5.0, kl_estimator="k3+"),
    "sapo+k3": GRPOOptions(loss_type="sapo", beta=0.04),
}


def logits_launches() -> Iterator[tuple[str, Callable[[], None]]]:
    """(label, a call of the launchers) for every specialization of the logits kernels worth compiling."""
    for dtype_name, dtype in DTYPES.items():
        for V in VOCAB_SIZES:

            def calls(dtype=dtype, V=V, tag=f"{dtype_name} V={V}"):
                x = _logits_inputs(dtype, V)
                yield f"logprobs {tag}", lambda: logits_launch.forward(x["logits"], x["ids"])
                yield (
                    f"logprobs+entropy+mask {tag}",
                    lambda: logits_launch.forward(
                        x["logits"], x["ids"], tokens=TokenInputs(mask=x["mask"]), compute_entropy=True
                    ),
                )
                for name, opts in LOSS_OPTIONS.items():
                    common = dict(
                        kernel_loss=opts.kernel_loss,
                        tokens=TokenInputs(x["mask"], x["adv"], x["old"], x["ref"] if opts.uses_kl else None, x["iw"]),
                        compute_entropy=True,
                    )
                    yield (
                        f"{name}+old+iw one-pass {tag}",
                        lambda c=common: logits_launch.forward(
                            x["logits"], x["ids"], gradient=OnePassGradient(x["weight"]), **c
                        ),
                    )
                    yield f"{name}+old+iw {tag}", lambda c=common: logits_launch.forward(x["logits"], x["ids"], **c)
                yield (
                    f"ppo+old+iw one-pass persistent {tag}",
                    lambda: logits_launch.forward(
                        x["logits"],
                        x["ids"],
                        kernel_loss=LOSS_OPTIONS["ppo"].kernel_loss,
                        tokens=TokenInputs(x["mask"], x["adv"], x["old"], importance_weights=x["iw"]),
                        compute_entropy=True,
                        gradient=OnePassGradient(x["weight"]),
                        config={"programs_per_sm": 2},
                    ),
                )
                # the row loops' other settings (logits_launch.loop_config): software-pipelined (the loads become
                # 16-byte async copies through shared memory), and without the L2 eviction hints
                for loops, setting in (("pipelined", {"loop_stages": 3}), ("no-l2-hints", {"l2_hints": False})):
                    yield (
                        f"ppo+old+iw one-pass {loops} {tag}",
                        lambda c=setting: logits_launch.forward(
                            x["logits"],
                            x["ids"],
                            kernel_loss=LOSS_OPTIONS["ppo"].kernel_loss,
                            tokens=TokenInputs(x["mask"], x["adv"], x["old"], importance_weights=x["iw"]),
                            compute_entropy=True,
                            gradient=OnePassGradient(x["weight"]),
                            config=c,
                        ),
                    )
                    yield (
                        f"logprobs {loops} {tag}",
                        lambda c=setting: logits_launch.forward(x["logits"], x["ids"], config=c),
                    )
                    yield (
                        f"dlogits {loops} {tag}",
                        lambda c=setting: logits_launch.backward(
                            x["logits"], x["ids"], x["adv"], x["adv"], 1.0, config=c
                        ),
                    )
                yield (
                    f"ppo on-policy one-pass {tag}",
                    lambda: logits_launch.forward(
                        x["logits"],
                        x["ids"],
                        kernel_loss=LOSS_OPTIONS["ppo"].kernel_loss,
                        tokens=TokenInputs(x["mask"], x["adv"]),
                        gradient=OnePassGradient(x["weight"]),
                    ),
                )
                yield (
                    f"ppo+entropy-bonus one-pass {tag}",
                    lambda: logits_launch.forward(
                        x["logits"],
                        x["ids"],
                        kernel_loss=LOSS_OPTIONS["ppo"].kernel_loss,
                        tokens=TokenInputs(x["mask"], x["adv"], x["old"]),
                        compute_entropy=True,
                        gradient=OnePassGradient(x["weight"], x["weight"]),
                    ),
                )
                if V >= 32000:  # the split-row schedule (one cooperative launch: see record_all); at V = 151936,
                    # K = 64 is a block a chunk held in registers (38 chunks; bf16 and fp16), and K = 8 at V = 32000
                    for chunks, bonus in ((8, False), (4, True)) + (((64, False), (64, True)) if V > 32000 else ()):
                        name = "ppo+entropy-bonus" if bonus else "ppo+old+iw"
                        yield (
                            f"{name} one-pass split-row K={chunks} {tag}",
                            lambda k=chunks, e=bonus: _split_row(
                                k,
                                logits_launch.forward,
                                x["logits"],
                                x["ids"],
                                kernel_loss=LOSS_OPTIONS["ppo"].kernel_loss,
                                tokens=TokenInputs(
                                    x["mask"], x["adv"], x["old"], importance_weights=None if e else x["iw"]
                                ),
                                compute_entropy=True,
                                gradient=OnePassGradient(x["weight"], x["weight"] if e else None),
                            ),
                        )
                if V == 32000 and dtype == torch.bfloat16:  # K = 1: the row held whole by a program of 16 warps
                    yield (
                        f"ppo+old+iw one-pass split-row K=1 whole row {tag}",
                        lambda: _split_row(
                            1,
                            logits_launch.forward,
                            x["logits"],
                            x["ids"],
                            kernel_loss=LOSS_OPTIONS["ppo"].kernel_loss,
                            tokens=TokenInputs(x["mask"], x["adv"], x["old"], importance_weights=x["iw"]),
                            compute_entropy=True,
                            gradient=OnePassGradient(x["weight"]),
                            config={"BLOCK_V": 32768, "num_warps": 16},
                        ),
                    )
                yield f"dlogits {tag}", lambda: logits_launch.backward(x["logits"], x["ids"], x["adv"], x["adv"], 1.0)
                if dtype != torch.float16:  # a soft-capped head (Gemma's): the cap is a specialization of its own
                    capped = GRPOOptions(logit_softcap=SOFTCAP)
                    yield (
                        f"logprobs+entropy+mask softcap {tag}",
                        lambda: logits_launch.forward(
                            x["logits"],
                            x["ids"],
                            tokens=TokenInputs(mask=x["mask"]),
                            compute_entropy=True,
                            softcap=SOFTCAP,
                        ),
                    )
                    yield (
                        f"ppo+old+iw one-pass softcap {tag}",
                        lambda: logits_launch.forward(
                            x["logits"],
                            x["ids"],
                            kernel_loss=capped.kernel_loss,
                            tokens=TokenInputs(x["mask"], x["adv"], x["old"], importance_weights=x["iw"]),
                            compute_entropy=True,
                            gradient=OnePassGradient(x["weight"]),
                        ),
                    )
                    yield (
                        f"dlogits softcap {tag}",
                        lambda: logits_launch.backward(x["logits"], x["ids"], x["adv"], x["adv"], 1.0, softcap=SOFTCAP),
                    )
                yield (
                    f"dlogits+entropy-bonus {tag}",
                    lambda: logits_launch.backward(
                        x["logits"], x["ids"], x["adv"], x["adv"], 1.0, grad_entropy=x["weight"], entropy=x["adv"]
                    ),
                )
                odd = _logits_inputs(dtype, V, aligned=False)  # a model's logits[:, :-1] of an odd V: rows unaligned
                if V % 2:
                    yield f"logprobs unaligned {tag}", lambda: logits_launch.forward(odd["logits"], odd["ids"])
                    yield (
                        f"dlogits unaligned {tag}",
                        lambda: logits_launch.backward(odd["logits"], odd["ids"], odd["adv"], odd["adv"], 1.0),
                    )
                yield f"scale {tag}", lambda: logits_launch.scale_in_place(x["logits"].reshape(-1), torch.ones(()))

            yield from calls()
    # long context: a row stride past 2^31 elements makes the JIT type it i64 (a kernel of its own)
    long_rows = (1 << 31) // 151936 + 1
    long = _logits_inputs(torch.bfloat16, 151936, rows=long_rows)
    yield (
        "logprobs+entropy+mask bf16 V=151936 long-context",
        lambda: logits_launch.forward(
            long["logits"], long["ids"], tokens=TokenInputs(mask=long["mask"]), compute_entropy=True
        ),
    )


def tuned_launches(table: dict | None = None) -> Iterator[tuple[str, Callable[[], None]]]:
    """The launches of every measured configuration in ``tuned.json`` (``table``: another such table), as a GPU of
    that architecture runs them: a "logits" entry's one-pass kernel (or its two-pass forward and backward), a
    "logprobs" entry's log-prob pass; each at its entry's vocabulary and dtype, its keys passed as the launch's
    config (an entry without "l2_hints" runs without them: ``logits_launch.logits_launch_config``). Labelled "tuned".
    A CPU tensor never finds an entry (the lookup is by the GPU's architecture), so the other specializations are
    the heuristic's; these are what the device runs."""
    from grpo_kernels.kernels import tuned

    table = tuned.table() if table is None else table
    names = {str(dtype).replace("torch.", ""): (name, dtype) for name, dtype in DTYPES.items()}
    for kind in ("logits", "logprobs"):
        for entry in table.get(kind, []):
            if entry["dtype"] not in names:
                continue
            dtype_name, dtype = names[entry["dtype"]]
            keys = tuned.LOGITS_KEYS if kind == "logits" else tuned.LOGPROBS_KEYS
            config = {k: entry.get(k) for k in keys}
            config["l2_hints"] = bool(entry.get("l2_hints", False))
            x = _logits_inputs(dtype, entry["V"])
            tag = f"tuned {entry['arch']} {dtype_name} V={entry['V']}"
            if kind == "logprobs":
                yield f"logprobs {tag}", lambda x=x, c=config: logits_launch.forward(x["logits"], x["ids"], config=c)
                continue
            tokens = TokenInputs(x["mask"], x["adv"], x["old"], importance_weights=x["iw"])
            loss = LOSS_OPTIONS["ppo"].kernel_loss
            if entry.get("one_pass", True) and not entry.get("split_row"):
                yield (
                    f"ppo+old+iw one-pass {tag}",
                    lambda x=x, c=config, t=tokens, loss=loss: logits_launch.forward(
                        x["logits"],
                        x["ids"],
                        kernel_loss=loss,
                        tokens=t,
                        compute_entropy=True,
                        gradient=OnePassGradient(x["weight"]),
                        config=c,
                    ),
                )
            elif not entry.get("split_row"):
                yield (
                    f"ppo+old+iw {tag}",
                    lambda x=x, c=config, t=tokens, loss=loss: logits_launch.forward(
                        x["logits"], x["ids"], kernel_loss=loss, tokens=t, compute_entropy=True, config=c
                    ),
                )
                yield (
                    f"dlogits {tag}",
                    lambda x=x, c=config: logits_launch.backward(
                        x["logits"], x["ids"], x["adv"], x["adv"], 1.0, config=c
                    ),
                )


def fused_linear_launches() -> Iterator[tuple[str, Callable[[], None]]]:
    """The lm_head kernels as the launchers call them, at H = 4096, V = 151936 (256 tokens: one chunk)."""
    N, H, V = 256, 4096, 151936
    opts = {
        "logprobs": None,
        "ppo+old+iw+k3+bias_kl": GRPOOptions(beta=0.04, use_bias_correction_kl=True),
        "cispo+k3+": GRPOOptions(loss_type="cispo", beta=0.04, epsilon_high=5.0, kl_estimator="k3+"),
        "sapo+k3": GRPOOptions(loss_type="sapo", beta=0.04),
    }

    def calls(dtype_name, dtype):  # one frame per dtype, so that each call sees its own tensors
        hidden, weight = torch.empty(N, H, dtype=dtype), torch.empty(V, H, dtype=dtype)
        bias, ids, ones = torch.empty(V, dtype=dtype), torch.zeros(N, dtype=torch.int64), torch.ones(N)
        for name, o in opts.items():
            per_token = (
                dict(tokens=TokenInputs(mask=ones))
                if o is None
                else dict(kernel_loss=o.kernel_loss, tokens=TokenInputs(ones, ones, ones, ones, ones))
            )
            for with_bias in (False, True):
                yield (
                    f"forward {name} bias={with_bias} {dtype_name}",
                    lambda b=with_bias, p=per_token: lm_head_launch.linear_forward(
                        hidden, weight, bias if b else None, ids, compute_entropy=True, **p
                    ),
                )

            def split(p=per_token):
                lm_head_launch.LINEAR_FORWARD_SPLITS = 4
                try:
                    lm_head_launch.linear_forward(hidden, weight, None, ids, compute_entropy=True, **p)
                finally:
                    lm_head_launch.LINEAR_FORWARD_SPLITS = None

            yield f"forward {name} split-v {dtype_name}", split
        for with_bias in (False, True):
            yield (
                f"backward bias={with_bias} {dtype_name}",
                lambda b=with_bias: lm_head_launch.linear_backward(
                    hidden, weight, bias if b else None, ids, ones, ones, 1.0, True
                ),
            )
        yield (
            f"forward logprobs softcap {dtype_name}",
            lambda: lm_head_launch.linear_forward(
                hidden, weight, None, ids, compute_entropy=True, tokens=TokenInputs(mask=ones), softcap=SOFTCAP
            ),
        )
        yield (
            f"backward softcap {dtype_name}",
            lambda: lm_head_launch.linear_backward(hidden, weight, None, ids, ones, ones, 1.0, True, softcap=SOFTCAP),
        )
        yield (
            f"backward entropy-bonus {dtype_name}",
            lambda: lm_head_launch.linear_backward(
                hidden, weight, None, ids, ones, ones, 1.0, True, grad_entropy=ones, entropy=ones
            ),
        )
        if dtype != torch.float32:  # head_precision="fp32_logits": 16-bit operands, the logits never rounded
            yield (
                f"forward logprobs fp32-logits {dtype_name}",
                lambda: lm_head_launch.linear_forward(
                    hidden, weight, None, ids, compute_entropy=True, tokens=TokenInputs(mask=ones), fp32_logits=True
                ),
            )
            yield (
                f"backward fp32-logits {dtype_name}",
                lambda: lm_head_launch.linear_backward(
                    hidden, weight, None, ids, ones, ones, 1.0, True, fp32_logits=True
                ),
            )
        # the 3-product mode without a gradient: cuBLAS tiles (torch.mm runs here for real: H = 16 keeps it quick;
        # the tile kernel never reads H) folded by the tile-state kernel, then the combine kernel
        narrow, narrow_weight = torch.zeros(N, 16, dtype=dtype), torch.zeros(V, 16, dtype=dtype)
        for name, o in (
            ("ppo+old+iw+k3+bias_kl", opts["ppo+old+iw+k3+bias_kl"]),
            ("softcap", GRPOOptions(logit_softcap=SOFTCAP)),
        ):
            yield (
                f"three-products no-grad {name} {dtype_name}",
                lambda o=o: lm_head_launch.linear_three_products(
                    narrow,
                    narrow_weight,
                    None,
                    ids,
                    kernel_loss=o.kernel_loss,
                    tokens=TokenInputs(ones, ones, ones, ones, ones),
                    compute_entropy=True,
                    gradient=None,
                    compute_weight_grad=False,
                ),
            )

    yield from calls("bf16", torch.bfloat16)
    yield from calls("fp32", torch.float32)


def kept_launches() -> Iterator[tuple[str, Callable[[], None]]]:
    """The kept set's kernels (``kernels/kept.py``: CSR and padded sets, from logits and from the head, the
    gradient's entries with each entropy) and the logits and lm_head kernels taking a set's log-sum-exp, at bf16
    and V = 32000 (labelled so: the other targets compile them too; their fp32 forms differ only in the loads)."""
    rows, H, V, K = 1024, 4096, 32000, 64
    for dtype_name, dtype in (("bf16", torch.bfloat16),):

        def calls(dtype=dtype, dtype_name=dtype_name, tag=f"{dtype_name} V={V}"):
            x = _logits_inputs(dtype, V, rows=rows)
            flat_ids, ones = x["ids"].reshape(-1), torch.ones(rows)
            csr = KeptTokens(torch.zeros(rows * K, dtype=torch.int32), torch.zeros(rows + 1, dtype=torch.int64), 0,
                             False, False)  # fmt: skip
            padded = KeptTokens(torch.zeros(rows, K, dtype=torch.int32), None, K, True, True)
            terms = KeptTerms(ones, ones, None, torch.zeros(rows, dtype=torch.int32), ones, torch.zeros(rows * K))
            hidden, weight, bias = torch.empty(rows, H, dtype=dtype), torch.empty(V, H, dtype=dtype), None
            common = dict(temperature=1.0, softcap=None, mask=x["mask"])
            yield f"kept state csr {tag}", lambda: kept_launch.kept_state(x["logits"], x["ids"], csr, **common)
            yield (
                f"kept state padded entropy sum-squares {tag}",
                lambda: kept_launch.kept_state(
                    x["logits"], x["ids"], padded, compute_entropy=True, compute_sum_squares=True, **common
                ),
            )
            yield (
                f"kept head state csr {tag}",
                lambda: kept_launch.linear_kept_state(hidden, weight, bias, flat_ids, csr, **common),
            )
            yield (
                f"kept gradient csr {tag}",
                lambda: kept_launch.kept_gradient(x["logits"], flat_ids, csr, terms, ones, temperature=1.0,
                                                  softcap=None, h=ones, lse=ones, entropy=ones),
            )  # fmt: skip
            yield (
                f"kept gradient padded add-target set-entropy tile {tag}",
                lambda: kept_launch.kept_gradient(
                    torch.empty(rows, V // 4, dtype=dtype), flat_ids, padded, terms._replace(x=torch.zeros(rows, K)),
                    ones, temperature=1.0, softcap=None, h=ones, col0=V // 4, n0=0,
                ),
            )  # fmt: skip
            yield (
                f"kept gradient lead top-k distillation {tag}",
                lambda: kept_launch.kept_gradient(x["logits"], flat_ids, padded._replace(add_target=False,
                                                  entropy_over_set=False), terms._replace(x=torch.zeros(rows, K)),
                                                  ones, temperature=1.0, softcap=None, lead=torch.zeros(rows * K)),
            )  # fmt: skip
            opts = LOSS_OPTIONS["ppo"]
            with_set = TokenInputs(x["mask"], x["adv"], x["old"], kept_lse=ones, kept_entropy=ones)
            yield (
                f"ppo kept-set one-pass {tag}",
                lambda: logits_launch.forward(
                    x["logits"], x["ids"], kernel_loss=opts.kernel_loss, tokens=with_set, compute_entropy=True,
                    gradient=OnePassGradient(x["weight"]),
                ),
            )  # fmt: skip
            yield (
                f"logprobs kept-set {tag}",
                lambda: logits_launch.forward(x["logits"], x["ids"], tokens=TokenInputs(mask=x["mask"], kept_lse=ones)),
            )
            yield (
                f"kept-set head forward ppo {dtype_name}",
                lambda: lm_head_launch.linear_forward(
                    hidden[:256], weight, None, flat_ids[:256], kernel_loss=opts.kernel_loss, compute_entropy=True,
                    tokens=TokenInputs(*(t[:256] for t in (x["mask"], x["adv"], x["old"])), kept_lse=ones[:256]),
                ),
            )  # fmt: skip

        yield from calls()


def reduce_launches() -> Iterator[tuple[str, Callable[[], None]]]:
    """A loss's launches around its logits kernel (``logits_launch.loss_forward``: the token-weights and loss-metrics
    kernels) for each reduction (the prompt mean's per-sequence divisors among them), per-sequence and per-token
    inputs, a packed batch, tensor scales and normalizers, the entropy bonus, each policy term's metrics and the
    dropped position's gradient rows of each dtype."""

    rows, V = 1024, 151936
    S, T = 8, rows // 8
    x = {name: torch.zeros(rows) for name in ("mask", "old", "ref", "adv", "iw")}
    per_row = torch.zeros(S)
    cu_seqlens = torch.arange(0, rows + 1, T, dtype=torch.int32)
    cases = {  # name: (options, sequences, normalizer, loss scale, advantages, importance weights, bonus mask)
        "grpo adv-per-row": (GRPOOptions(), Sequences(S, T), None, 1.0, per_row, None, None),
        "grpo prompt-mean": (GRPOOptions(aggregation="prompt_mean"), Sequences(S, T), None, 1.0, per_row, None, None),
        "dapo normalizer-tensor scale-tensor iw-per-row entropy-bonus": (
            GRPOOptions(loss_type="dapo", beta=0.04, entropy_coef=0.01),
            Sequences(S, T),
            torch.ones(()),
            torch.ones(()),
            x["adv"],
            per_row,
            None,
        ),
        "bnpo packed bonus-mask": (
            GRPOOptions(loss_type="bnpo", entropy_coef=0.01),
            Sequences(S, T, cu_seqlens),
            None,
            0.5,
            per_row,
            x["iw"],
            x["mask"],
        ),
        "dr_grpo no-entropy": (
            GRPOOptions(loss_type="dr_grpo", max_completion_length=T, compute_entropy=False),
            Sequences(S, T),
            None,
            1.0,
            per_row,
            None,
            None,
        ),
        "cispo+k3": (
            GRPOOptions(loss_type="cispo", beta=0.04, epsilon_high=5.0),
            Sequences(S, T),
            100.0,
            1.0,
            per_row,
            None,
            None,
        ),
        "sapo": (GRPOOptions(loss_type="sapo"), Sequences(S, T), None, 1.0, per_row, None, None),
    }
    for dtype_name, dtype in DTYPES.items():
        logits = torch.empty(S, T + 1, V, dtype=dtype)
        ids = torch.zeros(S, T, dtype=torch.int64)
        for name, (opts, sequences, normalizer, scale, adv, iw, bonus) in cases.items():
            loss_tokens = LossTokens(
                TokenInputs(x["mask"], adv, x["old"], x["ref"] if opts.uses_kl else None, iw),
                sequences,
                kernel_reduction(
                    opts, S, normalizer, scale, bonus, per_row if opts.reduction == "prompt_mean" else None
                ),
            )
            grad = torch.empty_like(logits)
            yield (
                f"loss {name} one-pass {dtype_name}",
                lambda o=opts, t=loss_tokens, g=grad, logits=logits, ids=ids: logits_launch.loss_forward(
                    logits[:, :-1], ids, kernel_loss=o.kernel_loss, loss_tokens=t, gradient_out=g, dropped_gradient=g
                ),
            )


def _split_row(chunks: int, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the one-pass loss on the split-row kernel, K = ``chunks``."""
    with split_row_launch.split_row_schedule(chunks):
        return fn(*args, **kwargs)


def record_all() -> list[Launch]:
    """Every distinct launch of the representative calls, labelled by the first call that made it.

    The split-row kernel's launcher, given CPU tensors, makes the interpreter's two launches (publish;
    merge and write): what a GPU runs is the same arguments in one cooperative launch (PHASE 0)."""
    found: dict[tuple, Launch] = {}
    for label, call in (
        list(logits_launches())
        + list(tuned_launches())
        + list(fused_linear_launches())
        + list(reduce_launches())
        + list(kept_launches())
    ):
        with recorded_launches() as launches:
            call()
        for item in launches:
            if item.kernel.fn.__name__ == "split_row_forward_kernel":
                if item.kwargs["PHASE"] == 1:
                    continue
                item.kwargs = {**item.kwargs, "PHASE": 0, "launch_cooperative_grid": True}
            item.label = label
            key = (item.kernel.fn.__name__, _specialization_key(item))
            found.setdefault(key, item)
    return list(found.values())


def _specialization_key(item: Launch) -> str:
    options, signature, constexprs, attrs = jit_specialization(item, 90)
    return repr(
        (
            sorted(signature.items()),
            sorted(constexprs.items()),
            sorted(attrs.items()),
            options.num_warps,
            options.num_stages,
        )
    )


def _resource_usage(cubin: bytes) -> dict[str, int]:
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    usage = {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill", text)]
    usage["SPILL"] = sum(spills)
    return usage


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass_instructions(cubin: bytes) -> list[tuple[int, str, str, bool]]:
    """(address, opcode with modifiers, operands, predicated) of each SASS instruction."""
    return [
        (int(m.group(1), 16), m.group(3), m.group(4).strip(), m.group(2) is not None)
        for m in _SASS_LINE.finditer(_cuobjdump(cubin, "-sass"))
    ]


def hot_loops(cubin: bytes) -> list[dict[str, int]]:
    """The innermost loops that stream full blocks of logits, with their instruction mix per pass.

    A loop is a backward branch (BRA to a lower address); its body is the instructions from the
    target to the branch. NOPs are padding and not counted. The kernels load full blocks without
    a mask (that is what gives them 128-bit loads), so a hot loop is one whose global loads are all
    unpredicated; a loop of masked loads is a cold path (the entropy's -inf fallback).
    """
    instructions = sass_instructions(cubin)  # one disassembly (half a second a kernel) for both readings
    code = [(address, opcode, operands) for address, opcode, operands, _ in instructions]
    predicated_loads = {
        address for address, opcode, _, predicated in instructions if predicated and opcode.startswith("LDG")
    }
    loops = _loops(code)
    innermost = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    result = []
    for begin, end in innermost:
        body = [op for address, op, _ in code if begin <= address <= end and op != "NOP"]
        if not any(op.startswith("LDG") for op in body) or any(begin <= address <= end for address in predicated_loads):
            continue
        result.append(_instruction_mix(body))
    return result


def held_chunk_loop(cubin: bytes) -> dict[str, int]:
    """The split-row kernel's work-item loop when its chunk is held in registers (``HOLD_CHUNK``): there is no
    loop over the logits, so the item's loop is the hot one: the outermost loop that loads a 128-bit vector
    (any load, on rows not 16-byte aligned). Its body counts both chunk paths (a full block, and the row's short
    last chunk) and the per-item work (the state's reductions, the wait, the merge, the loss terms): per logit,
    an upper bound."""
    code = [(address, opcode, operands) for address, opcode, operands, _ in sass_instructions(cubin)]
    loading = []
    for load in ("LDG.E.128", "LDG"):
        loading = loading or [
            (a, b) for a, b in _loops(code) if any(a <= address <= b and op.startswith(load) for address, op, _ in code)
        ]
    begin, end = max(loading, key=lambda loop: loop[1] - loop[0])
    return _instruction_mix([op for address, op, _ in code if begin <= address <= end and op != "NOP"])


def _loops(code) -> list[tuple[int, int]]:
    """(first address, branch address) of each loop: a backward branch (BRA to a lower address)."""
    loops = []
    for address, opcode, operands in code:
        target = re.match(r"\s*(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", operands)
        if opcode.startswith("BRA") and target and target.group(1) and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))
    return loops


def _instruction_mix(body: list[str]) -> dict[str, int]:
    # global loads: LDG, and LDGSTS (a pipelined loop's async copy to shared memory); LDGDEPBAR is its wait
    loads = [op for op in body if op.startswith("LDG") and not op.startswith("LDGDEPBAR")]
    widths = [re.search(r"\.(128|64|32|16)\b", op) for op in loads]
    stores = [op for op in body if op.startswith("STG")]
    # SASS spells the L2 eviction hints as modifiers: LDG.E.EL (evict_last), LDG.E.EF / STG.E.EF (evict_first; a
    # ".cs" streaming store is an STG.E.EF)
    return {
        "instructions": len(body),
        "mufu": sum(op.startswith("MUFU") for op in body),
        "global_loads": len(loads),
        "bytes_loaded": sum(int(m.group(1)) // 8 if m else 4 for m in widths),
        "loads_128": sum(bool(m) and m.group(1) == "128" for m in widths),
        "evict_last_loads": sum(".EL." in op + "." for op in loads),
        "evict_first_loads": sum(".EF." in op + "." for op in loads),
        "global_stores": len(stores),
        "evict_first_stores": sum(".EF." in op + "." for op in stores),
        "shuffles": sum(op.startswith("SHFL") for op in body),
        "barriers": sum(op.startswith("BAR") for op in body),
    }


KERNEL_KINDS = {
    "grpo_forward_kernel": "forward",
    "logprob_backward_kernel": "backward",
    "split_row_forward_kernel": "split-row",
    "scale_in_place_kernel": "scale",
    "token_weights_kernel": "token-weights",
    "loss_metrics_kernel": "loss-metrics",
    "linear_grpo_forward_kernel": "forward",
    "linear_grpo_combine_kernel": "combine",
    "linear_dlogits_kernel": "dlogits",
    "matmul_kernel": "matmul",
    "logits_tile_state_kernel": "tile-state",
    "kept_state_kernel": "kept-state",
    "kept_gradient_kernel": "kept-gradient",
}


def primary_launches(items: list[Launch]) -> list[Launch]:
    """What sm_90 compiles: every recorded launch, but the row kernels' one-block (V = 1003) and largest-vocabulary
    launches in bf16 alone (the GPU's dtype; fp32 and fp16 at V = 32000 with every option and schedule): the other
    dtypes there change only the loads' width, which V = 32000 checks, and cost a fifth of the compile."""
    return [
        item
        for item in items
        if not any(f"{dtype} V={V}" in item.label for dtype in ("fp32", "fp16") for V in VOCAB_SIZES if V != 32000)
    ]


def representative_launches(items: list[Launch]) -> list[Launch]:
    """What the targets other than sm_90 compile: every kernel with every loss option and schedule at bf16 and V =
    32000 (the row loops, split rows, the soft-cap, the entropy bonus), the split-row kernel's every chunking in bf16
    (a chunk held in registers among them), the fused lm_head's kernels in bf16, the loss reductions' launches in
    fp32, the tuned configurations, and the first specialization of any kernel none of these reached (the dtype x
    vocabulary grid, which changes the loads and the blocks, runs on sm_90)."""
    chosen = [
        item
        for item in items
        if "bf16 V=32000" in item.label
        or ("split-row" in item.label and " bf16 " in item.label)
        or " tuned " in f" {item.label} "
        or (item.kernel.fn.__module__.endswith("fused_linear") and item.label.endswith(" bf16"))
        or (item.label.startswith("loss ") and item.label.endswith(" fp32"))
    ]
    return with_every_kernel(chosen, items)


def kind_launches(items: list[Launch]) -> list[Launch]:
    """What a vendor's second target compiles (``KINDS_ONLY_ARCHS``): every tuned configuration, and the first of
    ``representative_launches`` of each kernel none of them reached."""
    return with_every_kernel([item for item in items if " tuned " in f" {item.label} "], representative_launches(items))


def with_every_kernel(chosen: list[Launch], items: list[Launch]) -> list[Launch]:
    """``chosen``, then the first of ``items`` of each kernel none of ``chosen`` launches."""
    reached = {item.kernel.fn.__name__ for item in chosen}
    for item in items:
        if item.kernel.fn.__name__ not in reached:
            chosen.append(item)
            reached.add(item.kernel.fn.__name__)
    return chosen


def _amd_record(item: Launch, arch: str) -> dict[str, object]:
    """What the ROCm compile says of a specialization: vector and scalar registers, registers spilled, scratch
    (private segment) and shared (LDS) bytes, from the kernel descriptor in the AMDGCN assembly."""
    compiled, options, signature = compile_launch(item, arch)
    amdgcn = compiled.asm["amdgcn"]

    def metadata(key: str) -> int:
        found = re.search(rf"\.{key}:\s+(\d+)", amdgcn)
        return int(found.group(1)) if found else 0

    fused = item.kernel.fn.__module__.endswith("fused_linear")
    return {
        "kernel": KERNEL_KINDS[item.kernel.fn.__name__],
        "specialization": ("fused-linear " if fused else "") + item.label,
        "dtype": item.label.split()[-1] if fused else next(d for d in DTYPES if f" {d} " in f" {item.label} "),
        "arch": arch,
        "num_warps": options.num_warps,
        "registers": metadata("vgpr_count"),
        "scalar_registers": metadata("sgpr_count"),
        "spilled_registers": metadata("vgpr_spill_count") + metadata("sgpr_spill_count"),
        "scratch_bytes": metadata("private_segment_fixed_size"),
        "shared_bytes": compiled.metadata.shared,
        "code_bytes": len(compiled.asm["hsaco"]),
    }


def _record(item: Launch, arch) -> dict[str, object]:
    if str(arch).startswith("gfx"):
        return _amd_record(item, str(arch))
    arch = int(arch)
    compiled, options, signature = compile_launch(item, arch)
    _, _, constexprs, _ = jit_specialization(item, arch)
    name = item.kernel.fn.__name__
    named = {item.kernel.arg_names[path[0]]: value for path, value in constexprs.items()}
    usage = _resource_usage(compiled.asm["cubin"])
    ptx = compiled.asm["ptx"]
    fused = item.kernel.fn.__module__.endswith("fused_linear")
    record = {
        "kernel": KERNEL_KINDS[name],
        "specialization": ("fused-linear " if fused else "") + item.label,
        "dtype": item.label.split()[-1] if fused else next(d for d in DTYPES if f" {d} " in f" {item.label} "),
        "arch": f"sm_{arch}",
        "BLOCK_V": named.get("BLOCK_V", named.get("BLOCK_N", named.get("BLOCK"))),
        "row_align": named.get("ROW_ALIGN"),
        "num_warps": options.num_warps,
        "num_stages": options.num_stages,
        "signature": {k: v for k, v in signature.items() if v != "constexpr"},
        "registers": usage.get("REG"),
        "spill_bytes": usage["SPILL"],
        "local_bytes": usage.get("LOCAL", 0),
        **ptx_memory_facts(ptx),
        # tensor-core products (Hopper's wgmma, Ampere's mma.sync) and global-to-shared async copies
        "tensor_core_mma": len(re.findall(r"wgmma\.mma_async|mma\.sync", ptx)),
        "async_copies": len(re.findall(r"cp\.async\.(?:ca|cg)", ptx)),
        "shared_bytes": compiled.metadata.shared,
    }
    held = name == "split_row_forward_kernel" and named["HOLD_CHUNK"]
    if name == "split_row_forward_kernel":  # a cooperative launch: every program resident at once
        record["chunks"] = named["K"]
        record["held_chunk"] = held
        record["resident_programs_per_sm"] = split_row_launch.resident_programs_per_sm(
            usage.get("REG"), options.num_warps, compiled.metadata.shared
        )
    if not fused and name in ("grpo_forward_kernel", "logprob_backward_kernel", "split_row_forward_kernel"):
        logit_bytes = DTYPES[record["dtype"]].itemsize
        loops = [held_chunk_loop(compiled.asm["cubin"])] if held else hot_loops(compiled.asm["cubin"])
        for loop in loops:
            # the logits one pass of the body handles: its loads (the compiler may unroll the loop); a held
            # chunk's item: its block over the threads
            logits = record["BLOCK_V"] / (32 * options.num_warps) if held else loop["bytes_loaded"] / logit_bytes
            loop["logits_per_thread"] = logits
            loop["per_logit"] = round(loop["instructions"] / logits, 2)
            loop["mufu_per_logit"] = round(loop["mufu"] / logits, 3)
        record["hot_loops"] = loops
        record["instructions_per_logit"] = round(sum(loop["per_logit"] for loop in loops), 2)
        record["mufu_per_logit"] = round(sum(loop["mufu_per_logit"] for loop in loops), 3)
        record["logit_bytes"] = logit_bytes
    return record


def ptx_memory_facts(ptx: str) -> dict[str, int]:
    """The global memory instructions of a kernel's PTX that the streaming kernels' design rests on:
    ``vector_loads_128``, 16-byte loads (``ld.global...v4.b32``, ``v2.b64``, whatever their cache modifiers) and
    16-byte async copies (``cp.async`` of 16 bytes: a pipelined loop's loads); ``evict_last_loads`` and
    ``evict_first_loads``, loads carrying that L2 eviction policy (``L1::evict_* ... L2::cache_hint``, the policy
    made by ``createpolicy``); ``streaming_stores``, ``st.global.cs`` (stores marked as not read again)."""
    modifiers = r"(?:\.[\w:]+)*"
    return {
        "vector_loads_128": len(re.findall(rf"ld\.global{modifiers}\.v4\.(?:b32|u32|f32)", ptx))
        + len(re.findall(rf"ld\.global{modifiers}\.v2\.(?:b64|u64)", ptx))
        + len(re.findall(r"cp\.async\.c[ag]\.shared\.global[\w.:]*\s+\[[^]]*\],\s*\[[^]]*\],\s*(?:16|0x10)\b", ptx)),
        "evict_last_loads": len(re.findall(rf"ld\.global{modifiers}\.L1::evict_last{modifiers}\.L2::cache_hint", ptx)),
        "evict_first_loads": len(
            re.findall(rf"ld\.global{modifiers}\.L1::evict_first{modifiers}\.L2::cache_hint", ptx)
        ),
        "streaming_stores": len(re.findall(rf"st\.global\.cs{modifiers}", ptx)),
    }


def roofline(record: dict[str, object], gpu: dict[str, float] = H200) -> dict[str, float]:
    """Static roofline of a streaming kernel from its SASS: at HBM speed under the byte model, which share of
    the GPU's issue slots and of its SFU (MUFU) throughput the hot loops need (over 1: that unit, not HBM,
    bounds the kernel)."""
    one_pass = "one-pass" in record["specialization"]
    reads_writes = 2 if one_pass or record["kernel"] == "backward" else 1  # bytes of logits per logit moved
    logits_per_s = gpu["hbm_bytes_per_s"] / (reads_writes * record["logit_bytes"])
    issue = gpu["sms"] * gpu["issue_per_sm_cycle"] * gpu["ghz"] * 1e9
    mufu = gpu["sms"] * gpu["mufu_per_sm_cycle"] * gpu["ghz"] * 1e9
    return {
        "logits_per_s_at_hbm": logits_per_s,
        "issue_fraction": logits_per_s * record["instructions_per_logit"] / issue,
        "mufu_fraction": logits_per_s * record["mufu_per_logit"] / mufu,
    }


def budget_of(record: dict[str, object]) -> float | None:
    """The CI budget (instructions per logit) of a streaming kernel record, or None for the others."""
    vocab = re.search(r"V=(\d+)", record["specialization"])
    bonus = "entropy-bonus" in record["specialization"]
    if " tuned " in f" {record['specialization']} ":  # a measured config: its measurement judges it, not a budget
        return None
    if record.get("held_chunk"):  # no loop over the logits: the item's loop, whatever the vocabulary
        return BUDGETS_HELD_CHUNK["one-pass entropy-bonus" if bonus else "one-pass"]
    if "instructions_per_logit" not in record or not vocab or int(vocab.group(1)) < 2 * record["BLOCK_V"]:
        return None  # a vocabulary of one or two blocks (V = 1003) never runs the loop
    budgets = {**BUDGETS, **BUDGETS_ENTROPY_BONUS} if bonus else BUDGETS
    if "softcap" in record["specialization"]:
        budgets = BUDGETS_SOFTCAP
    if "pipelined" in record["specialization"]:
        budgets = BUDGETS_PIPELINED
    if "one-pass" in record["specialization"]:
        return budgets["one-pass"]
    return budgets["backward"] if record["kernel"] == "backward" else budgets["forward"]


_WORK: list[tuple[Launch, int]] = []  # what the forked compile workers read (set before the pool forks)


def _compile_one(index: int) -> dict[str, object]:
    item, arch = _WORK[index]
    return _record(item, arch)


def compile_all(
    archs: Sequence[int | str] = (90,), jobs: int | None = None, only: str | None = None
) -> list[dict[str, object]]:
    """Compile every distinct recorded launch for each target (those whose label contains ``only``, where given;
    for sm_100 and gfx90a ``kind_launches``, for the other targets ``representative_launches`` of them); return one
    record per compiled kernel, in
    the order of ``archs`` then of the launches.

    The compiles are independent, so they run in ``jobs`` forked processes (default: one per core); each
    finished one prints a progress line on stderr (the test's stall guard reads it)."""
    global _WORK
    items = [item for item in record_all() if only is None or only in item.label]
    chosen = {
        str(PRIMARY_ARCH): primary_launches(items),
        **dict.fromkeys(KINDS_ONLY_ARCHS, kind_launches(items)),
    }
    representative = representative_launches(items)
    _WORK = [(item, arch) for arch in archs for item in chosen.get(str(arch), representative)]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(_WORK)))

    def reported(results: Iterator[dict[str, object]]) -> Iterator[dict[str, object]]:
        for done, record in enumerate(results, 1):
            print(
                f"aot: {done}/{len(_WORK)} {record['arch']} {record['kernel']} {record['specialization']}",
                file=sys.stderr,
                flush=True,
            )
            yield record

    if jobs == 1:
        records = list(reported(map(_compile_one, range(len(_WORK)))))
    else:  # fork: the workers inherit the recorded launches (kernels and CPU tensors) instead of pickling them
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            records = list(reported(pool.map(_compile_one, range(len(_WORK)))))
    for r in records:
        if "instructions_per_logit" in r:
            r["roofline"] = {k: round(v, 3) for k, v in roofline(r).items() if k != "logits_per_s_at_hbm"}
            r["budget"] = budget_of(r)
    return records


def summary(records: list[dict[str, object]]) -> str:
    """The hot loops of the streaming kernels, one line each, for the docs and CI logs."""
    lines = ["arch  dtype BLOCK_V warps regs instr/logit (per loop)  MUFU/logit issue% MUFU% budget  specialization"]
    for r in records:
        if "instructions_per_logit" not in r:
            continue
        loops = " + ".join(f"{loop['per_logit']:.1f}" for loop in r["hot_loops"])
        lines.append(
            f"{r['arch']} {r['dtype']:5} {r['BLOCK_V']:7} {r['num_warps']:5} {r['registers']:4} "
            f"{r['instructions_per_logit']:5.1f} ({loops:>11}) {r['mufu_per_logit']:10.2f} "
            f"{100 * r['roofline']['issue_fraction']:6.0f} {100 * r['roofline']['mufu_fraction']:5.0f} "
            f"{r['budget'] if r['budget'] else '-':>6}  {r['specialization']}"
            + (" (chunk held)" if r.get("held_chunk") else "")
        )
    return "\n".join(lines)


def signature_facts() -> dict[str, object]:
    """How the JIT types a typical launch and a long-context one (row stride past 2^31): for the tests."""
    facts = {}
    for name, rows in (("typical", 1024), ("long_context", (1 << 31) // 151936 + 1)):
        logits = torch.empty(1, rows, 151936, dtype=torch.bfloat16)
        with recorded_launches() as launches:
            logits_launch.forward(
                logits,
                torch.zeros(1, rows, dtype=torch.int64),
                tokens=TokenInputs(mask=torch.ones(rows)),
                compute_entropy=True,
            )
        (item,) = launches
        options, signature, constexprs, attrs = jit_specialization(item, 90)
        names = item.kernel.arg_names
        facts[name] = {
            "signature": {k: v for k, v in signature.items() if v != "constexpr"},
            "divisible_by_16": sorted(
                names[path[0]] for path, attr in attrs.items() if ["tt.divisibility", 16] in attr
            ),
            "num_warps": options.num_warps,
            "launcher_config": logits_launch.logits_launch_config(logits),
            "constexprs": {names[path[0]]: value for path, value in constexprs.items()},
        }
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch",
        nargs="+",
        default=["90", "80"],
        help="targets: 90 (every launch), 80 (NVIDIA sm_80), 100 (Blackwell), gfx942, gfx90a (AMD MI300 / MI250); all "
        "but 90 compile representative_launches (100 and gfx90a: kind_launches)",
    )
    parser.add_argument("--summary", action="store_true", help="print the hot-loop table instead of JSON")
    parser.add_argument("--signature-facts", action="store_true", help="print how the JIT types two launches")
    parser.add_argument("--jobs", type=int, default=None, help="compile processes (default: one per core)")
    parser.add_argument(
        "--only",
        default=None,
        metavar="TEXT",
        help="compile only the specializations whose label contains TEXT (e.g. softcap)",
    )
    args = parser.parse_args()
    if args.signature_facts:
        print(json.dumps(signature_facts()))
        return
    records = compile_all(args.arch, jobs=args.jobs, only=args.only)
    nvidia = [r for r in records if r["arch"].startswith("sm_")]
    print(summary(nvidia) if args.summary else json.dumps(records))


if __name__ == "__main__":
    main()
