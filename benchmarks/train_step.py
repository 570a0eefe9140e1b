"""One whole GRPO optimizer step of a causal LM with the loss swapped and everything else held fixed.

    python benchmarks/train_step.py --out FILE [--budget SECONDS] [--smoke]

A step is what a GRPO update of a model costs: the policy's forward over prompt + completion (gradient
checkpointing on), the loss, the backward, and an AdamW step. The models are built from transformers
configs with random weights (nothing is downloaded): the shapes of Qwen2.5-0.5B and Qwen2.5-1.5B
(vocabulary 151,936) and Llama-3.2-1B (128,256), in bf16. The paths differ only in the loss:

- ``eager``: the logits materialized ([B, T + 1, V], the model's own output) and the loss computed the way an
  eager trainer does (``eager_baseline.grpo_loss_eager``: the fp32 log-softmax over [B, T, V], then the math);
- ``liger``: Liger-Kernel's ``triton_grpo_loss`` on the same logits (where liger-kernel is installed);
- ``ours logits``: ``GRPOLoss(drop_last_position=True)`` on the same logits;
- ``ours hidden``: ``FusedLinearGRPOLoss`` from the last hidden states and the head's weight (no logits);
- ``stock TRL``: TRL 1.16's own fused LM head (``ChunkedLogProbFunction``, its ``GRPOTrainer``'s default) with
  TRL's GRPO loss in torch, from the same hidden states (``trl_head.py``; where TRL is installed).

Per path: the median step time after warm-up, tokens (prompt + completion) per second, the peak memory of
a step, the loss's share of the step (the loss's forward + backward timed alone, on the step's logits or
hidden states) and the longest completion that fits at the batch's size (lengths doubled, then bisected,
until an out-of-memory error; capped, so the stage fits its time). Results are written after every case,
so a stage stopped by its time limit (SIGINT) keeps what finished.

``--smoke`` (CI, no GPU): a tiny Llama config on the CPU in fp32, the same code paths, no length search.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from eager_baseline import grpo_loss_eager  # noqa: E402

from grpo_kernels import FusedLinearGRPOLoss, GRPOLoss  # noqa: E402

sys.path.insert(0, str(HERE))
import trl_head  # noqa: E402

BETA, PROMPT = 0.04, 128
MODELS = {
    "Qwen2.5-0.5B": (
        "qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
        ),
    ),
    "Qwen2.5-1.5B": (
        "qwen2",
        dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
        ),
    ),
    "Llama-3.2-1B": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
        ),
    ),
}
# (model, completions, completion length), in order of value (the table users decide on: both Qwen shapes at
# 16 x 1024 first); the length search runs on the first model
GPU_CASES = [
    ("Qwen2.5-0.5B", 16, 1024),
    ("Qwen2.5-1.5B", 16, 1024),
    ("Qwen2.5-0.5B", 8, 4096),
    ("Llama-3.2-1B", 16, 1024),
]
SMOKE_MODEL = (
    "llama",
    dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    ),
)
SMOKE_CASES = [("tiny", 2, 16), ("tiny", 2, 32)]
PATHS = ("eager", "liger", "ours logits", "ours hidden", "stock TRL")
LENGTH_CAP = 65536


def build_model(kind: str, config: dict, device, dtype):
    """A causal LM of that shape with random weights (tied embeddings, as these models have), checkpointed."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    cfg = config_cls(
        **config,
        tie_word_embeddings=True,
        max_position_embeddings=LENGTH_CAP + PROMPT,
        use_cache=False,
        attn_implementation="sdpa",
    )
    with torch.device(device):
        model = model_cls(cfg).to(dtype)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def make_batch(B: int, T: int, V: int, device, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V, (B, PROMPT + T), generator=g)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    batch = dict(
        input_ids=input_ids,
        completion_ids=input_ids[:, PROMPT:],
        completion_mask=mask,
        advantages=torch.randn(B, generator=g),
        ref_logps=-2.0 + 0.3 * torch.randn(B, T, generator=g),
    )
    return {k: v.to(device) for k, v in batch.items()}


