"""verl's Megatron backend on our vocabulary-parallel kernels: after ``patch_logprobs()``, verl's
``vocab_parallel_log_probs_from_logits`` and ``vocab_parallel_entropy`` (each rank holding a slice of
the vocabulary, Megatron's tensor-parallel layout) give verl's own values and gradients, on 2 and 4
gloo ranks with Megatron's parallel state initialized (megatron-core runs on the CPU)."""

import pytest
import torch
from gloo_ranks import run_ranks
from helpers import megatron_output_layer

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


# ---- verl's Megatron fused postprocess (use_fused_kernels): d hidden through the caller's own mappings ---------------
#
# verl's ``fused_output_processor`` (Megatron's output-processor hook; its legacy ``_fused_GPTModel_forward`` runs the
# same lines) gathers the hidden states with Megatron's ``gather_from_sequence_parallel_region`` when
# ``config.sequence_parallel`` (its backward reduce-scatters: the sum of d hidden over the tensor-parallel group), then
# calls ``linear_cross_entropy(hidden, weight_shard, labels, T, "none", tp_group)``: ours after ``patch_logprobs``.
# Megatron's mappings and ``ColumnParallelLinear`` run here as installed, on gloo; the one change is that
# ``torch.cuda.current_device`` names the CPU, where they allocate their gather buffers.

# sequences packed as THD (one row); "padded": each sequence padded to a multiple of 2 TP, as verl's
# preprocess_packed_seqs aligns them, the pads' labels id 0 and out of the loss
LENGTHS = (5, 3, 4)
FUSED_H, FUSED_V, FUSED_T = 8, 24, 0.7


