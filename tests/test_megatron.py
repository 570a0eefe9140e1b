"""The Megatron adapter (``grpo_kernels.integration.megatron``) against megatron-core 0.16's own functions, on 2 and 4
gloo ranks with Megatron's parallel state (tensor parallelism) initialized: ``vocab_parallel_cross_entropy`` equals
Megatron's in loss and d logits; the log-probs and entropy from vocabulary-parallel logits, and from the fused output
layer, equal one process on the whole vocabulary; the fused output layer equals Megatron's own ``ColumnParallelLinear``
+ ``vocab_parallel_cross_entropy`` in log-probs, d hidden, d weight and d bias, with sequence parallelism on (the
hidden states split by sequence, gathered by Megatron's own mapping) and off; and a whole ``GPTModel`` step through
the fused output layer equals Megatron's own, every parameter's gradient. Megatron's mappings allocate their buffers on
``torch.cuda.current_device()``: the one change here is that it names the CPU."""

import pytest
import torch
from gloo_ranks import run_ranks
from helpers import megatron_output_layer

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'grpo-kernels[megatron]')")

S, B, H, T = 8, 2, 6, 0.7  # Megatron's [s, b] layout; s divisible by TP 4 (sequence parallelism splits it)
OUTPUT_LAYER_CASES = ((True, False), (False, True))  # (sequence_parallel, bias)


def _case(world: int, seed: int = 0):
    """The whole problem: logits [s, b, V], hidden states [s, b, H], the head's weight [V, H] and bias [V], the
    target [s, b] and the loss's weights [2, s, b] (log-probs, entropy)."""
    V = 5 * world
    g = torch.Generator().manual_seed(seed)
    return {
        "logits": 3 * torch.randn(S, B, V, generator=g),
        "hidden": torch.randn(S, B, H, generator=g),
        "weight": 0.5 * torch.randn(V, H, generator=g),
        "bias": torch.randn(V, generator=g),
        "target": torch.randint(0, V, (S, B), generator=g),
        "weights": torch.randn(2, S, B, generator=g),
    }


