"""``grpo-kernels train`` and ``grpo-kernels eval``: the thin trainer on a built-in task or a local model."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch

from .. import collectives
from ..options import AGGREGATIONS, LOSS_TYPES, GRPOOptions
from . import progress_bar, require_train_extra
from .checkpoint import CheckpointWriteError, latest_checkpoint, latest_intact_checkpoint
from .config import NONFINITE_REWARDS, RECIPE, TrainerConfig
from .data import load_reward_function, read_rows, trainer_rows
from .plots import plot_curves
from .tasks import TASKS, compare, get_task
from .trainer import GRPOTrainer, Preempted, trainer_loss_options

DEFAULTS = TrainerConfig(**RECIPE)  # the built-in task's recipe

# (short names: the epilog's source lines fit)
_CAP, _LARGE_BATCH, _STEPS = compare.WARMUP_STEPS, compare.WARMUP_LARGE_BATCH_SIZE, DEFAULTS.steps
TRAIN_EPILOG = f"""What runs, in order (the output folder's train.log says each phase as it starts):
  1. with the built-in model (no --model): its format warm-up, supervised (the answer's format only), up to
     --warmup-steps steps of 32 examples, ending early once {compare.WARMUP_FORMAT_TARGET:.0%} of sampled answers
     are well-formed; if its cap comes first, up to --warmup-large-batch-steps more of {_LARGE_BATCH}.
     The recipe's caps are {_CAP} and {_CAP // 3} (1-4 minutes on 2 cores); a run shorter than the recipe's
     {_STEPS} steps scales the first cap with --steps ({_CAP // _STEPS} a step) and skips the second, and says
     so, with the share it reached: expect less accuracy than the recipe's.
  2. --steps GRPO steps; a held-out evaluation before the first, every --eval-every steps and after the last.
  3. a checkpoint (checkpoint-N/), metrics.jsonl and curves.png.
stdout holds one line, the JSON summary; progress, warnings and everything else go to stderr.
On a machine shared with other busy processes: --threads 1 (OpenMP threads already wait passively)."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help (where its text does not say it already; not for a plain flag), and the
    epilog as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return text
        return super()._get_help_string(action)


def _bounded(kind, rule: str, holds):
    """An argparse ``type`` that parses with ``kind`` and refuses a value for which ``holds`` is false, naming the
    rule: argparse then says which flag, before any work (``argument --top-p: must be in (0, 1], got 1.5``)."""

    def parse(text: str):
        value = kind(text)
        if not holds(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__name__ = kind.__name__  # (argparse's "invalid int value" names the type by it)
    return parse


AT_LEAST_0 = _bounded(int, ">= 0", lambda v: v >= 0)
AT_LEAST_1 = _bounded(int, ">= 1", lambda v: v >= 1)
POSITIVE = _bounded(float, "> 0", lambda v: v > 0)
NON_NEGATIVE = _bounded(float, ">= 0", lambda v: v >= 0)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="compare", choices=sorted(TASKS), help="built-in task")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--eval-size", type=int, default=300, help="held-out prompts to score")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed, help="seeds the model, the data and the sampling")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads of this process (default: torch's, every core it may use)",
    )


def _add_train_arguments(t: argparse.ArgumentParser) -> None:
    """The options of ``train`` (and ``distill``, which takes them all)."""
    _add_common(t)
    t.add_argument(
        "--model",
        default=None,
        help="a local Hugging Face causal LM folder (default: the built-in tiny model, warm-up first)",
    )
    t.add_argument(
        "--data",
        default=None,
        metavar="JSONL",
        help='your prompts instead of the built-in task: one JSON object a line with a "prompt" (text, or chat '
        "messages rendered by the tokenizer's chat template) and any columns the reward functions read; needs "
        "--model and --reward",
    )
    t.add_argument(
        "--eval-data",
        default=None,
        metavar="JSONL",
        help="held-out rows of --data's form, evaluated "
        "greedily by the first --reward (default with --data: no evaluation)",
    )
    t.add_argument(
        "--reward",
        action="append",
        default=None,
        metavar="MODULE:FUNCTION",
        help="a reward function with TRL's signature, f(prompts, completions, **columns) -> scores (a module in the "
        "working directory or on the path, or path/to/file.py:function); repeat for several",
    )
    t.add_argument("--reward-weights", type=float, nargs="+", default=None, help="one weight per --reward")
    t.add_argument(
        "--group-size",
        type=_bounded(int, ">= 2 (advantages compare the completions of a prompt)", lambda v: v >= 2),
        default=DEFAULTS.group_size,
        help="completions sampled per prompt (G)",
    )
    t.add_argument("--prompts-per-step", type=AT_LEAST_1, default=DEFAULTS.prompts_per_step, help="prompts a GRPO step")
    t.add_argument(
        "--steps",
        type=AT_LEAST_0,
        default=DEFAULTS.steps,
        help="GRPO steps (the built-in model's warm-up runs before step 1: see below)",
    )
    t.add_argument("--lr", type=POSITIVE, default=DEFAULTS.learning_rate, help="GRPO learning rate")
    t.add_argument(
        "--beta", type=NON_NEGATIVE, default=DEFAULTS.beta, help="KL coefficient (a frozen reference copy when > 0)"
    )
    t.add_argument(
        "--epsilon",
        type=_bounded(float, "in [0, 1] (the lower clip bound is 1 - epsilon)", lambda v: 0 <= v <= 1),
        default=DEFAULTS.epsilon,
        help="the ratio's clip range, below 1",
    )
    t.add_argument(
        "--epsilon-high",
        type=NON_NEGATIVE,
        default=DEFAULTS.epsilon_high,
        help="the clip range above 1 (clip-higher, DAPO)",
    )
    t.add_argument(
        "--loss-type", default=DEFAULTS.loss_type, choices=LOSS_TYPES, metavar="LOSS_TYPE", help="a GRPOLoss loss_type"
    )
    t.add_argument(
        "--aggregation",
        default=DEFAULTS.aggregation,
        choices=AGGREGATIONS,
        help="loss_type: the loss type's own reduction; prompt_mean: each prompt's token mean, then their mean",
    )
    t.add_argument("--num-iterations", type=AT_LEAST_1, default=DEFAULTS.num_iterations, help="mu: updates per batch")
    t.add_argument(
        "--process-rollouts",
        type=AT_LEAST_0,
        default=0,
        help="process supervision: label every token-step with N completions sampled from its prefix, "
        "once a distinct prefix (0: outcome)",
    )
    t.add_argument(
        "--dynamic-sampling",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS.dynamic_sampling,
        help="DAPO's dynamic sampling: drop groups whose rewards are all equal, sample more prompts",
    )
    t.add_argument(
        "--max-sampling-rounds",
        type=AT_LEAST_1,
        default=DEFAULTS.max_sampling_rounds,
        help="with --dynamic-sampling: at most this many batches of prompts a step",
    )
    t.add_argument(
        "--temperature",
        type=_bounded(float, "> 0 (GRPO samples: a temperature of 0 would be greedy decoding)", lambda v: v > 0),
        default=DEFAULTS.temperature,
        help="sampling temperature",
    )
    t.add_argument("--top-k", type=AT_LEAST_0, default=DEFAULTS.top_k, help="sample from the top k ids (0: all)")
    t.add_argument(
        "--top-p",
        type=_bounded(float, "in (0, 1]", lambda v: 0 < v <= 1),
        default=DEFAULTS.top_p,
        help="sample from the top-p nucleus (1: all)",
    )
    t.add_argument(
        "--kept-set-replay",
        dest="replay_kept_sets",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS.replay_kept_sets,
        help="with --top-k / --top-p, train on log-probs over the ids the sampler kept (--no-kept-set-replay: over "
        "the whole vocabulary)",
    )
    t.add_argument(
        "--max-new-tokens", type=AT_LEAST_1, default=DEFAULTS.max_new_tokens, help="a completion's length cap"
    )
    t.add_argument(
        "--fused-lm-head",
        action="store_true",
        help="loss from hidden states and the lm_head weight: no [B, T, V] logits in the update",
    )
    t.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus coefficient (TRL's entropy_coef)")
    t.add_argument(
        "--adaptive-entropy",
        action="store_true",
        help="TRL's adaptive controller: move --entropy-coef toward --entropy-target each step",
    )
    t.add_argument(
        "--entropy-target", type=float, default=DEFAULTS.entropy_target, help="--adaptive-entropy's target entropy"
    )
    t.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help=f"the built-in model's format warm-up: at most this many supervised steps of 32 examples, "
        f"ending earlier once the sampled answers are well-formed (default: {compare.WARMUP_STEPS}, "
        f"or {compare.WARMUP_STEPS // DEFAULTS.steps} x --steps below {DEFAULTS.steps} steps)",
    )
    t.add_argument(
        "--warmup-large-batch-steps",
        type=int,
        default=None,
        help=f"if --warmup-steps ends below the format target: a second stage of up to this many steps "
        f"of {compare.WARMUP_LARGE_BATCH_SIZE} examples (default: a third of --warmup-steps; "
        f"none below {DEFAULTS.steps} --steps; 0: none)",
    )
    t.add_argument(
        "--eval-every",
        type=AT_LEAST_0,
        default=DEFAULTS.eval_every,
        help="GRPO steps between evaluations (0: only at the start and the end)",
    )
    t.add_argument(
        "--save-every",
        type=int,
        default=50,
        help="GRPO steps between checkpoints (0: the last only); SIGTERM or Ctrl-C also writes one, at the step "
        "reached, and exits with 128 + the signal",
    )
    t.add_argument("--output-dir", default="runs/grpo", help="train.log, metrics.jsonl, curves.png, checkpoint-N/")
    t.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest intact checkpoint in --output-dir (each checked against its manifest; a "
        "damaged one is named and skipped)",
    )
    t.add_argument(
        "--nonfinite-rewards",
        choices=NONFINITE_REWARDS,
        default="refuse",
        help="a reward of +-inf: refuse (stop, naming the reward function and the completion) or drop_group "
        "(warn; the group gets no advantage). NaN / None is a reward function's 'not applicable'",
    )
    t.add_argument(
        "--max-nonfinite-steps",
        type=int,
        default=3,
        help="a non-finite loss or gradient norm skips the optimizer step; this many in a row stop the run",
    )
    t.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (warm-up, GRPO steps, evaluation, checkpoint writes)",
    )
    t.add_argument(
        "--teacher",
        default=None,
        metavar="CHECKPOINT",
        help="on-policy distillation: a saved model folder (e.g. runs/grpo/checkpoint-200) scoring the student's own "
        "samples (distill: required)",
    )
    t.add_argument(
        "--distillation",
        default="none",
        choices=("none", "topk", "reverse_kl"),
        help="with --teacher: the teacher's top-k forward KL (verl's forward_kl_topk) or the k3 estimate of the "
        "reverse KL at the sampled tokens (distill: topk)",
    )
    t.add_argument("--distillation-topk", type=AT_LEAST_1, default=16, help="the teacher's K for --distillation topk")
    t.add_argument(
        "--with-task-reward",
        action="store_true",
        help="distillation plus the GRPO loss of the task's rewards (--distillation-coef x the distillation)",
    )
    t.add_argument("--distillation-coef", type=float, default=1.0, help="the distillation's weight with the reward")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-kernels", description="GRPO training on the grpo-kernels loss")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train",
        help="train with GRPO (default: the built-in task from scratch)",
        description="Train with GRPO on the grpo-kernels loss (default: the built-in task, "
        '"which number is bigger?", from a tiny model built from scratch).',
        epilog=TRAIN_EPILOG,
        formatter_class=_Formatter,
    )
    _add_train_arguments(t)
    d = sub.add_parser(
        "distill",
        help="on-policy distillation: a teacher checkpoint scores a fresh student's samples",
        description="On-policy distillation on the grpo-kernels loss: the student (default: the built-in tiny model, "
        "its warm-up first) samples, the --teacher scores its tokens, and the student learns the teacher's "
        "top-k (or its log-probs at the sampled tokens); `train`'s options apply.",
        epilog=TRAIN_EPILOG,
        formatter_class=_Formatter,
    )
    _add_train_arguments(d)
    d.set_defaults(distillation="topk", dynamic_sampling=False, beta=0.0)  # no reward signal needed, no reference
    s = sub.add_parser(
        "seeds",
        help="one training command over several seeds: the spread of its results",
        description="Run `grpo-kernels train` once per seed and print the final held-out accuracy's mean with its "
        "95 % interval over the seeds, the sample efficiency (completions and tokens sampled to --target), and "
        "the min / median / max of the held-out accuracy at step 0 and at the end, the zero-std share, the time "
        "and the memory, with the largest drop from a run's best evaluation. Training options go after `--`.",
    )
    s.add_argument("--seeds", type=int, default=5, help="how many seeds (default: 5)")
    s.add_argument("--first-seed", type=int, default=0, help="seeds first-seed, first-seed + 1, ... (default: 0)")
    s.add_argument("--jobs", type=int, default=1, help="runs at a time, sharing the cores (default: 1)")
    s.add_argument("--output-dir", default="runs/seeds", help="seed-N/ per run and seeds.json (default: runs/seeds)")
    s.add_argument(
        "--script",
        default=None,
        help="a Python script to run instead of `grpo-kernels train` (e.g. examples/reward_model_grpo.py); "
        "it takes --seed and --output-dir and writes metrics.jsonl there",
    )
    s.add_argument(
        "--target",
        type=float,
        default=0.9,
        help="sample efficiency: completions and tokens sampled before the held-out accuracy first reaches this",
    )
    s.add_argument("train_args", nargs=argparse.REMAINDER, help="options for `grpo-kernels train`, after --")
    e = sub.add_parser("eval", help="held-out accuracy of a checkpoint", formatter_class=_Formatter)
    e.add_argument("checkpoint", help="a checkpoint-N folder")
    _add_common(e)
    e.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens, help="a completion's length cap")
    return parser


