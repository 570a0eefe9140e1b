"""Inputs, paths and the byte model shared by the benchmark suites.

S = N * V * b bytes (the logits). Byte model (``docs/kernel-design.md``):
forward reads S; forward + backward moves 2 S at best (read once, write the gradient
once: our one-pass kernel) and 3 S for a two-pass design (read, read again, write).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import triton
from eager_baseline import grpo_loss_eager

from grpo_kernels import GRPOOptions, KeptSet, grpo_loss, objective, token_logprobs, topk_distillation_loss

SMOKE = os.environ.get("GRPO_BENCH_SMOKE") == "1"
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
TEMPERATURE = 0.7
BETA = 0.04

# (rows B, completion length T, vocabulary V): N = B * T tokens
GPU_SHAPES = [(4, 1024, 32000), (16, 1024, 128256), (16, 1024, 151936)]
CPU_SHAPES = [(2, 128, 32000), (4, 256, 32000)]
# One small shape that runs every path in about a second on a CPU (CI's smoke run), big enough (2M logits) that a
# path's time is not its fixed host cost alone: at 16 tokens x 1003 (the smoke shape until 2026-12) the torch
# path's ~0.3 ms of Python and dispatch above eager's was the whole comparison (benchmarks/host_cost.py measures it)
SMOKE_SHAPES = [(4, 64, 8000)]


def sync():
    if ON_GPU:
        torch.cuda.synchronize()


def environment() -> dict[str, str]:
    """Device and versions, recorded with every case."""
    info = {
        "smoke": SMOKE,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if ON_GPU else platform.processor() or platform.machine(),
    }
    for name, dist in (("trl", "trl"), ("liger_kernel", "liger-kernel")):
        try:
            info[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return info


def warm_up_and_time(benchmark, step: Callable[[], None], rounds: int) -> int | None:
    """Two warm-up calls (compile, autotune, caches), one more for peak GPU memory above what is
    allocated before it (None on CPU), then ``rounds`` timed calls through pytest-benchmark."""
    for _ in range(2):
        step()
    peak_extra = None
    if ON_GPU:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        peak_extra = torch.cuda.max_memory_allocated() - base
    benchmark.pedantic(step, rounds=rounds, iterations=1, warmup_rounds=1)
    return peak_extra


def host_and_timeline_ms(call: Callable[[], None], repeats: int = 10) -> tuple[float, float | None]:
    """Host and GPU apart, each a median over ``repeats`` calls of ``call`` (which must not synchronize):
    the host's wall-clock from the call's start until it returns (the Python, the dispatcher, the launches;
    the GPU runs behind it), and the time between CUDA events recorded just before and just after it on the
    GPU's timeline (None on a CPU). A call whose timeline is no longer than its host time is host-bound: the
    GPU waits for the launches."""
    host, timeline = [], []
    for _ in range(repeats):
        sync()
        if ON_GPU:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        call()
        host.append(time.perf_counter() - began)
        if ON_GPU:
            end.record()
        sync()
        if ON_GPU:
            timeline.append(start.elapsed_time(end) / 1e3)
    return statistics.median(host) * 1e3, statistics.median(timeline) * 1e3 if timeline else None


def shapes():
    return SMOKE_SHAPES if SMOKE else GPU_SHAPES if ON_GPU else CPU_SHAPES


def make_inputs(B: int, T: int, V: int, dtype=None, device: str = DEVICE, seed: int = 0) -> dict:
    """Logits [B, T + 1, V] as a model returns them (the last position predicts nothing) and the rest."""
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    g = torch.Generator(device=device).manual_seed(seed)
    full = torch.randn(B, T + 1, V, device=device, dtype=dtype, generator=g)
    ids = torch.randint(0, V, (B, T), device=device, generator=g)
    mask = torch.ones(B, T, device=device)
    mask[:, T - T // 8 :] = 0  # some padding, as in real batches
    with torch.no_grad():
        lp = torch.log_softmax(full[:, :T].float() / TEMPERATURE, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    old = lp + 0.05 * torch.randn(B, T, device=device, generator=g)
    ref_logps = lp + 0.05 * torch.randn(B, T, device=device, generator=g)
    adv = torch.randn(B, device=device, generator=g)
    return dict(
        full_logits=full, completion_ids=ids, completion_mask=mask, advantages=adv, old_logps=old, ref_logps=ref_logps
    )


def logits_bytes(inputs: dict) -> int:
    full = inputs["full_logits"]
    B, T1, V = full.shape
    return B * (T1 - 1) * V * full.element_size()


def _ours(one_pass: bool, level: str = "token", **options):
    def run(inputs, logits):
        return grpo_loss(
            logits,
            inputs["completion_ids"],
            inputs["completion_mask"],
            inputs["advantages"],
            inputs["old_logps"],
            inputs["ref_logps"],
            beta=BETA,
            temperature=TEMPERATURE,
            importance_sampling_level=level,
            one_pass=one_pass,
            check_ids=False,
            drop_last_position=True,
            **options,
        ).loss

    return run


def _ours_split_row(chunks: int):
    """Ours one-pass on the split-row kernel (each row over ``chunks`` programs: kernels/split_row.py)."""
    from grpo_kernels.kernels import split_row_launch

    plain = _ours(True)

    def run(inputs, logits):
        with split_row_launch.split_row_schedule(chunks):
            return plain(inputs, logits)

    return run


def packed_batch(inputs: dict) -> dict:
    """The same batch packed (padding-free): only the active tokens' logits, gathered once and kept in
    ``inputs`` (the first call is a warm-up call, outside the timing), the rows' lengths from the mask."""
    packed = inputs.get("_packed")
    if packed is None:
        mask = inputs["completion_mask"] != 0
        lengths = mask.sum(-1)
        cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=mask.device)
        cu[1:] = lengths.cumsum(0)
        packed = inputs["_packed"] = dict(
            logits=inputs["full_logits"][:, :-1][mask].contiguous(),
            ids=inputs["completion_ids"][mask],
            old=inputs["old_logps"][mask],
            ref=inputs["ref_logps"][mask],
            cu=cu,
        )
    return packed


