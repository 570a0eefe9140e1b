"""TRL's GRPOTrainer with grpo-kernels' fused loss: the one-word drop-in, runnable on a CPU.

    pip install "grpo-kernels[trl]"
    python integration/trl_grpo.py --max-steps 2 --output-dir /tmp/trl-grpo

It trains a tiny Llama (built from a config: nothing is downloaded) on the built-in task's
prompts ("Which is bigger? 9.11 or 9.9") with a rule reward. The only change to a stock TRL
script is the import: ``GRPOKernelsTrainer`` in place of ``GRPOTrainer``. On a GPU, drop
``use_cpu`` and pass ``fused_lm_head=True`` to compute the loss from the hidden states.
"""

import argparse
import json
import tempfile

from datasets import Dataset
from trl import GRPOConfig

from grpo_kernels.integration.trl import GRPOKernelsTrainer as GRPOTrainer  # the drop-in
from grpo_kernels.training.rewards import numeric_match
from grpo_kernels.training.tasks import compare


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--beta", type=float, default=0.04)
    args = parser.parse_args(argv)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="trl-grpo-")

    tokenizer = compare.build_tokenizer()
    model_dir = f"{output_dir}/tiny-llama"
    compare.build_model(tokenizer, hidden_size=32, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rows = compare.make_rows(32, held_out=False, seed=0)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    config = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=4, num_generations=2,
                        max_completion_length=6, max_steps=args.max_steps, loss_type=args.loss_type,
                        beta=args.beta, learning_rate=1e-4, logging_steps=1, report_to="none", use_cpu=True,
                        bf16=False, save_strategy="no")
    trainer = GRPOTrainer(model=model_dir, reward_funcs=numeric_match, args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    result = trainer.train()
    summary = {"steps": trainer.state.global_step, "training_loss": result.training_loss,
               "last_log": trainer.state.log_history[-2] if len(trainer.state.log_history) > 1 else {}}
    print(json.dumps(summary, default=float))
    return summary


if __name__ == "__main__":
    main()
