"""Data parallel: two processes (gloo, CPU) make the update one process makes on the whole batch."""

import pytest
import torch
from gloo_ranks import run_ranks

from grpo_kernels.training.rewards import numeric_match
from grpo_kernels.training.tasks import compare
from grpo_kernels.training.trainer import GRPOTrainer, Rollout, TrainerConfig

ROWS, GROUP = 8, 2


def _rollout(trainer, rows: slice) -> Rollout:
    """A fixed batch: completions of different lengths (some rows mostly padding), random advantages."""
    g = torch.Generator().manual_seed(0)
    prompts = [r["prompt"] for r in compare.make_rows(ROWS, held_out=False, seed=3)]
    prompt_ids, prompt_mask = trainer._encode_prompts(prompts)
    T = 6
    completion_ids = torch.randint(3, len(trainer.tokenizer), (ROWS, T), generator=g)
    lengths = torch.tensor([6, 1, 3, 6, 2, 5, 4, 1])
    completion_mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    advantages = torch.randn(ROWS, generator=g)
    rewards = torch.zeros(ROWS, 1)
    n = len(range(ROWS)[rows])
    return Rollout(
        prompt_ids[rows],
        prompt_mask[rows],
        completion_ids[rows],
        completion_mask[rows],
        advantages[rows],
        rewards[rows],
        torch.zeros(n // GROUP, dtype=torch.bool),
        [{}] * n,
    )


def _gradients(loss_type: str, rows: slice, aggregation: str = "loss_type"):
    tokenizer = compare.build_tokenizer()
    model = compare.build_model(tokenizer, hidden_size=32, seed=0)
    config = TrainerConfig(
        group_size=GROUP,
        prompts_per_step=ROWS // GROUP,
        loss_type=loss_type,
        aggregation=aggregation,
        max_new_tokens=6,
    )
    trainer = GRPOTrainer(model, tokenizer, [numeric_match], [{"prompt": "x", "answer": "1"}], config)
    loss, _ = trainer.accumulate_gradients(_rollout(trainer, rows))
    return [p.grad.clone() for p in model.parameters()]


def _rank_gradients(rank: int, world: int, loss_type: str):
    half = ROWS // world
    return _gradients(loss_type, slice(rank * half, (rank + 1) * half))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_two_processes_match_one_process(loss_type):
    per_rank = run_ranks(_rank_gradients, 2, loss_type)
    single = _gradients(loss_type, slice(0, ROWS))
    for rank_grads in per_rank:  # the all-reduced gradients are the same on every rank
        for d, s in zip(rank_grads, single, strict=True):
            torch.testing.assert_close(d, s, atol=1e-6, rtol=1e-4)


def _uneven_rank_gradients(rank: int, world: int):
    """Rank 0 holds one prompt's group, rank 1 the other three (dynamic sampling can keep unequal shares)."""
    return _gradients("grpo", slice(0, GROUP) if rank == 0 else slice(GROUP, ROWS), aggregation="prompt_mean")


def test_the_prompt_mean_over_ranks_with_unequal_prompts_is_one_processs():
    """--aggregation prompt_mean: each rank's loss scaled by its share of the step's prompts, so the averaged
    gradients are the prompt mean over all of them, whatever each rank holds."""
    per_rank = run_ranks(_uneven_rank_gradients, 2)
    single = _gradients("grpo", slice(0, ROWS), aggregation="prompt_mean")
    for rank_grads in per_rank:
        for d, s in zip(rank_grads, single, strict=True):
            torch.testing.assert_close(d, s, atol=1e-6, rtol=1e-4)
