"""Train a scalar-head reward model on preference pairs of the built-in task, then GRPO against it.

    python examples/reward_model_grpo.py [--rm-steps 300] [--grpo-steps 150] [--output-dir runs/rm-grpo]
    python examples/reward_model_grpo.py --resume   # after a kill: the same run from its last checkpoint

1. Preference pairs from the "Which is bigger?" task: chosen = the bigger number, rejected =
   the smaller one. A tiny Llama with a scalar head is fitted with the Bradley-Terry loss
   (``grpo_kernels.methods.reward_model_loss``) and TRL's centering term (0.01), which holds the
   scores near 0 so that their sigmoid, the reward, does not saturate; its held-out preference
   accuracy is printed.
2. The thin trainer runs GRPO with the reward model's (bounded) score as the reward instead
   of the rule verifier, gated by the format rule: a completion that is not one of the
   prompt's two numbers gets 0. Ungated, the policy learns garbage that the reward model,
   never trained on such text, scores highly (reward hacking). Held-out accuracy is still
   judged by the verifier.

The reward model is saved once (``reward-model/`` in the output folder) and the policy every ``--save-every``
steps; ``--resume`` reloads the reward model, the last checkpoint and the run's reference model, and the run
continues as if never stopped (``metrics.jsonl`` restarts at the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from grpo_kernels.training.checkpoint import latest_checkpoint, save_atomically
from grpo_kernels.training.cli import append_jsonl, restart_log
from grpo_kernels.training.config import RECIPE, TrainerConfig
from grpo_kernels.training.reward_model import RewardModelReward, preference_accuracy, train_reward_model
from grpo_kernels.training.rewards import numeric_match
from grpo_kernels.training.tasks import compare
from grpo_kernels.training.trainer import GRPOTrainer


def pairs(rows):
    return [
        {"prompt": r["prompt"], "chosen": r["answer"], "rejected": r["b"] if r["answer"] == r["a"] else r["a"]}
        for r in rows
    ]


def build_reward_model(tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForSequenceClassification(config)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rm-steps", type=int, default=300)
    parser.add_argument("--grpo-steps", type=int, default=150)
    parser.add_argument("--warmup-steps", type=int, default=compare.WARMUP_STEPS)
    parser.add_argument("--warmup-large-batch-steps", type=int, default=None)
    parser.add_argument("--eval-size", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--output-dir", default="runs/rm-grpo")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
    args = parser.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    tokenizer = compare.build_tokenizer()
    rm_dir = os.path.join(args.output_dir, "reward-model")
    resume_from = latest_checkpoint(args.output_dir) if args.resume else None
    if args.resume and (resume_from is None or not os.path.isdir(rm_dir)):
        raise FileNotFoundError(f"--resume: no checkpoint-N folder and reward-model/ in {args.output_dir!r}")

    reward_model = build_reward_model(tokenizer, args.seed)
    train_rows = compare.make_rows(20000, held_out=False, seed=args.seed)
    eval_rows = compare.make_rows(args.eval_size, held_out=True, seed=1234)
    if resume_from is None:
        losses = train_reward_model(reward_model, tokenizer, pairs(train_rows), steps=args.rm_steps, seed=args.seed)
        save_atomically(rm_dir, reward_model.save_pretrained)
        print(json.dumps({"reward_model_final_loss": losses[-1] if losses else None}))
    else:
        from transformers import LlamaForSequenceClassification

        reward_model = LlamaForSequenceClassification.from_pretrained(rm_dir)
    rm_accuracy = preference_accuracy(reward_model, tokenizer, pairs(eval_rows))
    print(json.dumps({"reward_model_heldout_preference_accuracy": rm_accuracy}))

    if resume_from is None:
        policy = compare.build_model(tokenizer, seed=args.seed)
        warmup_record = compare.warmup(
            policy, tokenizer, steps=args.warmup_steps, seed=args.seed, large_batch_steps=args.warmup_large_batch_steps
        )
    else:
        from transformers import AutoModelForCausalLM

        policy = AutoModelForCausalLM.from_pretrained(resume_from)
    config = TrainerConfig(
        **{
            **RECIPE,
            "steps": args.grpo_steps,
            "eval_every": 50,
            "save_every": args.save_every,
            "seed": args.seed,
            "output_dir": args.output_dir,
        }
    )
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    if resume_from is None and os.path.exists(metrics_path):
        os.remove(metrics_path)
    if resume_from is None:
        append_jsonl(metrics_path, {"step": 0, **warmup_record})
    score = RewardModelReward(reward_model, tokenizer)

    def gated_reward_model(prompts, completions, a, b, **_):
        return [
            s if c.strip() in (x, y) else 0.0
            for s, c, x, y in zip(score(prompts, completions), completions, a, b, strict=True)
        ]

    trainer = GRPOTrainer(
        policy,
        tokenizer,
        [gated_reward_model],
        train_rows,
        config,
        eval_rows=eval_rows,
        eval_reward=numeric_match,
        log=lambda r: append_jsonl(metrics_path, r),
        format_reward=compare.format_reward(),
    )
    records = []
    if resume_from is not None:
        trainer.load_state(resume_from)
        records = restart_log(metrics_path, trainer.step, config.steps)
    records += trainer.train()
    trainer.save_checkpoint()
    evals = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
    summary = {
        "reward_model_heldout_preference_accuracy": rm_accuracy,
        "first_eval_accuracy": evals[0],
        "final_eval_accuracy": evals[-1],
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
