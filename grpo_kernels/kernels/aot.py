"""Ahead-of-time compile of every kernel specialization for a GPU target, without a GPU.

``python -m grpo_kernels.kernels.aot --arch 90`` compiles each specialization the launcher
can pick (per loss kind, optional feature flags, logit dtype and block config) to PTX and
a cubin with the ptxas shipped in the triton wheel, then reads registers and spills with
the wheel's ``cuobjdump -res-usage``. It must run without TRITON_INTERPRET (the
interpreter has nothing to compile). tests/test_aot_compile.py runs it in a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from typing import Dict, Iterator, List, Tuple

from ..options import GRPOOptions
from . import fused_linear as FL
from . import grpo as K
from .launch import COMBINE_BLOCK, block_config, forward_constexprs, linear_block_config

DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}
# the forward kernels' run-time float arguments
FLOAT_ARGS = ("inv_temperature", "eps_low", "eps_high", "delta", "dual_clip", "beta", "log_ratio_clamp", "kl_clamp",
              "sapo_tau_pos", "sapo_tau_neg")
VOCAB_SIZES = (1003, 32000, 151936)  # one block (small V) and the looping configs


def _forward_signature(dtype: str) -> Dict[str, str]:
    sig = {name: "*fp32" for name in K.grpo_forward_kernel.arg_names}
    sig.update(logits_ptr=f"*{dtype}", ids_ptr="*i64", flags_out="*i8", grad_logits_ptr=f"*{dtype}")
    for name in ("stride_b", "stride_t", "T", "V", "grad_stride_b", "grad_stride_t"):
        sig[name] = "i64"
    sig.update({name: "fp32" for name in FLOAT_ARGS if name in sig})
    return sig


def _backward_signature(dtype: str) -> Dict[str, str]:
    sig = {name: "i64" for name in K.logprob_backward_kernel.arg_names}
    sig.update(logits_ptr=f"*{dtype}", ids_ptr="*i64", grad_logp_ptr="*fp32", lse_ptr="*fp32",
               grad_logits_ptr=f"*{dtype}", inv_temperature="fp32")
    return sig


def forward_specializations() -> Iterator[Tuple[str, Dict[str, object]]]:
    """Every forward flag combination that changes the generated code materially."""
    yield "logprobs", forward_constexprs(None, has_old=False, has_iw=False, has_mask=False, compute_entropy=False)
    yield "logprobs+entropy+mask", forward_constexprs(None, has_old=False, has_iw=False, has_mask=True,
                                                      compute_entropy=True)
    loss_options = {
        "ppo": GRPOOptions(),
        "ppo+delta+dual_clip+clamps+k3+bias_kl": GRPOOptions(beta=0.04, delta=2.0, dual_clip=3.0, log_ratio_clamp=20.0,
                                                             kl_clamp=10.0, use_bias_correction_kl=True),
        "ppo+k1": GRPOOptions(beta=0.04, kl_estimator="k1"),
        "ppo+k2+kl_clamp": GRPOOptions(beta=0.04, kl_estimator="k2", kl_clamp=10.0),
        "cispo+k3": GRPOOptions(loss_type="cispo", beta=0.04, epsilon_high=5.0),
        "sapo+k3": GRPOOptions(loss_type="sapo", beta=0.04),
    }
    for name, opts in loss_options.items():  # with every optional input, the most live values
        for one_pass in (True, False):
            yield name + "+old+iw" + (" one-pass" if one_pass else ""), forward_constexprs(
                opts, has_old=True, has_iw=True, has_mask=True, compute_entropy=True, write_grad=one_pass)
    yield "ppo on-policy one-pass", forward_constexprs(loss_options["ppo"], has_old=False, has_iw=False,
                                                       has_mask=True, compute_entropy=False, write_grad=True)


def _resource_usage(cubin: bytes) -> Dict[str, int]:
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


def _compile(fn, signature, constexprs, num_warps: int, arch: int, divisible=()):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    # As the JIT does at run time for torch allocations: pointers are 16-byte aligned.
    # ``divisible``: integer arguments the JIT would see as multiples of 16 (and specialize on).
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
               if t.startswith("*") or n in divisible}
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def _linear_signature(fn, dtype: str) -> Dict[str, str]:
    sig = {name: "*fp32" for name in fn.arg_names}
    sig.update(h_ptr=f"*{dtype}", w_ptr=f"*{dtype}", b_ptr=f"*{dtype}", ids_ptr="*i64", flags_out="*i8",
               dx_ptr=f"*{dtype}", a_ptr=f"*{dtype}")
    sig.update({name: "i32" for name in ("N", "V", "H", "M", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn",
                                         "v_per_split", "splits")})
    sig.update({name: "fp32" for name in FLOAT_ARGS})
    return {name: sig[name] for name in fn.arg_names}  # one table for every lm_head kernel: keep this one's


def fused_linear_builds() -> Iterator[Tuple[object, str, Dict[str, object]]]:
    """(kernel, label, flags) of each fused lm_head specialization worth compiling."""
    opts = {"logprobs": None, "ppo+old+iw+k3+bias_kl": GRPOOptions(beta=0.04, use_bias_correction_kl=True),
            "cispo+k3": GRPOOptions(loss_type="cispo", beta=0.04, epsilon_high=5.0),
            "sapo+k3": GRPOOptions(loss_type="sapo", beta=0.04)}
    for name, o in opts.items():
        for bias in (False, True):
            flags = forward_constexprs(o, has_old=o is not None, has_iw=o is not None, has_mask=True,
                                       compute_entropy=True)
            del flags["WRITE_GRAD"]
            yield FL.linear_grpo_forward_kernel, f"forward {name} bias={bias}", {**flags, "HAS_BIAS": bias,
                                                                                "SPLIT_V": False}
            if not bias:
                yield (FL.linear_grpo_forward_kernel, f"forward {name} split-v",
                       {**flags, "HAS_BIAS": False, "SPLIT_V": True})
                yield FL.linear_grpo_combine_kernel, f"combine {name}", flags
    for bias in (False, True):
        yield FL.linear_dlogits_kernel, f"dlogits bias={bias}", {"HAS_BIAS": bias}
    # as launched: d hidden = dx @ W (unit inner strides), d weight += dx^T @ h (dx read transposed)
    yield FL.matmul_kernel, "matmul d_hidden", {"ACCUMULATE": False, "stride_ak": 1, "stride_bn": 1}
    yield FL.matmul_kernel, "matmul d_weight", {"ACCUMULATE": True, "stride_am": 1, "stride_bn": 1}


def compile_fused_linear(arch: int) -> List[Dict[str, object]]:
    """The fused lm_head kernels at the launcher's tiles, per input dtype."""
    import torch

    records = []
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        configs = linear_block_config(torch_dtype)
        for kernel, label, flags in fused_linear_builds():
            if kernel is FL.linear_grpo_combine_kernel:  # element-wise on [BLOCK_N] vectors, no products
                cfg = {"BLOCK_N": COMBINE_BLOCK, "num_warps": 4}
            else:
                cfg = dict(configs["matmul" if kernel is FL.matmul_kernel else "logits"])
            num_warps = cfg.pop("num_warps")
            # V, H and the non-unit strides are multiples of 16 for real models (V = 151936, H = 4096)
            if kernel is not FL.linear_grpo_combine_kernel:
                cfg["UPCAST"] = False
            compiled = _compile(kernel, _linear_signature(kernel, dtype), {**flags, **cfg},
                                num_warps, arch, divisible=("V", "H", "N", "stride_am", "stride_ak", "stride_bk"))
            block = cfg.get("BLOCK_V", cfg.get("BLOCK_N"))
            records.append(_record(label.split()[0], "fused-linear " + label, dtype,
                                   {"BLOCK_V": block, "num_warps": num_warps}, compiled, arch))
    return records


