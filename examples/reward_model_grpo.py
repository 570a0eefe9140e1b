"""Train a scalar-head reward model on preference pairs of the built-in task, then GRPO against it.

    python examples/reward_model_grpo.py [--rm-steps 300] [--grpo-steps 150] [--output-dir runs/rm-grpo]

1. Preference pairs from the "Which is bigger?" task: chosen = the bigger number, rejected =
   the smaller one. A tiny Llama with a scalar head is fitted with the Bradley-Terry loss
   (``grpo_kernels.family.reward_model_loss``); its held-out preference accuracy is printed.
2. The thin trainer runs GRPO with the reward model's (bounded) score as the reward instead
   of the rule verifier, gated by the format rule: a completion that is not one of the
   prompt's two numbers gets 0. Ungated, the policy learns garbage that the reward model,
   never trained on such text, scores highly (reward hacking). Held-out accuracy is still
   judged by the verifier.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from grpo_kernels.training.reward_model import RewardModelReward, preference_accuracy, train_reward_model
from grpo_kernels.training.rewards import numeric_match
from grpo_kernels.training.tasks import compare
from grpo_kernels.training.trainer import RECIPE, GRPOTrainer, TrainerConfig, append_jsonl


def pairs(rows):
    return [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": r["b"] if r["answer"] == r["a"] else r["a"]}
            for r in rows]


def build_reward_model(tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    return LlamaForSequenceClassification(config)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rm-steps", type=int, default=300)
    parser.add_argument("--grpo-steps", type=int, default=150)
    parser.add_argument("--warmup-steps", type=int, default=compare.WARMUP_STEPS)
    parser.add_argument("--eval-size", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="runs/rm-grpo")
    args = parser.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    tokenizer = compare.build_tokenizer()

    reward_model = build_reward_model(tokenizer, args.seed)
    train_rows = compare.make_rows(20000, held_out=False, seed=args.seed)
    eval_rows = compare.make_rows(args.eval_size, held_out=True, seed=1234)
    losses = train_reward_model(reward_model, tokenizer, pairs(train_rows), steps=args.rm_steps, seed=args.seed)
    rm_accuracy = preference_accuracy(reward_model, tokenizer, pairs(eval_rows))
    print(json.dumps({"reward_model_final_loss": losses[-1] if losses else None,
                      "reward_model_heldout_preference_accuracy": rm_accuracy}))

    policy = compare.build_model(tokenizer, seed=args.seed)
    compare.warmup(policy, tokenizer, steps=args.warmup_steps, seed=args.seed)
    config = TrainerConfig(**{**RECIPE, "steps": args.grpo_steps, "eval_every": 50, "save_every": 0,
                              "seed": args.seed, "output_dir": args.output_dir})
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    if os.path.exists(metrics_path):
        os.remove(metrics_path)
    score = RewardModelReward(reward_model, tokenizer)

    def gated_reward_model(prompts, completions, a, b, **_):
        return [s if c.strip() in (x, y) else 0.0 for s, c, x, y in zip(score(prompts, completions), completions, a, b)]

    trainer = GRPOTrainer(policy, tokenizer, [gated_reward_model], train_rows, config, eval_rows=eval_rows,
                          eval_reward=numeric_match, log=lambda r: append_jsonl(metrics_path, r))
    records = trainer.train()
    evals = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
    summary = {"reward_model_heldout_preference_accuracy": rm_accuracy, "first_eval_accuracy": evals[0],
               "final_eval_accuracy": evals[-1]}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