def available_paths(device) -> list:
    """The paths in order of value, so that a stage cut by its time limit keeps the comparisons users decide on:
    our fused head against stock TRL's own head (TRL's default), then the logits paths (ours, Liger), eager last."""
    paths = ["ours hidden"] + (["stock TRL"] if trl_head.available() else []) + ["ours logits"]
    if device.type == "cuda":
        try:
            import liger_kernel.transformers.grpo_loss  # noqa: F401

            paths.append("liger")
        except ImportError:
            pass
    return paths + ["eager"]


def _logits(model, batch, T):
    """The model's [B, T + 1, V] output over the completion (logits_to_keep): position t predicts token t."""
    return model(input_ids=batch["input_ids"], logits_to_keep=T + 1).logits


def _hidden(model, batch, T):
    return model.model(input_ids=batch["input_ids"]).last_hidden_state[:, -(T + 1) : -1]


def loss_of(path: str, model, batch, T, loss_fns, x=None):
    """The scalar loss of one path, from the model (x None) or from given logits / hidden states x."""
    b = batch
    if path == "stock TRL":
        hidden = _hidden(model, b, T) if x is None else x
        return trl_head.trl_fused_grpo_loss(
            hidden,
            model.lm_head.weight,
            b["completion_ids"],
            b["completion_mask"],
            b["advantages"],
            None,
            b["ref_logps"],
            beta=BETA,
            temperature=1.0,
        )
    if path == "ours hidden":
        hidden = _hidden(model, b, T) if x is None else x
        return loss_fns["ours hidden"](
            hidden,
            model.lm_head.weight,
            b["completion_ids"],
            b["completion_mask"],
            b["advantages"],
            ref_logps=b["ref_logps"],
        ).loss
    logits = _logits(model, b, T) if x is None else x
    if path == "ours logits":
        return loss_fns["ours logits"](
            logits, b["completion_ids"], b["completion_mask"], b["advantages"], ref_logps=b["ref_logps"]
        ).loss
    if path == "liger":
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        return triton_grpo_loss(
            logits,
            None,
            b["ref_logps"],
            b["completion_ids"],
            b["advantages"],
            b["completion_mask"],
            temperature=1.0,
            beta=BETA,
            eps_low=0.2,
            eps_high=0.2,
            inplace=True,
            loss_type="grpo",
            reduce=True,
        )[0]
    return grpo_loss_eager(
        logits[:, :-1], b["completion_ids"], b["completion_mask"], b["advantages"], ref_logps=b["ref_logps"], beta=BETA
    ).loss


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step(path, model, optimizer, batch, T, loss_fns):
    loss = loss_of(path, model, batch, T, loss_fns)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def time_steps(path, model, optimizer, batch, T, loss_fns, warmup: int, repeats: int, device) -> dict:
    for _ in range(warmup):
        step(path, model, optimizer, batch, T, loss_fns)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(path, model, optimizer, batch, T, loss_fns)
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"step_s": statistics.median(times), "steps": times, "peak_bytes": peak}