def compile_all(arch: int = 90) -> List[Dict[str, object]]:
    """Compile every specialization; return one record per kernel build."""
    records = compile_fused_linear(arch)
    for dtype, size in DTYPES.items():
        configs = {tuple(block_config(v, size).items()) for v in VOCAB_SIZES}
        for config in sorted(configs):
            cfg = dict(config)
            for label, flags in forward_specializations():
                for align in (16 // size, 1) if label == "logprobs" else (16 // size,):
                    constexprs = {**flags, "ROW_ALIGN": align, "BLOCK_V": cfg["BLOCK_V"]}
                    compiled = _compile(K.grpo_forward_kernel, _forward_signature(dtype), constexprs,
                                        cfg["num_warps"], arch)
                    records.append(_record("forward", f"{label} row_align={align}", dtype, cfg, compiled, arch))
            for align in (16 // size, 1):  # rows 16-byte aligned (common V) or not (odd V)
                compiled = _compile(K.logprob_backward_kernel, _backward_signature(dtype),
                                    {"ROW_ALIGN": align, "BLOCK_V": cfg["BLOCK_V"]}, cfg["num_warps"], arch)
                records.append(_record("backward", f"dlogits row_align={align}", dtype, cfg, compiled, arch))
    return records


def _record(kernel, label, dtype, cfg, compiled, arch):
    usage = _resource_usage(compiled.asm["cubin"])
    ptx = compiled.asm["ptx"]
    return {
        "kernel": kernel, "specialization": label, "dtype": dtype, "arch": f"sm_{arch}", **cfg,
        "registers": usage.get("REG"), "spill_bytes": usage["SPILL"], "local_bytes": usage.get("LOCAL", 0),
        "vector_loads_128": len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.(?:b32|u32|f32)", ptx))
        + len(re.findall(r"ld\.global(?:\.\w+)*\.v2\.(?:b64|u64)", ptx)),
        # tensor-core products (Hopper's wgmma, Ampere's mma.sync) and global-to-shared async copies
        "tensor_core_mma": len(re.findall(r"wgmma\.mma_async|mma\.sync", ptx)),
        "async_copies": len(re.findall(r"cp\.async\.(?:ca|cg)", ptx)),
        "shared_bytes": compiled.metadata.shared,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    args = parser.parse_args()
    records = [r for arch in args.arch for r in compile_all(arch)]
    print(json.dumps(records))


if __name__ == "__main__":
    main()