def warmup_plan(steps: int, warmup_steps: int | None, large_batch_steps: int | None) -> tuple[int, int, bool]:
    """(first stage's cap, large-batch stage's cap, whether a short run scaled them down) of the built-in model's
    warm-up: the caps given, else the recipe's (``compare.WARMUP_STEPS`` and a third of it), or for a run shorter
    than the recipe's ``RECIPE["steps"]`` GRPO steps a first cap of ``WARMUP_STEPS / RECIPE["steps"]`` a step
    (at least one check's worth) and no second stage: a short run is short (20 steps: 240 warm-up steps, seconds),
    not a recipe run's warm-up (up to 3200 steps, minutes) before its first GRPO step."""
    short = steps < DEFAULTS.steps
    scaled = short and warmup_steps is None
    if warmup_steps is None:
        warmup_steps = (
            compare.WARMUP_STEPS
            if not short
            else max(compare.WARMUP_CHECK_EVERY, compare.WARMUP_STEPS * steps // DEFAULTS.steps)
        )
    if large_batch_steps is None:
        large_batch_steps = 0 if short else warmup_steps // 3
    return warmup_steps, large_batch_steps, scaled


class RunLog:
    """``train.log`` in the output folder: one timestamped line an event (the command, each phase as it starts,
    the warm-up's result, each GRPO step, each evaluation, warnings, the summary), written from the first moment
    and flushed a line at a time, so that the folder says what the run is doing while it runs."""

    def __init__(self, path: str | None):
        self.path = path
        self.started = time.time()
        if path is not None:
            open(path, "w").close()

    def line(self, text: str, also_stderr: bool = False) -> None:
        stamped = f"[{time.strftime('%H:%M:%S')} +{time.time() - self.started:6.1f}s] {text}"
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(stamped + "\n")
        if also_stderr:
            print(stamped, file=sys.stderr, flush=True)


def _device(name: str) -> str:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    rank_device = os.environ.get("LOCAL_RANK")
    if name == "cuda" and rank_device is not None:
        name = f"cuda:{rank_device}"
    return name


def _teacher(args):
    """The distillation teacher (``--teacher``: a saved model folder, loaded as ``--model`` is), or None
    (``check_train_flags`` refused a teacher without a ``--distillation`` and the reverse)."""
    return None if args.teacher is None else _load_pretrained(args.teacher)[0]


def check_train_flags(args) -> None:
    """The flags of ``train`` / ``distill`` that go together, before any work (a load, the warm-up: minutes), each
    refused by its name; each flag's own range argparse checks as it parses (``_bounded``)."""
    _check_data_options(args)
    if (args.teacher is None) != (args.distillation == "none"):
        raise ValueError(
            f"--distillation {args.distillation} needs --teacher CHECKPOINT, and --teacher needs --distillation "
            f"topk or reverse_kl (got --teacher {args.teacher})"
        )
    if args.teacher is not None and args.fused_lm_head:
        raise ValueError("--fused-lm-head with --teacher: distillation runs on the logits path, not the fused head")
    if args.teacher is not None and args.adaptive_entropy and not args.with_task_reward:
        raise ValueError(
            "--adaptive-entropy acts on the GRPO loss's entropy bonus: a distillation alone has none (add "
            "--with-task-reward, or leave --adaptive-entropy off)"
        )
    try:  # the trainer's settings
        config = trainer_config(args)
    except (TypeError, ValueError) as refused:
        raise ValueError(f"the training flags: {refused}") from None
    try:  # and the loss it will build from them
        GRPOOptions(**trainer_loss_options(config))
    except (TypeError, ValueError) as refused:
        raise ValueError(f"the loss's flags (--loss-type, --epsilon, --beta, ...): {refused}") from None


def trainer_config(args) -> TrainerConfig:
    """The ``TrainerConfig`` of ``train`` / ``distill``'s flags."""
    return TrainerConfig(
        group_size=args.group_size,
        prompts_per_step=args.prompts_per_step,
        steps=args.steps,
        learning_rate=args.lr,
        beta=args.beta,
        epsilon=args.epsilon,
        epsilon_high=args.epsilon_high,
        loss_type=args.loss_type,
        aggregation=args.aggregation,
        num_iterations=args.num_iterations,
        process_rollouts=args.process_rollouts,
        fused_lm_head=args.fused_lm_head,
        entropy_coef=args.entropy_coef,
        adaptive_entropy=args.adaptive_entropy,
        entropy_target=args.entropy_target,
        dynamic_sampling=args.dynamic_sampling,
        max_sampling_rounds=args.max_sampling_rounds,
        distillation=args.distillation,
        distillation_topk=args.distillation_topk,
        distillation_coef=args.distillation_coef,
        distillation_with_reward=args.with_task_reward,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        replay_kept_sets=args.replay_kept_sets,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        eval_every=args.eval_every,
        save_every=args.save_every,
        output_dir=args.output_dir,
        nonfinite_rewards=args.nonfinite_rewards,
        max_nonfinite_steps=args.max_nonfinite_steps,
    )


def phase_name(args) -> str:
    """What the run's training phase is called in its log and progress bar."""
    if args.teacher is None:
        return "GRPO"
    return "GRPO with distillation" if args.with_task_reward else "on-policy distillation"


def _load_pretrained(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(f"--model / checkpoint path {path!r} is not a folder with a saved model")
    # safetensors only: a pickled weights file (pytorch_model.bin) in a downloaded or altered folder could run code
    model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True)
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


def train(args) -> dict:
    """``grpo-kernels train``: the phases of ``TRAIN_EPILOG``; returns (and prints on stdout) the JSON summary.
    Whatever a library prints on stdout meanwhile (DeepSpeed's accelerator warning, ...) goes to stderr."""
    stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        summary = _train(args)
    if collectives.world()[0] == 0:
        print(json.dumps(summary), file=stdout, flush=True)
    return summary


def peak_memory(device: str) -> dict[str, float]:
    """This process's peak resident memory (MiB; Linux reports ru_maxrss in KiB) and, on a GPU, the peak of torch's
    allocated CUDA memory (MiB)."""
    import resource

    peaks = {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        peaks["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return peaks


def _check_data_options(args) -> None:
    """--data's companions, before anything loads: --model and --reward with it, weights one a reward."""
    if args.data is None:
        if args.reward or args.eval_data or args.reward_weights:
            raise ValueError("--reward, --eval-data and --reward-weights go with --data (your own prompts)")
        return
    if args.model is None:
        raise ValueError("--data needs --model: a local model folder to train (the built-in model knows only its task)")
    if not args.reward:
        raise ValueError("--data needs at least one --reward module:function")
    if args.reward_weights is not None and len(args.reward_weights) != len(args.reward):
        raise ValueError(
            f"--reward-weights: one weight per --reward ({len(args.reward)}), got {len(args.reward_weights)}"
        )


def _train(args) -> dict:
    check_train_flags(args)
    device = _device(args.device)
    _maybe_init_distributed(device)
    rank, _ = collectives.world()
    task = get_task(args.task)
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    if args.no_progress:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # the checkpoint's "Writing model shards" bars
    os.makedirs(args.output_dir, exist_ok=True)
    run_log = RunLog(os.path.join(args.output_dir, "train.log") if rank == 0 else None)
    run_log.line(f"grpo-kernels train {' '.join(sys.argv[2:]) if sys.argv[1:2] == ['train'] else ''}".rstrip())
    run_log.line(
        f"device {device}, {torch.get_num_threads()} CPU threads (OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}), output {os.path.abspath(args.output_dir)}"
    )
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    resume_from = None
    if args.resume:
        if latest_checkpoint(args.output_dir) is None:
            raise FileNotFoundError(f"--resume: no checkpoint-N folder in {args.output_dir!r}")
        resume_from = latest_intact_checkpoint(
            args.output_dir, warn=lambda message: run_log.line(f"WARNING: --resume: {message}", also_stderr=True)
        )
        if resume_from is None:
            raise FileNotFoundError(
                f"--resume: every checkpoint in {args.output_dir!r} is damaged (the warnings above name each file): "
                "restore one from a copy, or start the run again in a new output dir"
            )
        run_log.line(f"resuming from {resume_from}")
    started = time.time()
    warmup_record, warnings = None, []
    phases = 2 if resume_from is None and args.model is None else 1
    if resume_from is not None:
        model, tokenizer = _load_pretrained(resume_from)
    elif args.model is not None:
        model, tokenizer = _load_pretrained(args.model)
    else:
        tokenizer = task.build_tokenizer()
        model = task.build_model(tokenizer, seed=args.seed).to(device)
        warmup_steps, large_batch_steps, scaled = warmup_plan(
            args.steps, args.warmup_steps, args.warmup_large_batch_steps
        )
        run_log.line(
            f"phase 1/{phases}: format warm-up, up to {warmup_steps} steps of 32 examples"
            + (f" then up to {large_batch_steps} of {compare.WARMUP_LARGE_BATCH_SIZE}" if large_batch_steps else "")
            + f", until {compare.WARMUP_FORMAT_TARGET:.0%} of sampled answers are well-formed",
            also_stderr=args.no_progress,
        )
        warmup_record = task.warmup(
            model,
            tokenizer,
            steps=warmup_steps,
            seed=args.seed,
            device=device,
            progress=rank == 0 and not args.no_progress,
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            large_batch_steps=large_batch_steps,
            phase=f"phase 1/{phases} ",
        )
        well_formed = warmup_record["warmup_well_formed"]
        run_log.line(
            f"warm-up: {warmup_record['warmup_steps']} + {warmup_record['warmup_large_batch_steps']} steps "
            f"in {warmup_record['warmup_seconds']} s, {well_formed:.0%} of sampled answers well-formed"
        )
        if not well_formed >= compare.WARMUP_FORMAT_TARGET:
            why = (
                f"this is a short run (--steps {args.steps} < the recipe's {DEFAULTS.steps}): its warm-up was "
                f"capped at {warmup_steps} steps (the recipe's: {_CAP}, then up to {_CAP // 3} larger ones)"
                if scaled
                else f"its caps ({warmup_steps} and {large_batch_steps} steps) came first"
            )
            warnings.append(
                f"the format warm-up ended at {well_formed:.0%} well-formed answers, below its "
                f"{compare.WARMUP_FORMAT_TARGET:.0%} target: {why}. GRPO starts from a model that often "
                f"answers malformed; expect less held-out accuracy than the recipe's (docs/trainer.md). For the "
                f"recipe, leave --steps and the warm-up options at their defaults."
            )
    for warning in warnings:
        run_log.line(f"WARNING: {warning}", also_stderr=True)
    config = trainer_config(args)
    if args.data is not None:  # the user's rows and reward functions (training.data)
        reward_funcs, weights = [load_reward_function(spec) for spec in args.reward], args.reward_weights
        positions = getattr(model.config, "max_position_embeddings", None)
        train_rows = trainer_rows(read_rows(args.data), tokenizer, positions, args.max_new_tokens, "--data")
        eval_rows = (
            trainer_rows(
                read_rows(args.eval_data, "--eval-data"), tokenizer, positions, args.max_new_tokens, "--eval-data"
            )
            if args.eval_data
            else []
        )
        format_reward = None
    else:
        reward_funcs, weights = task.reward_functions()
        train_rows = task.make_rows(20000, held_out=False, seed=args.seed)
        eval_rows, format_reward = task.make_rows(args.eval_size, held_out=True, seed=1234), task.format_reward()
    records: list[dict] = []
    if resume_from is None and rank == 0 and os.path.exists(metrics_path):
        os.remove(metrics_path)

    def log(record: dict) -> None:
        records.append(record)
        if rank == 0:
            append_jsonl(metrics_path, record)
        if "eval_accuracy" in record:
            run_log.line(
                f"evaluation at step {record['step']}: held-out accuracy {record['eval_accuracy']:.1%}"
                + (f", malformed {record['eval_malformed']:.1%}" if "eval_malformed" in record else "")
            )

    if warmup_record is not None:  # the format warm-up: its steps, the well-formed share it ended at, its time
        log({"step": 0, **warmup_record, **({"warmup_below_target": True} if warnings else {})})

    trainer = GRPOTrainer(
        model,
        tokenizer,
        reward_funcs,
        train_rows,
        config,
        reward_weights=weights,
        eval_rows=eval_rows,
        device=device,
        log=log,
        format_reward=format_reward,
        teacher=_teacher(args),
    )
    if resume_from is not None:
        trainer.load_state(resume_from)
        records.extend(restart_log(metrics_path, trainer.step, config.steps, write=rank == 0))
    run_log.line(
        f"phase {phases}/{phases}: {phase_name(args)}, steps {trainer.step + 1} to {config.steps} "
        f"({config.prompts_per_step} prompts x {config.group_size} completions a step), evaluation every "
        f"{config.eval_every}",
        also_stderr=args.no_progress,
    )
    bar = None
    if rank == 0 and not args.no_progress:
        bar = progress_bar(
            total=config.steps,
            initial=trainer.step,
            desc=f"phase {phases}/{phases} {phase_name(args)}",
            unit="step",
            file=sys.stderr,
        )

    def on_step(record: dict) -> None:
        run_log.line(
            f"step {record['step']}: reward {record['reward']:.3f}, accuracy {record['accuracy']:.3f}, "
            f"kl {record['kl']:.4f}, loss {record['loss']:.4f}"
            + (
                f" (WARNING: {record['skipped_updates']} optimizer step(s) skipped: a non-finite loss or gradient norm)"
                if record.get("skipped_updates")
                else ""
            )
        )
        if bar is not None:
            bar.update(1)
            bar.set_postfix(reward=f"{record['reward']:.2f}", acc=f"{record['accuracy']:.2f}", kl=f"{record['kl']:.3f}")

    try:
        trainer.train(on_step=on_step, progress=not args.no_progress)
        checkpoint = trainer.save_checkpoint()
    except Preempted as stop:  # a scheduler's SIGTERM or a Ctrl-C: the step finished, its checkpoint written
        run_log.line(str(stop), also_stderr=True)
        raise
    except CheckpointWriteError as failed:  # a full disk: said where the run's log is read, and the run stops
        run_log.line(f"ERROR: {failed}", also_stderr=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    evals = [r for r in records if "eval_accuracy" in r]
    summary = {
        "first_eval_accuracy": evals[0]["eval_accuracy"] if evals else None,
        "final_eval_accuracy": evals[-1]["eval_accuracy"] if evals else None,
        "steps": trainer.step,
        "seconds": round(time.time() - started, 1),
        **peak_memory(device),
        "checkpoint": checkpoint,
        "warnings": warnings,
    }
    if rank == 0:
        plot_curves(records, os.path.join(args.output_dir, "curves.png"))
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f)
    run_log.line(f"done: {json.dumps(summary)}")
    return summary


def append_jsonl(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(
            json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()}) + "\n"
        )


def restart_log(metrics_path: str, step: int, steps: int, write: bool = True) -> list[dict]:
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
    kept = [r for r, k in zip(rows, keep, strict=True) if k]
    if write and not all(keep):
        side = os.path.join(os.path.dirname(metrics_path), "metrics.dropped.jsonl")
        for record in (r for r, k in zip(rows, keep, strict=True) if not k):
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
    trainer = GRPOTrainer(
        model,
        tokenizer,
        reward_funcs,
        [],
        config,
        eval_rows=task.make_rows(args.eval_size, held_out=True, seed=1234),
        device=device,
    )
    result = {
        "checkpoint": args.checkpoint,
        "task": args.task,
        "eval_size": args.eval_size,
        "eval_accuracy": trainer.evaluate(progress=True),
    }
    print(json.dumps(result))
    return result


def seeds(args) -> dict:
    from .seeds import format_summary, run_seeds

    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    result = run_seeds(
        range(args.first_seed, args.first_seed + args.seeds),
        args.output_dir,
        train_args,
        jobs=args.jobs,
        script=args.script,
        target=args.target,
    )
    print(format_summary(result))
    return result


def _with_passive_openmp() -> None:
    """Run this command again (``os.execv``: the same process id and arguments) with ``OMP_WAIT_POLICY=PASSIVE``
    where it is unset. Torch's OpenMP threads otherwise spin while they wait, and on a machine shared with another
    busy process they spin against it: measured on 2 cores beside one busy process, a warm-up ran 4.4x slower than
    alone, 1.9x with passive waits, which cost nothing alone. OpenMP reads the setting once, when torch loads,
    before any of this module runs: hence a new process, not a change here."""
    if "OMP_WAIT_POLICY" in os.environ:
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "grpo_kernels.training.cli", *sys.argv[1:]])


def main(argv: list[str] | None = None) -> int:
    """The ``grpo-kernels`` command. With ``argv`` None (a command line) the long-running commands run with passive
    OpenMP waits (``_with_passive_openmp``); a caller passing ``argv`` keeps its own process as it is."""
    if (
        argv is None
        and sys.argv[1:2] in (["train"], ["distill"], ["seeds"], ["eval"])
        and "-h" not in sys.argv
        and "--help" not in sys.argv
    ):
        _with_passive_openmp()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("train", "distill"):
        try:
            check_train_flags(args)
        except ValueError as refused:
            parser.exit(2, f"grpo-kernels {args.command}: error: {refused}\n")  # (argparse's status: before any work)
    try:
        require_train_extra(f"grpo-kernels {args.command}")  # (--help needs none of it)
    except ImportError as missing:
        print(f"grpo-kernels: {missing}", file=sys.stderr)
        return 1
    try:
        {"train": train, "distill": train, "eval": evaluate, "seeds": seeds}[args.command](args)
    except Preempted as stop:  # stopped by a signal at a step boundary: 128 + the signal, as a shell reports it
        return stop.exit_code
    except CheckpointWriteError:  # said in train.log and on stderr where it happened
        return 1
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