def _unsharded(x: dict, logits: torch.Tensor):
    """(log-probs, entropy, d logits) at temperature T of sum w0 logp + w1 H, on one process, in plain torch."""
    leaf = logits.clone().requires_grad_()
    logp_all = torch.log_softmax(leaf / T, dim=-1)
    logp = logp_all.gather(-1, x["target"].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    ((x["weights"][0] * logp).sum() + (x["weights"][1] * entropy).sum()).backward()
    return logp.detach(), entropy.detach(), leaf.grad


def _rank(rank, world):
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core warns that Transformer Engine and Apex are absent
    torch.cuda.current_device = lambda: "cpu"  # Megatron's mappings allocate their buffers there
    from megatron.core import parallel_state, tensor_parallel

    from grpo_kernels.integration import megatron as adapter

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    x = _case(world)
    V = x["logits"].shape[-1]
    shard = slice(rank * V // world, (rank + 1) * V // world)
    mine, target, w = x["logits"][..., shard].contiguous(), x["target"], x["weights"]

    # vocab_parallel_cross_entropy: Megatron's (on a copy: it shifts fp32 logits in place) and ours
    results = {}
    for name, ce in (
        ("megatron", tensor_parallel.vocab_parallel_cross_entropy),
        ("ours", adapter.vocab_parallel_cross_entropy),
    ):
        leaf = mine.clone().requires_grad_()
        loss = ce(leaf.clone() if name == "megatron" else leaf, target)
        (w[0] * loss).sum().backward()
        results[name] = (loss.detach(), leaf.grad)
    results["ours reads, never writes"] = torch.equal(leaf.detach(), mine)

    # log-probs and entropy from the shards
    leaf = mine.clone().requires_grad_()
    logp, entropy = adapter.vocab_parallel_logprobs_and_entropy(leaf, target, temperature=T)
    ((w[0] * logp).sum() + (w[1] * entropy).sum()).backward()
    results["logprobs and entropy"] = (logp.detach(), entropy.detach(), leaf.grad)

    # the fused output layer against Megatron's ColumnParallelLinear + vocab_parallel_cross_entropy
    for sequence_parallel, bias in OUTPUT_LAYER_CASES:
        head = megatron_output_layer(world, x["weight"][shard], x["bias"][shard] if bias else None, sequence_parallel)
        rows = slice(rank * S // world, (rank + 1) * S // world) if sequence_parallel else slice(None)
        found = {}
        for name in ("megatron", "ours", "ours with entropy"):
            head.zero_grad(set_to_none=True)
            hidden = x["hidden"][rows].clone().requires_grad_()
            entropy = None
            if name == "megatron":
                logits, _ = head(hidden)
                logp = -tensor_parallel.vocab_parallel_cross_entropy(logits / T, target)
            elif name == "ours":
                logp = adapter.output_layer_logprobs(head, hidden, target, temperature=T)
            else:
                logp, entropy = adapter.output_layer_logprobs(head, hidden, target, temperature=T, compute_entropy=True)
            loss = (w[0] * logp).sum() + (0.0 if entropy is None else (w[1] * entropy).sum())
            loss.backward()
            found[name] = (
                logp.detach(),
                None if entropy is None else entropy.detach(),
                hidden.grad,
                head.weight.grad,
                None if not bias else head.bias.grad,
            )
        results[("output layer", sequence_parallel, bias)] = found
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_the_megatron_drop_ins_equal_megatron_and_one_process(world):
    x = _case(world)
    V = x["logits"].shape[-1]
    tight = dict(atol=1e-5, rtol=1e-5)
    logp, entropy, d_logits = _unsharded(x, x["logits"])
    plain_logp = torch.log_softmax(x["logits"], -1).gather(-1, x["target"].unsqueeze(-1)).squeeze(-1)
    head_logits = x["hidden"] @ x["weight"].T
    for rank, results in enumerate(run_ranks(_rank, world, timeout=600)):
        shard = slice(rank * V // world, (rank + 1) * V // world)
        where = f"TP {world}, rank {rank}"
        (m_loss, m_grad), (o_loss, o_grad) = results["megatron"], results["ours"]
        torch.testing.assert_close(o_loss, m_loss, **tight, msg=lambda m, w=where: f"cross entropy, {w}: {m}")
        torch.testing.assert_close(o_loss, -plain_logp, **tight, msg=lambda m: f"cross entropy vs one process: {m}")
        torch.testing.assert_close(
            o_grad, m_grad, **tight, msg=lambda m, w=where: f"cross entropy's d logits, {w}: {m}"
        )
        assert results["ours reads, never writes"], where
        lp, h, grad = results["logprobs and entropy"]
        torch.testing.assert_close(lp, logp, **tight)
        torch.testing.assert_close(h, entropy, **tight)
        torch.testing.assert_close(grad, d_logits[..., shard], **tight)
        for sequence_parallel, bias in OUTPUT_LAYER_CASES:
            found = results[("output layer", sequence_parallel, bias)]
            case = f"{where}, sequence_parallel={sequence_parallel}, bias={bias}"
            megatron, ours, with_entropy = found["megatron"], found["ours"], found["ours with entropy"]
            for what, i in (("log-probs", 0), ("d hidden", 2), ("d weight", 3), ("d bias", 4)):
                if megatron[i] is None:
                    continue
                torch.testing.assert_close(
                    ours[i], megatron[i], **tight, msg=lambda m, w=what, c=case: f"{w}, {c}: {m}"
                )
            logits = head_logits + (x["bias"] if bias else 0.0)
            full_logp, full_entropy, _ = _unsharded(x, logits)
            torch.testing.assert_close(with_entropy[0], full_logp, **tight)
            torch.testing.assert_close(with_entropy[1], full_entropy, **tight)


def test_label_smoothing_is_refused_by_name():
    from grpo_kernels.integration.megatron import vocab_parallel_cross_entropy

    logits, target = torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"label_smoothing=0.1 is not supported"):
        vocab_parallel_cross_entropy(logits, target, label_smoothing=0.1)


def test_a_logits_shape_that_is_not_megatrons_layout_is_named():
    from grpo_kernels.integration.megatron import vocab_parallel_logprobs_and_entropy

    with pytest.raises(ValueError, match=r"vocab_parallel_logits must be \[\*target.shape, ...\] = \[2, 3, ...\]"):
        vocab_parallel_logprobs_and_entropy(torch.zeros(3, 2, 4), torch.zeros(2, 3, dtype=torch.long))


def _gpt_model_rank(rank, world):
    """megatron-core's own ``GPTModel`` (2 layers, its local layer spec, TP ``world``) on this rank, one step each way:
    Megatron's output layer + ``vocab_parallel_cross_entropy``, and the fused output layer on the hidden states its
    postprocess hands the output layer. (The log-probs, every parameter's gradient) of both."""
    import contextlib
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core warns that Transformer Engine and Apex are absent
    torch.cuda.current_device = lambda: "cpu"  # Megatron's mappings allocate their buffers there
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from grpo_kernels.integration import megatron as adapter

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    # no dropout anywhere, so no CUDA RNG state is needed: its tracker's fork (CUDA-only) does nothing here
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=4, tensor_model_parallel_size=world,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, attention_dropout=0.0,
        hidden_dropout=0.0,
    )  # fmt: skip
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=16,
        share_embeddings_and_output_weights=False,
    )  # fmt: skip
    b, s = 2, 8
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 32, (b, s), generator=g), torch.randint(0, 32, (s, b), generator=g)
    weights = torch.randn(s, b, generator=g)
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).expand(b, 1, s, s)  # (CPU: given, not made)
    found = {}
    for name in ("megatron", "ours"):
        model.zero_grad(set_to_none=True)
        seen = {}
        hook = model.output_layer.register_forward_pre_hook(
            lambda layer, args, seen=seen: seen.setdefault("hidden", args[0])
        )
        logits = model(ids, positions, attention_mask=causal)  # [b, s, V / TP]
        hook.remove()
        if name == "megatron":
            logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous() / T, labels)
        else:  # the hidden states [s, b, H] the postprocess gave the output layer, through the fused head instead
            logp = adapter.output_layer_logprobs(model.output_layer, seen["hidden"], labels, temperature=T)
        (weights * logp).sum().backward()
        found[name] = (logp.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    return found


def test_a_gpt_models_step_through_the_fused_output_layer_equals_megatrons():
    """A whole megatron-core ``GPTModel`` step on 2 ranks (TP 2; without sequence parallelism, which its torch
    LayerNorm refuses on the CPU): the log-probs and the gradient of every parameter (embedding, attention, MLP,
    norms, the output layer's rows) through our fused output layer equal Megatron's own output layer + cross entropy."""
    for rank, found in enumerate(run_ranks(_gpt_model_rank, 2, timeout=600)):
        (m_logp, m_grads), (o_logp, o_grads) = found["megatron"], found["ours"]
        torch.testing.assert_close(o_logp, m_logp, atol=1e-5, rtol=1e-5)
        assert o_grads.keys() == m_grads.keys() and "output_layer.weight" in o_grads and len(o_grads) > 20
        for name, grad in m_grads.items():
            scale = max(1.0, grad.abs().max().item())
            torch.testing.assert_close(
                o_grads[name], grad, atol=1e-5 * scale, rtol=1e-5, msg=lambda m, n=name, r=rank: f"{n}, rank {r}: {m}"
            )
