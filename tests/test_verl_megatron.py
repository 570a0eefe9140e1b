"""verl's Megatron backend on our vocabulary-parallel kernels: after ``patch_logprobs()``, verl's
``vocab_parallel_log_probs_from_logits`` and ``vocab_parallel_entropy`` (each rank holding a slice of
the vocabulary, Megatron's tensor-parallel layout) give verl's own values and gradients, on 2 and 4
gloo ranks with Megatron's parallel state initialized (megatron-core runs on the CPU)."""

import pytest
import torch
from gloo_ranks import run_ranks

pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed (pip install --no-deps verl)")
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install --no-deps megatron-core)")

B, T = 3, 5


def _gradients(lp_fn, entropy_fn, logits, ids, weights):
    """Values of both functions and d(sum w1 lp + w2 H)/d logits, with separate leaves (verl's
    entropy works in place on its input, as verl's engine knows: it passes a clone)."""
    lp_leaf, h_leaf = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    lp, entropy = lp_fn(lp_leaf, ids), entropy_fn(h_leaf)
    ((lp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    return lp.detach().float(), entropy.detach().float(), lp_leaf.grad, h_leaf.grad


def _rank(rank, world, packed):
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core warns that Transformer Engine and Apex are absent
    from megatron.core import parallel_state
    from verl.utils.megatron import tensor_parallel

    from grpo_kernels.integration import verl as adapter

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    g = torch.Generator().manual_seed(0)
    V = 9 * world
    logits, ids = 3 * torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g)
    weights = torch.randn(2, B, T, generator=g)
    if packed:  # verl's remove-padding layout: [total_nnz, V / P]
        logits, ids, weights = logits.reshape(B * T, V), ids.reshape(-1), weights.reshape(2, -1)
    part = V // world
    mine = logits[..., rank * part : (rank + 1) * part].contiguous()
    theirs = _gradients(
        tensor_parallel.vocab_parallel_log_probs_from_logits, tensor_parallel.vocab_parallel_entropy, mine, ids, weights
    )
    originals = (
        tensor_parallel.vocab_parallel_log_probs_from_logits,
        tensor_parallel.vocab_parallel_entropy,
        tensor_parallel.vocab_parallel_entropy_with_chunking,
    )
    adapter.patch_logprobs()
    patched = (
        tensor_parallel.vocab_parallel_log_probs_from_logits,
        tensor_parallel.vocab_parallel_entropy,
        tensor_parallel.vocab_parallel_entropy_with_chunking,
    )
    assert all(p is not o for p, o in zip(patched, originals, strict=True)), (
        "patch_logprobs left verl's Megatron functions"
    )
    ours = _gradients(patched[0], patched[1], mine, ids, weights)
    chunked = patched[2](mine, chunk_size=2)
    return theirs, ours, chunked


@pytest.mark.parametrize("world, packed", [(2, False), (2, True), (4, False)])
def test_verl_megatron_log_probs_and_entropy_are_ours_and_equal_verls(world, packed):
    for theirs, ours, chunked in run_ranks(_rank, world, packed, timeout=600):
        for name, expected, actual in zip(
            ("log-probs", "entropy", "d log-probs", "d entropy"), theirs, ours, strict=True
        ):
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(chunked.float(), theirs[1], atol=1e-5, rtol=1e-5)
