"""What the OpenRLHF Ray tests run inside an OpenRLHF process (a Ray worker, or a plain process for OpenRLHF's own
numbers): OpenRLHF's real modules (``tests/openrlhf_code.py``'s tree from the wheel on PYTHONPATH), never a copy.

- ``names_in_use``: where the functions OpenRLHF's actor looks up by name come from in this process:
  ``openrlhf.trainer.ray.ppo_actor``'s ``PolicyLoss``, ``aggregate_loss``, ``compute_approx_kl`` (the names its
  ``training_step`` calls) and ``openrlhf.models.actor``'s ``log_probs_from_logits``, ``compute_entropy`` (those of
  ``Actor.forward``), and whether ``setup_ray_worker`` ran here.
- ``training_step``: OpenRLHF's own ``ActorPPOTrainer.__init__`` and ``training_step`` on one micro-batch of a tiny
  Llama wrapped in OpenRLHF's ``Actor`` (its real ``forward``), with the batch info of an uneven second rank: the
  loss it backpropagates, its logged metrics and every parameter's gradient. What stands in: the DeepSpeed
  strategy (its ``backward`` is ``loss.backward()``, no optimizer step), the scheduler, the replay buffer (it
  picks a CUDA device when built) and the trainer's closing barrier (``torch_dist_barrier_and_cuda_sync``: no
  process group and no CUDA here). Whatever this process's
  ``ppo_actor`` module holds (OpenRLHF's functions, or ours after ``use_in_openrlhf``) is what runs.
"""

from __future__ import annotations

import os
import types

import torch

# (B, prompt, response) of the micro-batch; the other rank's tokens and samples in the global batch info
B, PROMPT, RESPONSE, V = 4, 5, 6, 37
OTHER_RANK_TOKENS, OTHER_RANK_SAMPLES = 13.0, 3.0

CONFIGS = {
    # OpenRLHF's GRPO recipe: token-mean, the k3 KL loss, an entropy loss
    "token-mean k3 entropy": dict(
        loss_agg_mode="token-mean", policy_loss_type="ppo", estimator="k3", entropy_coef=0.01, dual_clip=None
    ),
    "seq-mean-token-mean k1 dual-clip": dict(
        loss_agg_mode="seq-mean-token-mean", policy_loss_type="ppo", estimator="k1", entropy_coef=None, dual_clip=3.0
    ),
    "gspo k2 entropy": dict(
        loss_agg_mode="token-mean", policy_loss_type="gspo", estimator="k2", entropy_coef=0.02, dual_clip=None
    ),
}


def names_in_use() -> dict:
    import openrlhf.models.actor as actor
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    def where(fn):
        fn = getattr(fn, "_torchdynamo_orig_callable", fn)  # OpenRLHF's compute_entropy is torch.compile'd
        return f"{fn.__module__}.{fn.__qualname__}"

    found = {
        f"ppo_actor.{name}": where(getattr(ppo_actor, name))
        for name in ("PolicyLoss", "aggregate_loss", "compute_approx_kl")
    }
    found.update(
        {f"actor.{name}": where(getattr(actor, name)) for name in ("log_probs_from_logits", "compute_entropy")}
    )
    found["hook ran"] = os.environ.get("GRPO_KERNELS_IN_OPENRLHF") == "1"
    return found


def _args(config: dict):
    ns = types.SimpleNamespace
    return ns(
        train=ns(max_epochs=1, dynamic_batch_enable=False, colocate_all=False, async_enable=False),
        actor=ns(
            eps_clip_low_high=(0.2, 0.28),
            dual_clip=config["dual_clip"],
            loss_agg_mode=config["loss_agg_mode"],
            policy_loss_type=config["policy_loss_type"],
            aux_loss_coef=0.0,
            entropy_coef=config["entropy_coef"],
        ),
        algo=ns(
            advantage=ns(
                is_correction_level="off",
                is_correction_mode="mask",
                is_correction_gating="ratio",
                is_correction_threshold=(0.5, 5.0),
            ),
            kl=ns(use_loss=True, init_coef=0.01, estimator=config["estimator"], unbiased_gradient=False),
        ),
        ds=ns(packing_samples=False),
        vllm=ns(sync_backend="gloo"),
    )


