"""The thin trainer's settings (``TrainerConfig``) and the built-in task's recipe (``RECIPE``, the command's
defaults)."""

from __future__ import annotations

import dataclasses

NONFINITE_REWARDS = ("refuse", "drop_group")
DISTILLATIONS = ("none", "topk", "reverse_kl")


@dataclasses.dataclass
class TrainerConfig:
    group_size: int = 8  # G completions per prompt
    prompts_per_step: int = 16  # over all ranks
    steps: int = 100
    learning_rate: float = 1e-3
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "grpo"
    # "prompt_mean": each prompt's token mean, then the mean over the step's prompts (GRPOOptions.aggregation)
    aggregation: str = "loss_type"
    num_iterations: int = 1  # mu: updates per generation batch (1 uses the on-policy shortcut)
    # 0: outcome supervision (one reward per completion). N > 0: process supervision with
    # MATH-SHEPHERD labels: every completion token ends a step, labelled by N completions
    # sampled from it (the share that reaches a correct answer; completions that share a prefix share its
    # label), then process_advantages.
    process_rollouts: int = 0
    # compute the loss from the last hidden states and the lm_head weight (FusedLinearGRPOLoss):
    # the [B, T, V] logits of the update are never materialized
    fused_lm_head: bool = False
    # the entropy bonus: the loss less entropy_coef x mean entropy; with adaptive_entropy, TRL's
    # controller moves the coefficient by entropy_coef_delta each step toward entropy_target
    entropy_coef: float = 0.0
    adaptive_entropy: bool = False
    entropy_target: float = 0.2
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    # DAPO's dynamic sampling (verl's filter_groups): groups whose rewards are all equal carry no
    # signal and are dropped; more prompts are sampled, up to max_sampling_rounds batches of
    # prompts_per_step, until prompts_per_step groups are kept (the update then takes those only)
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    temperature: float = 1.0
    # a truncating sampler: top_k ids (0: all) and the top_p nucleus (1.0: all), after the temperature; with
    # replay_kept_sets the trainer takes each token's log-prob over the ids its sampler kept (grpo_kernels.KeptSet),
    # so that its distribution is the sampler's (the first inner step's ratio to the sampler is 1)
    top_k: int = 0
    top_p: float = 1.0
    replay_kept_sets: bool = True
    # on-policy distillation from a teacher model (GRPOTrainer's teacher=): "topk", the teacher's top
    # distillation_topk forward KL (verl's forward_kl_topk), or "reverse_kl", the k3 estimate at the sampled token;
    # alone, or, with distillation_with_reward, distillation_coef x it added to the GRPO loss of the task's rewards
    distillation: str = "none"
    distillation_topk: int = 16
    distillation_coef: float = 1.0
    distillation_with_reward: bool = False
    max_new_tokens: int = 8
    max_grad_norm: float = 1.0
    # a reward of +-inf (NaN or None is a reward function's "not applicable"): "refuse" stops the run naming the
    # function and the completion; "drop_group" warns and gives that completion's group no advantage
    nonfinite_rewards: str = "refuse"
    # a non-finite loss or gradient norm skips the optimizer step (logged); this many in a row stop the run
    max_nonfinite_steps: int = 3
    seed: int = 0
    eval_every: int = 20
    save_every: int = 50
    output_dir: str = "runs/grpo"

    def __post_init__(self):
        if self.nonfinite_rewards not in NONFINITE_REWARDS:
            raise ValueError(
                f"nonfinite_rewards must be one of {list(NONFINITE_REWARDS)}, got {self.nonfinite_rewards!r}"
            )
        if self.max_nonfinite_steps < 1:
            raise ValueError(f"max_nonfinite_steps must be >= 1, got {self.max_nonfinite_steps}")
        if self.group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 (advantages compare completions of one prompt), got {self.group_size}"
            )
        if self.prompts_per_step < 1 or self.steps < 0 or self.num_iterations < 1 or self.max_new_tokens < 1:
            raise ValueError(
                f"prompts_per_step, num_iterations and max_new_tokens must be >= 1 and steps >= 0, "
                f"got {self.prompts_per_step}, {self.num_iterations}, {self.max_new_tokens}, {self.steps}"
            )
        if self.distillation not in DISTILLATIONS:
            raise ValueError(f"distillation must be one of {list(DISTILLATIONS)}, got {self.distillation!r}")
        if self.distillation_topk < 1:
            raise ValueError(f"distillation_topk must be >= 1, got {self.distillation_topk}")
        if self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_k must be >= 0 and top_p in (0, 1], got top_k={self.top_k}, top_p={self.top_p}")
        if self.max_sampling_rounds < 1:
            raise ValueError(
                f"max_sampling_rounds must be >= 1 (batches of prompts a step may sample), "
                f"got {self.max_sampling_rounds}"
            )


# The recipe of `grpo-kernels train` and the examples on the built-in task, chosen by its spread over seeds
# (docs/trainer.md): the KL term keeps the warmed-up model's copying of the
# chosen number while the choice moves, and dynamic sampling fills each update with groups that carry
# signal. TrainerConfig's own defaults stay plain GRPO.
RECIPE = dict(
    group_size=8,
    prompts_per_step=32,
    steps=200,
    learning_rate=5e-4,
    beta=0.04,
    epsilon_high=0.28,
    dynamic_sampling=True,
    eval_every=25,
)
