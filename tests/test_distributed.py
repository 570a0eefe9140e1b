"""Data parallel: two processes (gloo, CPU) make the update one process makes on the whole batch."""


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo_kernels.rewards import numeric_match
from grpo_kernels.tasks import compare
from grpo_kernels.trainer import GRPOTrainer, Rollout, TrainerConfig

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
    return Rollout(prompt_ids[rows], prompt_mask[rows], completion_ids[rows], completion_mask[rows],
                   advantages[rows], rewards[rows], torch.tensor(0.0))


def _gradients(loss_type: str, rows: slice):
    tokenizer = compare.build_tokenizer()
    model = compare.build_model(tokenizer, hidden_size=32, seed=0)
    config = TrainerConfig(group_size=GROUP, prompts_per_step=ROWS // GROUP, loss_type=loss_type,
                           max_new_tokens=6)
    trainer = GRPOTrainer(model, tokenizer, [numeric_match], [{"prompt": "x", "answer": "1"}], config)
    loss, _ = trainer.accumulate_gradients(_rollout(trainer, rows))
    return [p.grad.clone() for p in model.parameters()]


def _worker(rank: int, world: int, init_file: str, loss_type: str, out_file: str):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        half = ROWS // world
        grads = _gradients(loss_type, slice(rank * half, (rank + 1) * half))
        if rank == 0:
            torch.save(grads, out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_two_processes_match_one_process(tmp_path, loss_type):
    out_file = str(tmp_path / "grads.pt")
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), loss_type, out_file), nprocs=2, join=True)
    distributed = torch.load(out_file)
    single = _gradients(loss_type, slice(0, ROWS))
    for d, s in zip(distributed, single):
        torch.testing.assert_close(d, s, atol=1e-6, rtol=1e-4)