def _thd_layout(world: int, padded: bool):
    """(the THD length, which positions count) of ``LENGTHS`` packed for TP ``world``."""
    align = 2 * world if padded else 1
    counted = []
    for n in LENGTHS:
        width = -(-n // align) * align
        counted += [True] * n + [False] * (width - n)
    while len(counted) % world:  # sequence parallelism splits the sequence dim evenly over the group
        counted.append(False)
    return len(counted), torch.tensor(counted)


def _fused_case(world: int, padded: bool):
    g = torch.Generator().manual_seed(3)
    s, counted = _thd_layout(world, padded)
    hidden = torch.randn(s, 1, FUSED_H, generator=g)
    weight = 0.5 * torch.randn(FUSED_V, FUSED_H, generator=g)
    labels = torch.where(counted, torch.randint(0, FUSED_V, (s,), generator=g), 0).view(1, s)
    weights = torch.randn(2, s, generator=g) * counted
    return hidden, weight, labels, weights


def _unsharded(hidden, weight, labels, weights):
    """log-probs, entropy, d hidden [s, 1, H], d weight of sum w1 logp + w2 H on one process, in plain torch."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp_all = torch.log_softmax((h.reshape(-1, FUSED_H) @ w.T) / FUSED_T, dim=-1)
    logp = logp_all.gather(-1, labels.view(-1, 1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    ((weights[0] * logp).sum() + (weights[1] * entropy).sum()).backward()
    return logp.detach(), entropy.detach(), h.grad, w.grad


def _fused_postprocess_rank(rank, world, layouts):
    """Each (sequence_parallel, padded) layout of ``layouts`` through verl's fused postprocess with our patch, and
    Megatron's own head on the same shard, in one launch (the ranks' imports are most of a launch's time)."""
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core warns that Transformer Engine and Apex are absent
    torch.cuda.current_device = lambda: "cpu"  # Megatron's mappings allocate their buffers there
    from megatron.core import parallel_state, tensor_parallel

    from grpo_kernels.integration import verl as adapter

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    adapter.patch_logprobs()
    results = []
    for sequence_parallel, padded in layouts:
        hidden_all, weight_all, labels, weights = _fused_case(world, padded)
        s, part = hidden_all.shape[0], FUSED_V // world
        rows = slice(rank * s // world, (rank + 1) * s // world) if sequence_parallel else slice(None)
        shard = slice(rank * part, (rank + 1) * part)

        def through_verl(loss_weights, rows=rows, shard=shard, hidden_all=hidden_all, weight_all=weight_all,
                         labels=labels, sequence_parallel=sequence_parallel):  # fmt: skip
            hidden = hidden_all[rows].clone().requires_grad_()
            weight = weight_all[shard].clone().requires_grad_()
            out = _verls_fused_postprocess(hidden, weight, labels, sequence_parallel)
            logp, entropy = out.log_probs.reshape(-1), out.entropy.reshape(-1)
            ((loss_weights[0] * logp).sum() + (loss_weights[1] * entropy).sum()).backward()
            return logp.detach(), entropy.detach(), hidden.grad, weight.grad

        ours = through_verl(weights)
        # Megatron's own head: ColumnParallelLinear (its input mapping reduces d hidden), vocab_parallel_cross_entropy
        head = megatron_output_layer(world, weight_all[shard], sequence_parallel=sequence_parallel)
        hidden = hidden_all[rows].clone().requires_grad_()
        logits, _ = head(hidden)
        logp = -tensor_parallel.vocab_parallel_cross_entropy(logits / FUSED_T, labels.view(-1, 1)).reshape(-1)
        (weights[0] * logp).sum().backward()
        megatron = (logp.detach(), hidden.grad, head.weight.grad)
        ours_logp_only = through_verl(weights * torch.tensor([[1.0], [0.0]]))
        results.append((ours, megatron, ours_logp_only))
    return results, _reduce_hidden_grad(rank, world)


FUSED_LAYOUTS = {  # (sequence_parallel, padded) cases a launch
    2: [(True, False), (True, True), (False, False), (False, True)],
    4: [(True, True), (False, False)],
}


@pytest.mark.parametrize("world", [2, 4])
def test_verls_megatron_fused_path_gives_the_unsharded_gradients(world):
    """Through verl's own fused postprocess with our patch, TP 2 and 4, sequence parallelism on (verl's default for
    TP > 1: the gather's reduce-scatter sums d hidden) and off (nothing else sums it), THD-packed with and without
    verl's alignment padding: log-probs, entropy, d hidden and d weight equal the unsharded model's, and Megatron's own
    ColumnParallelLinear + vocab_parallel_cross_entropy (log-probs, d hidden, d weight). Before the contract, d
    hidden was TP x the unsharded one with sequence parallelism on. Also the op's contract by itself:
    reduce_hidden_grad=True gives every rank the summed d hidden, False this rank's share, whose sum is the same."""
    layouts = FUSED_LAYOUTS[world]
    ranks = run_ranks(_fused_postprocess_rank, world, layouts, timeout=600)
    tight = dict(atol=1e-5, rtol=1e-5)
    for case, (sequence_parallel, padded) in enumerate(layouts):
        hidden, weight, labels, weights = _fused_case(world, padded)
        logp, entropy, d_hidden, d_weight = _unsharded(hidden, weight, labels, weights)
        s, part = hidden.shape[0], FUSED_V // world
        for rank, (results, _) in enumerate(ranks):
            ours, megatron, ours_logp_only = results[case]
            rows = slice(rank * s // world, (rank + 1) * s // world) if sequence_parallel else slice(None)
            shard = slice(rank * part, (rank + 1) * part)
            where = f"sequence_parallel={sequence_parallel}, padded={padded}, rank {rank}"
            for name, got, want in (
                ("log-probs", ours[0], logp),
                ("entropy", ours[1], entropy),
                ("d hidden", ours[2], d_hidden[rows]),
                ("d weight", ours[3], d_weight[shard]),
                ("Megatron's log-probs", ours_logp_only[0], megatron[0]),
                ("Megatron's d hidden", ours_logp_only[2], megatron[1]),
                ("Megatron's d weight", ours_logp_only[3], megatron[2]),
            ):
                torch.testing.assert_close(got, want, **tight, msg=lambda m, n=name, w=where: f"{n}, {w}: {m}")
    shares = [share for _, (_, share) in ranks]
    total = sum(shares)
    for _, (summed, share) in ranks:
        torch.testing.assert_close(summed, total, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(share, total)


def _verls_fused_postprocess(hidden, weight, labels, sequence_parallel: bool):
    """verl's own ``fused_output_processor`` (its Megatron postprocess with ``use_fused_kernels``: Megatron's
    sequence-parallel gather, then the head, ours once patched) on this rank's hidden states and weight rows."""
    import types

    from verl.models.mcore import model_forward_fused

    return model_forward_fused.fused_output_processor(
        hidden_states=hidden,
        output_layer=None,
        output_weight=weight,
        labels=labels,
        context=model_forward_fused.FusedOutputProcessorContext(temperature=FUSED_T),
        config=types.SimpleNamespace(sequence_parallel=sequence_parallel, config_logger_dir=""),
    )


def _reduce_hidden_grad(rank, world):
    """(d hidden with reduce_hidden_grad=True, with False) of one fused head call on this rank's vocabulary shard."""
    import torch.distributed as dist

    from grpo_kernels import linear_selective_log_softmax

    hidden, weight, labels, _ = _fused_case(world, False)
    part = FUSED_V // world
    grads = []
    for reduce_hidden_grad in (True, False):
        h = hidden.reshape(-1, FUSED_H).clone().requires_grad_()
        logp = linear_selective_log_softmax(
            h,
            weight[rank * part : (rank + 1) * part],
            labels.view(-1),
            temperature=FUSED_T,
            vocab_parallel_group=dist.group.WORLD,
            reduce_hidden_grad=reduce_hidden_grad,
        )
        logp.sum().backward()
        grads.append(h.grad)
    return grads


# ---- verl's context-parallel layout (preprocess_packed_seqs / postprocess_packed_seqs) with our patch ----------------
#
# verl's Megatron engine packs each sequence as THD and, with context parallelism, gives each CP rank two of its 2 CP
# zigzag chunks (``preprocess_packed_seqs``); the per-token log-probs and entropy computed on a rank's tokens (each
# TP rank on its vocabulary slice: our patched functions) are all-gathered over the CP group
# (``postprocess_packed_seqs``, whose own rank's part keeps its gradient) and the loss is taken on whole sequences.

CP_B, CP_T, CP_V_SHARD, CP_H, CP_LENGTHS = 3, 9, 8, 4, (9, 5, 7)


def _cp_case(tp: int):
    g = torch.Generator().manual_seed(11)
    V = CP_V_SHARD * tp
    logits = 3 * torch.randn(CP_B, CP_T, V, generator=g)
    labels = torch.randint(0, V, (CP_B, CP_T), generator=g)
    attention_mask = torch.arange(CP_T)[None] < torch.tensor(CP_LENGTHS)[:, None]
    weights = torch.randn(2, CP_B, CP_T, generator=g)
    return logits, labels, attention_mask, weights


def _context_parallel_rank(rank, world, tp, cp):
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core warns that Transformer Engine and Apex are absent
    from megatron.core import parallel_state as mpu
    from verl.models.mcore.util import postprocess_packed_seqs, preprocess_packed_seqs
    from verl.utils.megatron import tensor_parallel

    from grpo_kernels.integration import verl as adapter

    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    adapter.patch_logprobs()
    logits, labels, attention_mask, weights = _cp_case(tp)
    shard = slice(
        mpu.get_tensor_model_parallel_rank() * CP_V_SHARD, (mpu.get_tensor_model_parallel_rank() + 1) * CP_V_SHARD
    )
    packed, params = preprocess_packed_seqs(logits[..., shard], attention_mask, pre_process=True)
    packed_labels, _ = preprocess_packed_seqs(labels, attention_mask, pre_process=True)
    lp_leaf, h_leaf = packed.clone().requires_grad_(), packed.clone().requires_grad_()
    logp = tensor_parallel.vocab_parallel_log_probs_from_logits(lp_leaf, packed_labels)
    entropy = tensor_parallel.vocab_parallel_entropy(h_leaf)
    whole = [postprocess_packed_seqs(t, params, attention_mask, CP_B, CP_T) for t in (logp, entropy)]
    ((weights[0] * whole[0] * attention_mask).sum() + (weights[1] * whole[1] * attention_mask).sum()).backward()
    # the one-process gradient at this rank's tokens and slice, packed as verl packs them
    full = logits.clone().requires_grad_()
    logp_all = torch.log_softmax(full, -1)
    ref_logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_entropy = -(logp_all.exp() * logp_all).sum(-1)
    ((weights[0] * ref_logp * attention_mask).sum() + (weights[1] * ref_entropy * attention_mask).sum()).backward()
    expected_grad, _ = preprocess_packed_seqs(full.grad[..., shard], attention_mask, pre_process=True)
    return (
        [t.detach() for t in whole],
        [ref_logp.detach() * attention_mask, ref_entropy.detach() * attention_mask],
        lp_leaf.grad + h_leaf.grad,
        expected_grad,
        _fused_context_parallel(tp, shard, params, attention_mask, labels, weights),
    )


def _fused_context_parallel(tp, shard, params, attention_mask, labels, weights):
    """verl's fused postprocess under TP x CP with sequence parallelism: this CP rank's packed hidden states [s, 1, H]
    split over the TP group, through verl's own ``fused_output_processor`` (Megatron's gather, our patched head on
    this rank's weight rows) and ``postprocess_packed_seqs``; (the whole log-probs and entropy, d hidden, d weight
    summed over the CP group) against one process's (the same, at this rank's tokens and rows)."""

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from verl.models.mcore.util import postprocess_packed_seqs, preprocess_packed_seqs

    torch.cuda.current_device = lambda: "cpu"  # Megatron's mappings allocate their buffers there
    g = torch.Generator().manual_seed(12)
    hidden_all = torch.randn(CP_B, CP_T, CP_H, generator=g)
    weight_all = 0.5 * torch.randn(CP_V_SHARD * tp, CP_H, generator=g)

    def sequence_parallel_part(t):  # verl's packed [1, total, H] as Megatron's [s, 1, H], this TP rank's s rows
        seq_first = t.transpose(0, 1)
        part = seq_first.shape[0] // tp
        return seq_first[mpu.get_tensor_model_parallel_rank() * part :][:part]

    packed_hidden, _ = preprocess_packed_seqs(hidden_all, attention_mask, pre_process=True)
    packed_labels, _ = preprocess_packed_seqs(labels, attention_mask, pre_process=True)
    hidden = sequence_parallel_part(packed_hidden).clone().requires_grad_()
    weight = weight_all[shard].clone().requires_grad_()
    out = _verls_fused_postprocess(hidden, weight, packed_labels, sequence_parallel=True)
    whole = [
        postprocess_packed_seqs(t.reshape(packed_labels.shape), params, attention_mask, CP_B, CP_T)
        for t in (out.log_probs, out.entropy)
    ]
    ((weights[0] * whole[0] * attention_mask).sum() + (weights[1] * whole[1] * attention_mask).sum()).backward()
    d_weight = weight.grad.clone()
    dist.all_reduce(d_weight, group=mpu.get_context_parallel_group())
    # one process on the whole batch
    h, w = hidden_all.clone().requires_grad_(), weight_all.clone().requires_grad_()
    logp_all = torch.log_softmax((h @ w.T) / FUSED_T, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    ((weights[0] * logp * attention_mask).sum() + (weights[1] * entropy * attention_mask).sum()).backward()
    expected_hidden_grad, _ = preprocess_packed_seqs(h.grad, attention_mask, pre_process=True)
    return (
        [t.detach() for t in whole] + [hidden.grad, d_weight],
        [logp.detach() * attention_mask, entropy.detach() * attention_mask]
        + [sequence_parallel_part(expected_hidden_grad), w.grad[shard]],
    )


@pytest.mark.parametrize("tp, cp", [(2, 2)])  # (CP 2 alone is this layout's CP dimension: one launch for CI's time)
def test_verls_context_parallel_layout_on_our_functions_equals_one_process(tp, cp):
    """TP 2 x CP 2 (4 gloo ranks) through verl's own preprocess_packed_seqs (each CP rank two zigzag chunks
    of every sequence, aligned to 2 TP CP) and postprocess_packed_seqs (the CP all-gather) around our patched
    vocabulary-parallel log-probs and entropy: every rank's whole-sequence log-probs and entropy, and its gradient at
    its own tokens and vocabulary slice, equal one process on the unsharded logits. And verl's fused postprocess in
    the same layout with sequence parallelism (Megatron's gather, our patched head): whole-sequence log-probs and
    entropy, d hidden at this rank's tokens and d weight (summed over the CP group) equal one process."""
    for whole, expected, grad, expected_grad, fused in run_ranks(_context_parallel_rank, tp * cp, tp, cp, timeout=600):
        for name, got, want in zip(("log-probs", "entropy"), whole, expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5)
        for name, got, want in zip(("log-probs", "entropy", "d hidden", "d weight"), *fused, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"fused path, {n}: {m}")