def _ours_packed(one_pass: bool = True):
    """Ours on the packed batch (``path_input`` gives it the packed logits [total, V]): the padding's
    share of S saved."""

    def run(inputs, logits):
        packed = packed_batch(inputs)
        return grpo_loss(
            logits,
            packed["ids"],
            torch.ones_like(packed["old"]),
            inputs["advantages"],
            packed["old"],
            packed["ref"],
            beta=BETA,
            temperature=TEMPERATURE,
            one_pass=one_pass,
            check_ids=False,
            cu_seqlens=packed["cu"],
        ).loss

    return run


# What the entropy family costs against the plain loss (ours only: no peer fuses them); largest shape
ENTROPY_FAMILY = {
    "ours one-pass + entropy bonus": dict(entropy_coef=0.01),
    "ours one-pass + both masks": dict(top_entropy_quantile=0.2, off_policy_mask_threshold=0.5),
}


def _eager(level: str = "token"):
    def run(inputs, logits):
        return grpo_loss_eager(
            logits,
            inputs["completion_ids"],
            inputs["completion_mask"],
            inputs["advantages"],
            inputs["old_logps"],
            inputs["ref_logps"],
            beta=BETA,
            temperature=TEMPERATURE,
            importance_sampling_level=level,
        ).loss

    return run


def _compiled(level: str = "token"):
    """torch.compile of the eager loss. Each shape, level and grad mode is its own graph: past
    dynamo's recompile limit (8) it would silently run eager instead, so the limit is raised and
    hitting it is an error, which fails that case rather than mislabel an eager time."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
        dynamo_config.fail_on_recompile_limit_hit = True
    return torch.compile(_eager(level), dynamic=False)


def _trl(level: str = "token"):
    """TRL's own path: selective_log_softmax and entropy_from_logits, then TRL's loss math."""
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    opts = GRPOOptions(beta=BETA, temperature=TEMPERATURE, importance_sampling_level=level)

    def run(inputs, logits):
        scaled = logits / TEMPERATURE
        lp = selective_log_softmax(scaled, inputs["completion_ids"])
        with torch.no_grad():
            entropy_from_logits(scaled)
        mask = inputs["completion_mask"]
        terms = objective.per_token_terms(
            lp, mask, inputs["advantages"].unsqueeze(1), inputs["old_logps"], inputs["ref_logps"], None, opts
        )
        return objective.reduce_loss(terms.per_token_loss, mask, opts)

    return run


def _liger(level: str = "token"):
    """Liger-Kernel's triton_grpo_loss on the [B, T + 1, V] logits. Its default (inplace=True) writes
    the gradient into the logits, which every path here shares, so it runs with inplace=False (one
    [B, T + 1, V] gradient buffer, as ours allocates)."""
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    def run(inputs, logits):
        return triton_grpo_loss(
            logits,
            inputs["old_logps"],
            inputs["ref_logps"],
            inputs["completion_ids"],
            inputs["advantages"],
            inputs["completion_mask"],
            temperature=TEMPERATURE,
            beta=BETA,
            eps_low=0.2,
            eps_high=0.2,
            inplace=False,
            loss_type="grpo",
            importance_sampling_level=level,
            reduce=True,
        )[0]

    return run


def load_trl_kernel():
    """TRL 1.16's fused Triton log-prob + entropy kernel (``trl/kernels/logprob_entropy.py``), loaded by file.

    That file imports only torch and triton, while ``import trl`` needs datasets, pandas and
    pyarrow: on the GPU machine the trl wheel is unpacked (``--no-deps``) and the kernel's file
    is loaded on its own, without running trl's ``__init__``.
    """
    import importlib.util
    import pathlib

    spec = importlib.util.find_spec("trl")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("trl is not installed")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "kernels" / "logprob_entropy.py"
    module_spec = importlib.util.spec_from_file_location("trl_logprob_entropy", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.selective_log_softmax_and_entropy


def _trl_kernel(level: str = "token"):
    """Stock TRL on a GPU: its Triton log-prob + entropy kernel, then TRL's loss math in torch."""
    fused = load_trl_kernel()
    opts = GRPOOptions(beta=BETA, temperature=TEMPERATURE, importance_sampling_level=level)

    def run(inputs, logits):
        mask = inputs["completion_mask"]
        lp, _ = fused(logits, inputs["completion_ids"], temperature=TEMPERATURE, row_mask=mask.bool())
        terms = objective.per_token_terms(
            lp, mask, inputs["advantages"].unsqueeze(1), inputs["old_logps"], inputs["ref_logps"], None, opts
        )
        return objective.reduce_loss(terms.per_token_loss, mask, opts)

    return run