def _experience(actor_module, Experience):
    """A micro-batch as OpenRLHF's rollout leaves it: prompts then responses (ragged, one empty), the action mask a
    bool tensor, old / reference log-probs near the model's own, per-token advantages."""
    g = torch.Generator().manual_seed(1)
    sequences = torch.randint(0, V, (B, PROMPT + RESPONSE), generator=g)
    lengths = torch.tensor([6, 3, 0, 5])
    action_mask = torch.arange(RESPONSE)[None, :] < lengths[:, None]
    attention_mask = torch.cat([torch.ones(B, PROMPT, dtype=torch.long), action_mask.long()], dim=1)
    with torch.no_grad():
        current = actor_module(sequences, action_mask, attention_mask=attention_mask)
    old = (current + 0.3 * torch.randn(B, RESPONSE, generator=g)) * action_mask
    base = (current + 0.5 * torch.randn(B, RESPONSE, generator=g)) * action_mask
    advantages = (torch.randn(B, 1, generator=g) * 1.5).expand(B, RESPONSE) * action_mask
    return Experience(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=action_mask,
        action_log_probs=old,
        base_action_log_probs=base,
        advantages=advantages.contiguous(),
    )


def training_step(config_name: str) -> dict:
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf.models import Actor
    from openrlhf.trainer.ppo_utils.experience import Experience
    from transformers import LlamaConfig, LlamaForCausalLM

    config = CONFIGS[config_name]
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=V,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
            attn_implementation="eager",
        )
    )
    actor = Actor(model, temperature=0.9)
    actor.packing_samples = False  # set only on Actor's from-a-path branch; OpenRLHF never builds one from a model
    backpropagated = []

    def backward(loss, model, optimizer):
        backpropagated.append(loss.detach())
        loss.backward()

    ns = types.SimpleNamespace
    strategy = ns(
        args=_args(config),
        ring_attn_group=None,
        backward=backward,
        optimizer_step=lambda *args, **kwargs: None,
        get_grad_norm=lambda model: 0.0,
    )
    # what needs CUDA or a process group, neither of which the loss touches: the replay buffer (it picks a CUDA
    # device when built; training_step reads it only with dynamic batches) and the trainer's closing barrier
    ppo_actor.NaiveReplayBuffer = lambda *args, **kwargs: None
    ppo_actor.torch_dist_barrier_and_cuda_sync = lambda: None
    trainer = ppo_actor.ActorPPOTrainer(
        strategy, actor, None, None, ns(get_last_lr=lambda: [1e-6]), micro_train_batch_size=B, vllm_engines=None
    )
    experience = _experience(actor, Experience)
    mask = experience.action_mask
    info = dict(
        dp_size=2,
        batch_num_tokens=mask.sum().float() + OTHER_RANK_TOKENS,
        global_batch_size=(mask.sum(-1) > 0).sum().float() + OTHER_RANK_SAMPLES,
    )
    status = trainer.training_step(experience, kl_ctl=0.01, step=0, loss_batch_info=info)
    metrics = {
        k: float(v.float().mean())
        for k, v in status["metrics"].items()
        if isinstance(v, torch.Tensor) and v.numel() > 0
    }
    return {
        "loss": float(backpropagated[0]),
        "metrics": metrics,
        "grads": {name: p.grad.detach().clone() for name, p in model.named_parameters()},
        "names": names_in_use(),
    }


def group_norm_advantages(rewards, group_size: int) -> torch.Tensor:
    """OpenRLHF's own ``RemoteExperienceMaker.compute_advantages_and_returns`` with ``--algo.advantage.estimator
    group_norm`` and its default ``--reward.clip_range`` (-10, 10), on one experience of ``rewards`` (a prompt's
    ``group_size`` completions after another), KL 0: each completion's advantage (every token's is the same)."""
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    ns = types.SimpleNamespace
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    B, A = rewards.shape[0], 3
    args = ns(
        rollout=ns(n_samples_per_prompt=group_size),
        reward=ns(clip_range=(-10.0, 10.0)),
        algo=ns(advantage=ns(estimator="group_norm", gamma=1.0, no_std_norm=False)),
    )
    maker = ns(strategy=ns(args=args), kl_ctl=ns(value=0.0), advantage_estimator="group_norm")
    maker.get_cumulative_returns = lambda *a, **k: RemoteExperienceMaker.get_cumulative_returns(maker, *a, **k)
    experience = Experience(
        rewards=rewards, index=list(range(B)), kl=torch.zeros(B, A), action_mask=torch.ones(B, A, dtype=torch.bool)
    )
    (out,) = RemoteExperienceMaker.compute_advantages_and_returns(maker, [experience])
    return out.advantages[:, 0]
