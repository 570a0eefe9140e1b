"""One TRL GRPO ``train()`` under DeepSpeed ZeRO on CPU ranks, for tests/test_deepspeed.py (run it with
``torchrun --standalone --nproc_per_node 2``): stock TRL or our adapter (the logits path or the fused lm_head),
a tied or untied head, two SGD steps (so that equal gradients give equal parameters, with no optimizer state
to magnify rounding). Rank 0 writes the log history, the whole parameters before and after each step (each
step's gradient: their difference over the learning rate) and the final state dict.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/deepspeed_train.py \\
        STAGE {stock,logits,fused} {tied,untied} MODEL_DIR OUT
"""

import os
import sys
import tempfile

import deepspeed
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from grpo_kernels.training.tasks import compare


def varied_reward(prompts, completions, **_):
    return [float(len(c) % 3) for c in completions]


class ParametersAtSteps(TrainerCallback):
    """Every parameter, whole (gathered from ZeRO-3's partitions: a collective, on every rank), before each
    optimizer step and at the end. With SGD, each step's gradient is (before - after) / lr: the gradients as gathered,
    whichever way ZeRO reduced and partitioned them."""

    def __init__(self):
        self.steps = []

    def _record(self, model):
        module = model.module if hasattr(model, "module") else model
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            self.steps.append({name: p.detach().float().clone() for name, p in module.named_parameters()})

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._record(model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._record(model)


def main(stage: int, which: str, model_dir: str, out: str) -> None:
    # HF's CPU path does not start DeepSpeed's communication before ZeRO-3's zero.Init builds the model, whose
    # config check then sees one process (stock TRL too): start it here, over gloo
    deepspeed.init_distributed(dist_backend="gloo")
    rows = compare.make_rows(16, held_out=False, seed=0)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    config = {"zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto"}
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=6, report_to="none", use_cpu=True, logging_steps=1, max_steps=int(os.environ.get("DS_STEPS", "2")),
                      bf16=False, beta=0.04, seed=7, save_strategy="no", deepspeed=config, optim="sgd",
                      learning_rate=0.1)
    recorder = ParametersAtSteps()
    common = dict(model=model_dir, reward_funcs=varied_reward, args=args, train_dataset=dataset,
                  processing_class=compare.build_tokenizer(), callbacks=[recorder])
    if which == "stock":
        trainer = GRPOTrainer(**common)
    else:
        from grpo_kernels.integration.trl import GRPOKernelsTrainer

        trainer = GRPOKernelsTrainer(**common, fused_lm_head=which == "fused")
        assert trainer.fused_lm_head is (which == "fused")
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "DeepSpeedEngine" and trainer.is_deepspeed_enabled
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"parameters": {k: v.float().clone() for k, v in state.items()}, "log": trainer.state.log_history,
                    "steps": recorder.steps, "lr": args.learning_rate}, out)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
