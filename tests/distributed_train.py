"""TRL GRPO ``train()`` runs on 2 CPU ranks (gloo), one after another in one launch, for tests/test_deepspeed.py
and tests/test_two_processes.py (run it with ``torchrun --standalone --nproc_per_node 2``): stock TRL or our adapter
(the logits path or the fused lm_head), under DDP or DeepSpeed ZeRO-2 / ZeRO-3 (through accelerate), with a loss
configuration, SGD steps (so that equal gradients give equal parameters, with no optimizer state to magnify
rounding). Not FSDP: accelerate 1.16 turns on its FSDP plugin only for multi-accelerator runs (``AcceleratorState``:
MULTI_GPU, MULTI_XPU, ...), so on CPU ranks ``fsdp=`` in the config is silently a DDP run. Rank 0 writes the log
history, the whole parameters before and after each step (each step's gradient: their difference over the learning
rate), the final state dict and, for our adapter, at each loss call the largest difference between the loss's
log-probs and the model's own forward's (``ForwardChecked``).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed_train.py \\
        {ddp,zero2,zero3} stock,logits,fused MODEL_DIR OUT_DIR [key=json ...]
"""

import copy
import json
import os
import sys
import tempfile

import torch
from datasets import Dataset
from distributed_runs import start_deepspeed_on_gloo
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from grpo_kernels.reference import token_logprobs_and_entropy
from grpo_kernels.training.tasks import compare
from grpo_kernels.wrapped import whole_parameters


def varied_reward(prompts, completions, **_):
    return [float(len(c) % 3) for c in completions]


class ParametersAtSteps(TrainerCallback):
    """Every parameter before each optimizer step and at the end. With SGD, each step's gradient is
    (before - after) / lr: the gradients as all-reduced. Under ZeRO-3, each parameter gathered whole."""

    def __init__(self):
        self.steps = []

    def _record(self, model):
        module = model.module if hasattr(model, "module") else model
        with whole_parameters(module):
            self.steps.append({name: p.detach().float().clone() for name, p in module.named_parameters()})

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._record(model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._record(model)


class ForwardChecked:
    """Our adapter's trainer that, at each loss call, also runs the model's own forward (through the engine that
    wraps it: ZeRO-3 gathers the parameters as in any forward) and records the largest difference between the
    loss's per-token log-probs and the log-softmax of that forward's logits at the completion tokens: the fused
    lm_head must read exactly the head weight the model's forward uses, at every step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logp_differences = []
        self._seen = []
        self.grpo_loss.register_forward_hook(lambda module, args, out: self._seen.append(out.per_token_logps))

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        ours = self._seen.pop()
        T = inputs["completion_ids"].size(1)
        with torch.no_grad():
            logits = model(**self._sequence(inputs), logits_to_keep=T + 1).logits[:, :-1]
            own, _ = token_logprobs_and_entropy(logits, inputs["completion_ids"], float(self.temperature))
        active = inputs["completion_mask"].bool()
        self.logp_differences.append((ours - own).abs()[active].max().item() if active.any() else 0.0)
        return loss


def main(stack: str, runs: str, model_dir: str, out_dir: str, **config) -> None:
    """Each of ``runs`` (comma-separated, from stock, logits and fused) in turn in this one process group, each
    written to ``out_dir/WHICH.pt``: one launch pays the ranks' start (their imports: most of a launch's time)
    once. Each training builds its own trainer, Accelerator and model from the saved directory, seeded alike;
    accelerate's and transformers' process-wide state from the one before is cleared first."""
    if stack.startswith("zero"):
        # HF's CPU path does not start DeepSpeed's communication before ZeRO-3's zero.Init builds the model,
        # whose config check then sees one process (stock TRL too): start it here, over gloo
        start_deepspeed_on_gloo()
        # stage3_allgather_sequential: DeepSpeed's blocking all-gather of several parameters (GatheredParameters,
        # the persistent parameters' re-gather after each step, the state dict) launches one async all-gather a
        # parameter and waits for the last alone; gloo runs them on several threads and finishes them out of
        # order, so the others are read before they arrive (uninitialized memory, now and then). Sequential
        # waits each one (docs/testing.md, "ZeRO-3 on CPU ranks"; scripts/zero3_gloo_gather.py reproduces it).
        config["deepspeed"] = {
            "zero_optimization": {
                "stage": int(stack[-1]),
                "stage3_gather_16bit_weights_on_model_save": True,
                "stage3_allgather_sequential": True,
            },
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "gradient_clipping": "auto",
        }
    for which in runs.split(","):
        train(stack, which, model_dir, os.path.join(out_dir, f"{which}.pt"), copy.deepcopy(config))


def train(stack: str, which: str, model_dir: str, out: str, config: dict) -> None:
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state()  # (the process group stays: PartialState is kept)
    GradientState._reset_state()
    unset_hf_deepspeed_config()
    rows = compare.make_rows(32, held_out=False, seed=0)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    settings = dict(
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        logging_steps=1,
        max_steps=int(os.environ.get("TRAIN_STEPS", "2")),
        beta=0.04,
        seed=7,
    )
    settings.update(config)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        optim="sgd",
        learning_rate=0.1,
        **settings,
    )
    recorder = ParametersAtSteps()
    common = dict(
        model=model_dir,
        reward_funcs=varied_reward,
        args=args,
        train_dataset=dataset,
        processing_class=compare.build_tokenizer(),
        callbacks=[recorder],
    )
    if which == "stock":
        trainer = GRPOTrainer(**common)
    else:
        from grpo_kernels.integration.trl import GRPOKernelsTrainer

        trainer = type("Checked", (ForwardChecked, GRPOKernelsTrainer), {})(**common, fused_lm_head=which == "fused")
        assert trainer.fused_lm_head is (which == "fused")
    trainer.train()
    wrapper = type(trainer.model_wrapped).__name__
    expected = {"ddp": "DistributedDataParallel", "zero2": "DeepSpeedEngine", "zero3": "DeepSpeedEngine"}
    assert wrapper == expected.get(stack, wrapper), wrapper
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(
            {
                "parameters": {k: v.float().clone() for k, v in state.items()},
                "log": trainer.state.log_history,
                "steps": recorder.steps,
                "lr": args.learning_rate,
                "logp_differences": getattr(trainer, "logp_differences", None),
            },
            out,
        )


if __name__ == "__main__":
    keywords = dict(arg.split("=", 1) for arg in sys.argv[5:])
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], **{k: json.loads(v) for k, v in keywords.items()})
