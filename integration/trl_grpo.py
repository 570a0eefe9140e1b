"""TRL's GRPOTrainer with grpo-kernels' fused loss: the one-word drop-in, runnable on a CPU.

    pip install "grpo-kernels[trl]"
    python integration/trl_grpo.py --output-dir /tmp/trl-grpo

It trains a tiny Llama (built from a config: nothing is downloaded) on the built-in task's prompts ("Which is
bigger? 9.11 or 9.9") with a rule reward. A model fresh from its config answers nothing a reward can credit
(every reward 0, no advantage, no gradient), so the script first runs the built-in task's format warm-up (a few
seconds of supervised steps on the answer's format only: one of the two numbers, either at random), as a user
starts GRPO from a model that already answers; the rewards then vary within each group, and the steps move the
policy. The only change to a stock TRL script is the import: ``GRPOKernelsTrainer`` in place of ``GRPOTrainer``.
On a GPU, drop ``use_cpu`` and pass ``fused_lm_head=True`` to compute the loss from the hidden states.
"""

import argparse
import json
import tempfile

from datasets import Dataset
from trl import GRPOConfig

from grpo_kernels.integration.trl import GRPOKernelsTrainer as GRPOTrainer  # the drop-in
from grpo_kernels.training.rewards import numeric_match
from grpo_kernels.training.tasks import compare

STEP_KEYS = ("reward", "reward_std", "grad_norm", "loss", "kl", "entropy")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=compare.WARMUP_CHECK_EVERY,
        help="the format warm-up's supervised steps before GRPO (0: a model fresh from its config, "
        "whose rewards are all 0)",
    )
    args = parser.parse_args(argv)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="trl-grpo-")

    tokenizer = compare.build_tokenizer()
    model = compare.build_model(tokenizer, seed=0)
    warmup = {}
    if args.warmup_steps:
        warmup = compare.warmup(model, tokenizer, steps=args.warmup_steps, large_batch_steps=0, seed=0)
    model_dir = f"{output_dir}/tiny-llama"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rows = compare.make_rows(256, held_out=False, seed=0)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    config = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=32,
        num_generations=8,
        max_completion_length=8,
        max_steps=args.max_steps,
        loss_type=args.loss_type,
        beta=args.beta,
        learning_rate=5e-4,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model_dir, reward_funcs=numeric_match, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    result = trainer.train()
    steps = [{key: log[key] for key in STEP_KEYS if key in log} for log in trainer.state.log_history if "reward" in log]
    for step, log in enumerate(steps, 1):
        print(f"step {step}: " + ", ".join(f"{key} {value:.4g}" for key, value in log.items()))
    summary = {
        "steps": trainer.state.global_step,
        "training_loss": result.training_loss,
        "warmup_well_formed": warmup.get("warmup_well_formed"),
        "per_step": steps,
    }
    print(json.dumps(summary, default=float))
    return summary


if __name__ == "__main__":
    main()
