"""Why ZeRO-3 on CPU ranks read uninitialized parameters now and then: a reproduction without TRL.

    python -m torch.distributed.run --standalone --nproc_per_node 2 scripts/zero3_gloo_gather.py

1. torch alone: after several async gloo all-gathers, waiting for the last one does not mean the others are done
   (gloo runs collectives on a pool of threads and finishes them out of order).
2. DeepSpeed 0.19's blocking gather of several ZeRO-3 parameters at once (``_allgather_params_coalesced``: behind
   ``GatheredParameters`` over several parameters, TRL's generation, the re-gather of persistent parameters after
   each step, accelerate's state dict) launches one async all-gather a parameter and waits for the last alone, so
   it reads the others early: compared with one-parameter gathers, some whole-model gathers differ.
   ``stage3_allgather_sequential: true`` waits for each, and none differs.
"""

import deepspeed
import torch
import torch.distributed as dist

TRIALS = 300
deepspeed.init_distributed(dist_backend="gloo")
rank = dist.get_rank()

early = 0
for _ in range(TRIALS):
    inputs = [torch.full((4096,), float(rank + 1 + 10 * k)) for k in range(16)]
    outputs = [torch.full((2 * 4096,), float("nan")) for _ in inputs]
    handles = [dist.all_gather_into_tensor(o, i, async_op=True) for o, i in zip(outputs, inputs, strict=True)]
    handles[-1].wait()
    seen = [o.clone() for o in outputs]
    for handle in handles:
        handle.wait()
    early += any(not torch.equal(s, o) for s, o in zip(seen, outputs, strict=True))
print(f"rank {rank}, torch: {early} of {TRIALS} times an all-gather was unfinished after the last one's wait")

for sequential in (False, True):
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_allgather_sequential": sequential},
    }
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])
    engine, *_ = deepspeed.initialize(
        model=model,
        config=config,
        model_parameters=model.parameters(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )
    params = list(engine.module.parameters())
    alone = []
    for p in params:
        with deepspeed.zero.GatheredParameters([p]):
            alone.append(p.data.clone())
    wrong = 0
    for _ in range(TRIALS):
        with deepspeed.zero.GatheredParameters(params):
            wrong += any(not torch.equal(p.data, a) for p, a in zip(params, alone, strict=True))
    print(
        f"rank {rank}, DeepSpeed stage3_allgather_sequential={sequential}: {wrong} of {TRIALS} whole-model "
        "gathers read a parameter that differs from its own gather"
    )