def available_paths(level: str = "token") -> dict[str, Callable]:
    """Name -> fn(inputs, logits) returning the scalar loss (the logits as ``path_input`` gives them).
    Peers only where installed / runnable."""
    paths = {}
    if ON_GPU:  # ours and the Triton peers first: a run stopped by its time limit keeps them
        paths["ours two-pass"] = _ours(False, level)
        if level == "token":
            paths["ours one-pass"] = _ours(True, level)
            paths["ours one-pass split-row K=8"] = _ours_split_row(8)
            for name, options in ENTROPY_FAMILY.items():
                paths[name] = _ours(True, level, **options)
            paths["ours one-pass packed"] = _ours_packed()
        try:
            import liger_kernel  # noqa: F401

            paths["liger"] = _liger(level)
        except ImportError:
            pass
        try:
            paths["trl (triton kernel)"] = _trl_kernel(level)
        except (ImportError, OSError):
            pass
    else:
        paths["ours (torch path)"] = _ours(True, level)
    paths["eager"] = _eager(level)
    try:
        import trl  # noqa: F401  (the full package: on CPU here, not on the GPU machine)

        paths["trl"] = _trl(level)
    except ImportError:
        pass
    if not SMOKE:
        paths["torch.compile"] = _compiled(level)  # last: its compile time is the first thing a limit cuts
    return paths


def logprob_paths() -> dict[str, Callable]:
    """The log-prob pass of a GRPO step (the old and reference log-probs: no gradient, no mask, no entropy but
    where a path always computes it) of each path, fn(inputs) -> fp32 [B, T], from the model's [B, T + 1, V]
    logits: ours (``token_logprobs``), Liger's ``fused_selective_log_softmax`` (what its GRPO trainer runs for
    them), TRL's Triton kernel (which computes the entropy as well: TRL has no log-prob-only kernel) and TRL's
    eager ``selective_log_softmax``. Byte model: S (each logit read once)."""
    paths = {
        "ours": lambda x: token_logprobs(
            x["full_logits"], x["completion_ids"], TEMPERATURE, drop_last_position=True, check_ids=False
        )
    }
    if ON_GPU:
        try:
            from liger_kernel.ops.grpo_loss import fused_selective_log_softmax

            paths["liger"] = lambda x: fused_selective_log_softmax(x["full_logits"], x["completion_ids"], TEMPERATURE)
        except ImportError:
            pass
        try:
            fused = load_trl_kernel()
            paths["trl (triton kernel, + entropy)"] = lambda x: fused(
                x["full_logits"][:, :-1], x["completion_ids"], temperature=TEMPERATURE
            )[0]
        except (ImportError, OSError):
            pass
    paths["eager"] = lambda x: (
        torch.log_softmax(x["full_logits"][:, :-1].float() / TEMPERATURE, -1)
        .gather(-1, x["completion_ids"].unsqueeze(-1))
        .squeeze(-1)
    )
    return paths


def path_input(name: str, full: torch.Tensor, inputs: dict, requires_grad: bool):
    """(the leaf a gradient is taken of, what the path is given).

    Ours (``drop_last_position=True``) and Liger take the model's [B, T + 1, V] logits whole and write
    the gradient at that shape; the others the aligned view [B, T, V], whose gradient autograd copies
    into a zero-filled [B, T + 1, V] tensor (that copy is part of their time, as in a trainer); the
    packed path its packed logits [total, V]."""
    if name.endswith("packed"):
        leaf = packed_batch(inputs)["logits"]
        leaf = leaf.detach().requires_grad_() if requires_grad else leaf
        return leaf, leaf
    leaf = full.detach().requires_grad_() if requires_grad else full
    return leaf, leaf if name == "liger" or name.startswith("ours") else leaf[:, :-1]