def time_loss_alone(path, model, batch, T, loss_fns, repeats: int, device) -> float:
    """The loss's forward + backward on the step's logits (or hidden states), the model's part excluded."""
    with torch.no_grad():
        x = (_hidden if path in ("ours hidden", "stock TRL") else _logits)(model, batch, T)
    times = []
    for _ in range(repeats + 1):
        leaf = x.detach().clone().requires_grad_()
        _sync(device)
        start = time.perf_counter()
        loss_of(path, model, batch, T, loss_fns, x=leaf).backward()
        _sync(device)
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def fits(path, model, optimizer, B, T, V, loss_fns, device) -> bool:
    """One step at completion length T, or False on an out-of-memory error (memory released either way)."""
    try:
        step(path, model, optimizer, make_batch(B, T, V, device, seed=T), T, loss_fns)
        _sync(device)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def longest_fit(path, model, optimizer, B, T0, V, loss_fns, device, deadline: float) -> dict:
    """The longest completion length (a multiple of 256) that fits at batch B: doubled from T0, then bisected;
    ``capped`` when the cap or the deadline stopped the search before an out-of-memory error."""
    ok, bad, T = None, None, T0
    while T <= LENGTH_CAP and time.monotonic() < deadline:
        if fits(path, model, optimizer, B, T, V, loss_fns, device):
            ok, T = T, 2 * T
        else:
            bad = T
            break
    while ok is not None and bad is not None and bad - ok > 256 and time.monotonic() < deadline:
        mid = (ok + bad) // 2 // 256 * 256
        if fits(path, model, optimizer, B, mid, V, loss_fns, device):
            ok = mid
        else:
            bad = mid
    return {"longest": ok, "first_oom": bad, "capped": bad is None or bad - ok > 256}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; cases past it are left out")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    deadline = time.monotonic() + args.budget
    try:
        import transformers
    except ImportError as e:
        print(
            f"transformers is not importable ({e}): nothing to build the models from "
            "(scripts/device_wheels.sh carries it to the GPU machine)"
        )
        pathlib.Path(args.out).write_text(json.dumps({"error": "transformers not importable", "cases": []}))
        return
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": str(dtype),
        "prompt_tokens": PROMPT,
        "beta": BETA,
        "gradient_checkpointing": True,
        "cases": [],
    }
    loss_fns = {
        "ours logits": GRPOLoss(beta=BETA, drop_last_position=True),
        "ours hidden": FusedLinearGRPOLoss(beta=BETA),
    }
    searched = smoke  # the length search: GPU only, on the first model's first batch size
    for name, B, T in SMOKE_CASES if smoke else GPU_CASES:
        kind, config = SMOKE_MODEL if smoke else MODELS[name]
        if time.monotonic() > deadline:
            print(f"budget spent: {name} {B} x {T} left out")
            break
        torch.manual_seed(0)
        model = build_model(kind, config, device, dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
        batch = make_batch(B, T, config["vocab_size"], device)
        for path in available_paths(device):
            if time.monotonic() > deadline:
                break
            case = {"model": name, "completions": B, "completion_length": T, "path": path}
            try:
                case.update(
                    time_steps(
                        path,
                        model,
                        optimizer,
                        batch,
                        T,
                        loss_fns,
                        warmup=1 if smoke else 2,
                        repeats=2 if smoke else 3,
                        device=device,
                    )
                )
                case["tokens_per_s"] = B * (PROMPT + T) / case["step_s"]
                case["loss_s"] = time_loss_alone(path, model, batch, T, loss_fns, 1 if smoke else 3, device)
                case["loss_share"] = case["loss_s"] / case["step_s"]
            except torch.OutOfMemoryError:
                case["oom"] = True
                optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
            if not searched and not case.get("oom"):
                case["fit"] = longest_fit(
                    path,
                    model,
                    optimizer,
                    B,
                    T,
                    config["vocab_size"],
                    loss_fns,
                    device,
                    min(deadline, time.monotonic() + 20.0),
                )
            result["cases"].append(case)
            pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
            peak = "-" if case.get("peak_bytes") is None else f"{case['peak_bytes'] / 2**30:.2f} GiB"
            print(
                f"{name} {B} x {T} {path}: "
                + (
                    "out of memory"
                    if case.get("oom")
                    else f"{case['step_s'] * 1e3:.1f} ms, {case['tokens_per_s']:.0f} tok/s, peak {peak}, "
                    f"loss {100 * case['loss_share']:.0f} %" + (f", longest {case['fit']}" if "fit" in case else "")
                )
            )
        searched = True
        del model, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
