"""``grpo-kernels train`` and ``grpo-kernels eval``: the thin trainer on a built-in task or a local model."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import List, Optional

import torch

from .tasks import TASKS, compare, get_task
from .trainer import RECIPE, GRPOTrainer, TrainerConfig, append_jsonl, latest_checkpoint, world

DEFAULTS = TrainerConfig(**RECIPE)  # the built-in task's recipe


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="compare", choices=sorted(TASKS), help="built-in task (default: compare)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--eval-size", type=int, default=300, help="held-out prompts to score (default: 300)")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-kernels", description="GRPO training on the grpo-kernels loss")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train with GRPO (default: the built-in task from scratch)")
    _add_common(t)
    t.add_argument("--model", default=None, help="a local Hugging Face causal LM folder (default: built-in tiny model)")
    t.add_argument("--group-size", type=int, default=DEFAULTS.group_size)
    t.add_argument("--prompts-per-step", type=int, default=DEFAULTS.prompts_per_step)
    t.add_argument("--steps", type=int, default=DEFAULTS.steps)
    t.add_argument("--lr", type=float, default=DEFAULTS.learning_rate)
    t.add_argument("--beta", type=float, default=DEFAULTS.beta,
                   help=f"KL coefficient (a frozen reference copy when > 0; default: {DEFAULTS.beta})")
    t.add_argument("--epsilon", type=float, default=DEFAULTS.epsilon)
    t.add_argument("--epsilon-high", type=float, default=DEFAULTS.epsilon_high, help="clip-higher (DAPO)")
    t.add_argument("--loss-type", default=DEFAULTS.loss_type)
    t.add_argument("--num-iterations", type=int, default=DEFAULTS.num_iterations, help="mu: updates per batch")
    t.add_argument("--process-rollouts", type=int, default=0,
                   help="process supervision: label every token-step with N completions sampled from its prefix, "
                        "once a distinct prefix (0: outcome)")
    t.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=DEFAULTS.dynamic_sampling,
                   help="DAPO's dynamic sampling: drop groups whose rewards are all equal, sample more prompts "
                        "(default: on)")
    t.add_argument("--max-sampling-rounds", type=int, default=DEFAULTS.max_sampling_rounds,
                   help="with --dynamic-sampling: at most this many batches of prompts a step")
    t.add_argument("--temperature", type=float, default=DEFAULTS.temperature)
    t.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    t.add_argument("--fused-lm-head", action="store_true",
                   help="loss from hidden states and the lm_head weight: no [B, T, V] logits in the update")
    t.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus coefficient (TRL's entropy_coef)")
    t.add_argument("--adaptive-entropy", action="store_true",
                   help="TRL's adaptive controller: move --entropy-coef toward --entropy-target each step")
    t.add_argument("--entropy-target", type=float, default=DEFAULTS.entropy_target)
    t.add_argument("--warmup-steps", type=int, default=compare.WARMUP_STEPS,
                   help=f"format-only supervised warm-up steps of 32 examples (built-in model; default: "
                        f"{compare.WARMUP_STEPS}); it ends earlier once the sampled answers are well-formed")
    t.add_argument("--warmup-large-batch-steps", type=int, default=None,
                   help=f"if --warmup-steps ends below the format target: a second stage of up to this many steps "
                        f"of {compare.WARMUP_LARGE_BATCH_SIZE} examples (default: a third of --warmup-steps; 0: none)")
    t.add_argument("--eval-every", type=int, default=DEFAULTS.eval_every)
    t.add_argument("--save-every", type=int, default=50)
    t.add_argument("--output-dir", default="runs/grpo")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
    t.add_argument("--no-progress", action="store_true", help="no progress bars (warm-up, GRPO steps, evaluation)")
    s = sub.add_parser("seeds", help="one training command over several seeds: the spread of its results",
                       description="Run `grpo-kernels train` once per seed and print the min / median / max "
                                   "held-out accuracy, the largest drop from a run's best evaluation, the "
                                   "zero-std share and the time. Training options go after `--`.")
    s.add_argument("--seeds", type=int, default=5, help="how many seeds (default: 5)")
    s.add_argument("--first-seed", type=int, default=0, help="seeds first-seed, first-seed + 1, ... (default: 0)")
    s.add_argument("--jobs", type=int, default=1, help="runs at a time, sharing the cores (default: 1)")
    s.add_argument("--output-dir", default="runs/seeds", help="seed-N/ per run and seeds.json (default: runs/seeds)")
    s.add_argument("--script", default=None,
                   help="a Python script to run instead of `grpo-kernels train` (e.g. examples/reward_model_grpo.py); "
                        "it takes --seed and --output-dir and writes metrics.jsonl there")
    s.add_argument("train_args", nargs=argparse.REMAINDER, help="options for `grpo-kernels train`, after --")
    e = sub.add_parser("eval", help="held-out accuracy of a checkpoint")
    e.add_argument("checkpoint")
    _add_common(e)
    e.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    return parser


def _device(name: str) -> str:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    rank_device = os.environ.get("LOCAL_RANK")
    if name == "cuda" and rank_device is not None:
        name = f"cuda:{rank_device}"
    return name


def _load_pretrained(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(f"--model / checkpoint path {path!r} is not a folder with a saved model")
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _maybe_init_distributed(device: str) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        if device.startswith("cuda"):
            torch.cuda.set_device(device)


def plot_curves(records: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "reward" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["reward"] for r in train], label="train reward", alpha=0.6)
    ax.plot([r["step"] for r in train], [r["accuracy"] for r in train], label="train accuracy (sampled)", alpha=0.6)
    ax.plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "o-", label="held-out accuracy (greedy)")
    # what the errors are: malformed answers (not one of the prompt's numbers), sampled and held-out
    if any("malformed" in r for r in train):
        ax.plot([r["step"] for r in train if "malformed" in r], [r["malformed"] for r in train if "malformed" in r],
                ":", label="malformed share (sampled)", alpha=0.7)
    if any("eval_malformed" in r for r in evals):
        ax.plot([r["step"] for r in evals if "eval_malformed" in r],
                [r["eval_malformed"] for r in evals if "eval_malformed" in r], "s--",
                label="malformed share (held-out)", alpha=0.7)
    ax.set_xlabel("GRPO step")
    ax.set_ylim(-0.02, 1.25)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def train(args) -> dict:
    device = _device(args.device)
    _maybe_init_distributed(device)
    rank, _ = world()
    task = get_task(args.task)
    torch.manual_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    resume_from = latest_checkpoint(args.output_dir) if args.resume else None
    if args.resume and resume_from is None:
        raise FileNotFoundError(f"--resume: no checkpoint-N folder in {args.output_dir!r}")
    started = time.time()
    warmup_record = None
    if resume_from is not None:
        model, tokenizer = _load_pretrained(resume_from)
    elif args.model is not None:
        model, tokenizer = _load_pretrained(args.model)
    else:
        tokenizer = task.build_tokenizer()
        model = task.build_model(tokenizer, seed=args.seed).to(device)
        warmup_record = task.warmup(model, tokenizer, steps=args.warmup_steps, seed=args.seed, device=device,
                                    progress=world()[0] == 0 and not args.no_progress, temperature=args.temperature,
                                    max_new_tokens=args.max_new_tokens,
                                    large_batch_steps=args.warmup_large_batch_steps)
    config = TrainerConfig(
        group_size=args.group_size, prompts_per_step=args.prompts_per_step, steps=args.steps,
        learning_rate=args.lr, beta=args.beta, epsilon=args.epsilon, epsilon_high=args.epsilon_high,
        loss_type=args.loss_type, num_iterations=args.num_iterations, process_rollouts=args.process_rollouts,
        fused_lm_head=args.fused_lm_head, entropy_coef=args.entropy_coef, adaptive_entropy=args.adaptive_entropy,
        entropy_target=args.entropy_target, dynamic_sampling=args.dynamic_sampling,
        max_sampling_rounds=args.max_sampling_rounds, temperature=args.temperature,
        max_new_tokens=args.max_new_tokens, seed=args.seed, eval_every=args.eval_every,
        save_every=args.save_every, output_dir=args.output_dir,
    )
    reward_funcs, weights = task.reward_functions()
    records: List[dict] = []
    if resume_from is None and rank == 0 and os.path.exists(metrics_path):
        os.remove(metrics_path)

    def log(record: dict) -> None:
        records.append(record)
        if rank == 0:
            append_jsonl(metrics_path, record)

    if warmup_record is not None:  # the format warm-up: its steps, the well-formed share it ended at, its time
        log({"step": 0, **warmup_record})

    trainer = GRPOTrainer(model, tokenizer, reward_funcs, task.make_rows(20000, held_out=False, seed=args.seed),
                          config, reward_weights=weights, eval_rows=task.make_rows(args.eval_size, held_out=True,
                                                                                    seed=1234),
                          device=device, log=log, format_reward=task.format_reward())
    if resume_from is not None:
        trainer.load_state(resume_from)
        records.extend(restart_log(metrics_path, trainer.step, config.steps, write=rank == 0))
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.steps, initial=trainer.step, desc="GRPO", unit="step", file=sys.stderr)

    def on_step(record: dict) -> None:
        if bar is not None:
            bar.update(1)
            bar.set_postfix(reward=f"{record['reward']:.2f}", acc=f"{record['accuracy']:.2f}",
                            kl=f"{record['kl']:.3f}")

    try:
        trainer.train(on_step=on_step, progress=not args.no_progress)
    finally:
        if bar is not None:
            bar.close()
    checkpoint = trainer.save_checkpoint()
    evals = [r for r in records if "eval_accuracy" in r]
    summary = {"first_eval_accuracy": evals[0]["eval_accuracy"] if evals else None,
               "final_eval_accuracy": evals[-1]["eval_accuracy"] if evals else None,
               "steps": trainer.step, "seconds": round(time.time() - started, 1), "checkpoint": checkpoint}
    if rank == 0:
        plot_curves(records, os.path.join(args.output_dir, "curves.png"))
        print(json.dumps(summary))
    return summary


def restart_log(metrics_path: str, step: int, steps: int, write: bool = True) -> List[dict]:
    """The log of a run resumed at ``step``, as the uninterrupted run wrote it up to its checkpoint: the rows of
    steps after it (written by the killed run before it died) move to ``metrics.dropped.jsonl``, and so does a final
    evaluation at ``step`` = ``steps`` (written after the checkpoint; the resumed run evaluates again). The rows
    kept, which ``metrics.jsonl`` is rewritten to (atomically, with ``write``)."""
    if not os.path.exists(metrics_path):
        return []
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    keep = [r.get("step", 0) <= step for r in rows]
    if step >= steps and rows and rows[-1].get("step") == step and "eval_accuracy" in rows[-1]:
        keep[-1] = False  # the last evaluation of a finished run follows its checkpoint
    kept = [r for r, k in zip(rows, keep) if k]
    if write and not all(keep):
        side = os.path.join(os.path.dirname(metrics_path), "metrics.dropped.jsonl")
        for record in (r for r, k in zip(rows, keep) if not k):
            append_jsonl(side, record)
        tmp = metrics_path + ".tmp"
        open(tmp, "w").close()
        for record in kept:
            append_jsonl(tmp, record)
        os.replace(tmp, metrics_path)
    return kept


def evaluate(args) -> dict:
    device = _device(args.device)
    model, tokenizer = _load_pretrained(args.checkpoint)
    task = get_task(args.task)
    config = TrainerConfig(max_new_tokens=args.max_new_tokens, output_dir=args.checkpoint)
    reward_funcs, _ = task.reward_functions()
    trainer = GRPOTrainer(model, tokenizer, reward_funcs, [], config,
                          eval_rows=task.make_rows(args.eval_size, held_out=True, seed=1234), device=device)
    result = {"checkpoint": args.checkpoint, "task": args.task, "eval_size": args.eval_size,
              "eval_accuracy": trainer.evaluate(progress=True)}
    print(json.dumps(result))
    return result


def seeds(args) -> dict:
    from .seeds import format_summary, run_seeds

    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    result = run_seeds(range(args.first_seed, args.first_seed + args.seeds), args.output_dir, train_args,
                       jobs=args.jobs, script=args.script)
    print(format_summary(result))
    return result


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        {"train": train, "eval": evaluate, "seeds": seeds}[args.command](args)
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