def model_bytes(name: str, S: int, backward: bool) -> int:
    """Bytes each design moves, by the byte model (eager: at least 10 S with the backward)."""
    if not backward:
        return S if not name.startswith("eager") else 4 * S
    if name == "ours one-pass + both masks":  # the masks' first pass reads S
        return 3 * S
    if name.startswith("ours one-pass"):
        return 2 * S
    if name.startswith("ours") or name in ("liger", "trl (triton kernel)"):
        return 3 * S
    return 10 * S


KEPT_K = 50  # a top-k sampler's kept set: K ids a token
TEACHER_K = 64  # the teacher's top-k of on-policy distillation (verl's default)


def kept_set(inputs: dict, K: int = KEPT_K) -> KeptSet:
    """The sampler's kept set as vLLM returns it (CSR: int32 ids ascending within a token, int64 offsets), K distinct
    ids a token with the sampled one among them."""
    ids = inputs["completion_ids"].reshape(-1)
    V = inputs["full_logits"].shape[-1]
    g = torch.Generator(device=ids.device).manual_seed(1)
    others = (ids.unsqueeze(1) + torch.randint(1, V, (ids.numel(), K - 1), device=ids.device, generator=g)) % V
    kept = torch.cat([ids.unsqueeze(1), others], 1).sort(1).values
    distinct = torch.cat([torch.ones_like(kept[:, :1], dtype=torch.bool), kept[:, 1:] != kept[:, :-1]], 1)
    offsets = torch.nn.functional.pad(distinct.sum(1).cumsum(0), (1, 0))
    return KeptSet.from_vllm(kept[distinct].to(torch.int32), offsets)


def teacher_topk(inputs: dict, K: int = TEACHER_K) -> tuple[torch.Tensor, torch.Tensor]:
    """A teacher's top-K ids [B, T, K] and their log-probs (fp32): the top-K of other logits of the same shape."""
    full = inputs["full_logits"]
    g = torch.Generator(device=full.device).manual_seed(2)
    teacher = torch.randn(full.shape[0], full.shape[1] - 1, full.shape[2], device=full.device, generator=g)
    top = torch.log_softmax(teacher / TEMPERATURE, -1).topk(K, -1)
    return top.indices, top.values


def sampling_and_distillation_paths() -> dict[str, Callable]:
    """The passes the sampler's kept set and distillation add, fn(inputs, logits) -> loss from the model's [B, T + 1, V]
    logits, forward + backward: the GRPO loss without and with the kept set (renormalized over it), our top-k
    forward KL, and the eager one (``log_softmax`` over the vocabulary, the K ids gathered: verl's default path)."""
    set_and_teacher = {}

    def extras(inputs):
        key = id(inputs)
        if key not in set_and_teacher:
            set_and_teacher.clear()
            set_and_teacher[key] = (kept_set(inputs), *teacher_topk(inputs))
        return set_and_teacher[key]

    def distillation(inputs, logits):
        _, ids, logps = extras(inputs)
        mask = inputs["completion_mask"]
        return topk_distillation_loss(logits, ids, logps, mask, TEMPERATURE, drop_last_position=True).loss

    def eager_distillation(inputs, logits):
        _, ids, logps = extras(inputs)
        student = torch.log_softmax(logits[:, :-1].float() / TEMPERATURE, -1).gather(-1, ids)
        per_token = (logps.exp() * (logps - student)).sum(-1)
        mask = inputs["completion_mask"]
        return (per_token * mask).sum() / mask.sum()

    return {
        "ours, no kept set": _ours(one_pass=True),
        f"ours, kept set (top-k {KEPT_K})": lambda x, logits: _ours(one_pass=True, kept_set=extras(x)[0])(x, logits),
        f"ours, top-k distillation (K = {TEACHER_K})": distillation,
        f"eager, top-k distillation (K = {TEACHER_K})": eager_distillation,
    }


def sampling_and_distillation_bytes(name: str, S: int, inputs: dict) -> int:
    """Forward + backward bytes by the byte model: the one-pass loss 2 S, the kept set's ids and offsets on top; the
    top-k forward KL two passes, 3 S (its divergence is computed in torch over [N, K], so its backward is a pass of
    its own); eager at least 10 S."""
    N = inputs["completion_ids"].numel()
    if name.startswith("ours, no kept set"):
        return 2 * S
    if name.startswith("ours, kept set"):
        return 2 * S + N * KEPT_K * 4 + (N + 1) * 8
    if name.startswith("ours, top-k distillation"):
        return 3 * S
    return 10 * S
