"""Context parallelism inside the loss (``context_parallel_group``): on 2 gloo ranks, each holding Megatron's zigzag
chunks of every sequence (chunks r and 2 CP - 1 - r of 2 CP), padded [B, T / CP] and packed THD (each sequence's
length a multiple of 2 CP, this rank's ``cu_seqlens``), from logits and from hidden states: the loss and metrics on
every rank, and each rank's per-token log-probs and gradients at its own tokens, equal one process on the whole batch
(fp32, 1e-5), for the token mean over rows, the batch token mean, the token-count default, the prompt mean, GSPO and
GSPO-token, the entropy bonus and KL, and a verl rollout-correction preset; the masked tokens hold garbage (NaN
log-probs, ids of -100). The d weight of the fused head, summed over the ranks, is the whole batch's. The refusals
come by name. SFT, RFT and DPO alike, the distillation losses (top-k in verl's and TRL's conventions, reverse KL) and
the loss over the sampler's kept sets. Tensor x context parallelism through megatron-core's own groups (4 ranks):
from vocabulary-parallel logits and from the head's row shard with sequence parallelism on and off; and the log-prob
family, which needs no group (log-probs, entropy, sum pi^2, a teacher's top-k on each rank's packed chunks)."""

import functools

import pytest
import torch
from gloo_ranks import run_ranks

from grpo_kernels import (
    GRPOOptions,
    KeptSet,
    dpo_loss,
    fused_linear_grpo_loss,
    grpo_loss,
    reverse_kl_distillation_loss,
    rft_loss,
    sft_loss,
    token_logprobs,
    topk_distillation_loss,
    topk_logprobs,
)

CP = 2
LENGTHS = (
    8,
    4,
    12,
    8,
)  # each a multiple of 2 CP (Megatron pads each sequence so); the padded layout's T is the longest
V, H = 12, 6
CASES = (
    dict(loss_type="grpo"),
    dict(loss_type="bnpo", beta=0.04),
    dict(loss_type="dapo", entropy_coef=0.01),
    dict(loss_type="grpo", aggregation="prompt_mean"),
    dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.02),
    dict(loss_type="dapo", importance_sampling_level="sequence_token"),
    dict(loss_type="vespo"),
    dict(loss_type="dapo", rollout_correction="decoupled_geo_rs_seq_tis"),
)


def _problem(seed=0):
    """The whole batch, padded [B, T] (T the longest sequence), with garbage where the mask is 0."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(LENGTHS), max(LENGTHS)
    valid = torch.arange(T) < torch.tensor(LENGTHS).unsqueeze(1)
    mask = valid & (torch.rand(B, T, generator=g) > 0.2)  # a few tokens inside each sequence masked too
    x = {
        "hidden": torch.randn(B, T, H, generator=g),
        "weight": 0.7 * torch.randn(V, H, generator=g),
        "ids": torch.randint(0, V, (B, T), generator=g).masked_fill(~mask, -100),
        "mask": mask.float(),
        "advantages": torch.randn(B, generator=g),
        "old": (-2 * torch.rand(B, T, generator=g)).masked_fill(~mask, float("nan")),
        "ref": (-2 * torch.rand(B, T, generator=g)).masked_fill(~mask, float("nan")),
        "sampling": (-2 * torch.rand(B, T, generator=g)).masked_fill(~mask, float("nan")),
        "prompt_ids": torch.tensor([0, 1, 0, 1]),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 1.0]),
    }
    x["logits"] = x["hidden"] @ x["weight"].T
    return x


def _close(actual, expected, label: str) -> None:
    """fp32's tolerance: 1e-5 relative, 1e-6 of the tensor's largest magnitude absolute (a head's gradient sums many
    tokens' terms, some of them large: the KL's e^(ref - logp)); the case and torch's report of the gap on failure."""
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6 * scale, msg=lambda report: f"{label}: {report}")


def _same_output(out, whole, label: str) -> None:
    """A context-parallel call's loss and every metric are the whole batch's (``_close``)."""
    _close(out.loss, whole.loss, label)
    assert out.metrics.keys() == whole.metrics.keys(), label
    for name in whole.metrics:
        _close(out.metrics[name], whole.metrics[name], f"{name}: {label}")


def _zigzag(length: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s positions of a sequence of ``length`` tokens: its chunks r and 2 CP - 1 - r."""
    chunk = length // (2 * CP)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * CP - 1 - rank)])


def _mine(x: dict, rank: int, packed: bool):
    """This rank's tokens of every sequence, and the (sequence, position) of each: padded [B, T / CP] rows (every
    sequence padded to T first), or packed [total_r] with this rank's cu_seqlens."""
    T = max(LENGTHS)
    lengths = [T] * len(LENGTHS) if not packed else list(LENGTHS)
    rows = torch.cat([torch.full((n // CP,), s) for s, n in enumerate(lengths)])
    cols = torch.cat([_zigzag(n, rank) for n in lengths])
    shape = (len(LENGTHS), T // CP) if not packed else (-1,)
    local = {k: x[k][rows, cols].reshape(*shape, *x[k].shape[2:]) for k in ("logits", "hidden", "ids", "mask", "old",
                                                                               "ref", "sampling")}  # fmt: skip
    cu = torch.tensor([0, *torch.tensor(lengths).div(CP, rounding_mode="floor").cumsum(0).tolist()])
    return local, (rows, cols), (cu if packed else None)


def _call(x, logits_or_hidden, options, cu_seqlens=None, group=None, from_hidden=False, backend="torch"):
    kwargs = dict(
        old_logps=x["old"],
        ref_logps=x["ref"],
        sampling_logps=x["sampling"],
        prompt_ids=x["prompt_ids"] if options.aggregation == "prompt_mean" else None,
        cu_seqlens=cu_seqlens,
        context_parallel_group=group,
        options=options,
        backend=backend,
    )
    if from_hidden:
        return fused_linear_grpo_loss(
            logits_or_hidden, x["weight_leaf"], x["ids"], x["mask"], x["advantages"], **kwargs
        )
    return grpo_loss(logits_or_hidden, x["ids"], x["mask"], x["advantages"], **kwargs)


def _rank(rank, world):
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    x = _problem()
    results = []
    for packed in (False, True):
        local, (rows, cols), cu = _mine(x, rank, packed)
        local.update(advantages=x["advantages"], prompt_ids=x["prompt_ids"], rewards=x["rewards"])
        for from_hidden in (False, True):
            for backend in ("torch", "triton") if not from_hidden and not packed else ("torch",):
                for case in CASES:
                    options = GRPOOptions(**case)
                    key = "hidden" if from_hidden else "logits"
                    whole_leaf = x[key].clone().requires_grad_()
                    mine_leaf = local[key].clone().requires_grad_()
                    x["weight_leaf"] = x["weight"].clone().requires_grad_()
                    whole = _call(x, whole_leaf, options, from_hidden=from_hidden, backend=backend)
                    whole.loss.backward()
                    whole_dweight = x["weight_leaf"].grad
                    local["weight_leaf"] = x["weight"].clone().requires_grad_()
                    out = _call(local, mine_leaf, options, cu, group, from_hidden, backend)
                    out.loss.backward()
                    label = f"{case} packed={packed} hidden={from_hidden} {backend}"
                    _same_output(out, whole, label)
                    mask = local["mask"] != 0
                    expected_logps = whole.per_token_logps[rows, cols].reshape(mask.shape)
                    _close(out.per_token_logps.reshape(mask.shape)[mask], expected_logps[mask], label)
                    expected_grad = whole_leaf.grad[rows, cols].reshape(mine_leaf.shape)
                    _close(mine_leaf.grad, expected_grad, label)
                    if from_hidden:
                        dweight = local["weight_leaf"].grad.clone()
                        dist.all_reduce(dweight, group=group)
                        _close(dweight, whole_dweight, f"d weight: {label}")
                    results.append(label)
        # the sampler's kept sets (each token's own, padded [.., K]): the log-probs over them, on this rank's tokens
        first = torch.randint(0, V, x["ids"].shape, generator=torch.Generator().manual_seed(5))
        # two distinct kept ids a token (the second 1 to V - 1 past the first) and a pad; the target often outside
        # (prime-rl's convention: then the vocabulary)
        sets = torch.stack([first, (first + 1 + x["ids"].clamp(min=0) % (V - 1)) % V, torch.full_like(first, -1)], -1)
        for backend in ("torch", "triton"):
            whole_leaf, mine_leaf = x["logits"].clone().requires_grad_(), local["logits"].clone().requires_grad_()
            options = GRPOOptions(loss_type="grpo", importance_sampling_level="sequence")
            whole = grpo_loss(whole_leaf, x["ids"], x["mask"], x["advantages"], x["old"], options=options,
                              backend=backend, kept_set=KeptSet.from_padded(sets))  # fmt: skip
            whole.loss.backward()
            mine_sets = sets[rows, cols].reshape(*local["mask"].shape, 3)
            out = grpo_loss(mine_leaf, local["ids"], local["mask"], x["advantages"], local["old"], options=options,
                            backend=backend, kept_set=KeptSet.from_padded(mine_sets), cu_seqlens=cu,
                            context_parallel_group=group)  # fmt: skip
            out.loss.backward()
            label = f"kept set packed={packed} {backend}"
            _close(out.loss, whole.loss, label)
            _close(mine_leaf.grad, whole_leaf.grad[rows, cols].reshape(mine_leaf.shape), label)
            results.append(label)
        # the distillation losses: the top-k forward KL (verl's convention with its overlap metrics, TRL's) and the
        # reverse KL, from this rank's tokens
        g = torch.Generator().manual_seed(6)
        teacher_ids = torch.stack([x["ids"].clamp(min=0), (x["ids"].clamp(min=0) + 3) % V], dim=-1)
        teacher_logps = torch.log_softmax(torch.randn(*x["ids"].shape, 3, generator=g), -1)[..., :2]
        mine_teacher = [t[rows, cols].reshape(*local["mask"].shape, 2) for t in (teacher_ids, teacher_logps)]
        for name, loss_fn, whole_args, mine_args in (
            ("top-k verl", topk_distillation_loss, (teacher_ids, teacher_logps), mine_teacher),
            ("top-k trl", functools.partial(topk_distillation_loss, convention="trl"), (teacher_ids, teacher_logps),
             mine_teacher),
            ("reverse kl", reverse_kl_distillation_loss, (x["ids"], x["ref"]), (local["ids"], local["ref"])),
        ):  # fmt: skip
            whole_leaf, mine_leaf = x["logits"].clone().requires_grad_(), local["logits"].clone().requires_grad_()
            whole = loss_fn(whole_leaf, *whole_args, x["mask"])
            whole.loss.backward()
            out = loss_fn(mine_leaf, *mine_args, local["mask"], cu_seqlens=cu, context_parallel_group=group)
            out.loss.backward()
            label = f"{name} packed={packed}"
            _same_output(out, whole, label)
            _close(mine_leaf.grad, whole_leaf.grad[rows, cols].reshape(mine_leaf.shape), label)
            results.append(label)
        for method, extra in METHODS:  # the method family on the same layouts
            whole_leaf, mine_leaf = x["logits"].clone().requires_grad_(), local["logits"].clone().requires_grad_()
            whole = method(whole_leaf, x["ids"], x["mask"], *(x[k] for k in extra))
            whole.loss.backward()
            out = method(mine_leaf, local["ids"], local["mask"], *(local[k] for k in extra), cu_seqlens=cu,
                         context_parallel_group=group)  # fmt: skip
            out.loss.backward()
            label = f"{method.__name__} packed={packed}"
            _same_output(out, whole, label)
            mask = local["mask"] != 0
            _close(out.per_token_logps[mask], whole.per_token_logps[rows, cols].reshape(mask.shape)[mask], label)
            expected_grad = whole_leaf.grad[rows, cols].reshape(mine_leaf.shape)
            _close(mine_leaf.grad, expected_grad, label)
            results.append(label)
    return results


METHODS = ((sft_loss, ()), (rft_loss, ("rewards",)), (dpo_loss, ("ref",)))


def test_a_context_parallel_call_equals_one_process_on_the_whole_batch():
    results = run_ranks(_rank, CP, timeout=600)
    assert results[0] == results[1] and len(results[0]) == 5 * len(CASES) + 2 * len(METHODS) + 4 + 6


def _refusals(rank, world):
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    x = _problem()
    local, _, _ = _mine(x, rank, packed=False)
    messages = []
    for options, match in (
        (dict(top_entropy_quantile=0.5), "top_entropy_quantile=0.5 with context_parallel_group"),
        (dict(loss_type="clip_cov"), "loss_type='clip_cov' with context_parallel_group"),
    ):
        with pytest.raises(NotImplementedError, match=match):
            grpo_loss(local["logits"], local["ids"], local["mask"], x["advantages"], context_parallel_group=group,
                      **options)  # fmt: skip
        messages.append(match)
    # inside a torch.compile graph (the exchange reads the parts' sizes on the host), as users compile a step
    torch._dynamo.reset()
    with pytest.raises(Exception, match="context_parallel_group inside a torch.compile graph"):
        torch.compile(
            lambda: grpo_loss(local["logits"], local["ids"], local["mask"], x["advantages"],
                              context_parallel_group=group).loss,
            fullgraph=True, backend="eager",
        )()  # fmt: skip
    # ranks that disagree on the sequences they hold
    rows = local["logits"][: rank + 1]
    with pytest.raises(ValueError, match=r"as many sequences .* got \[1, 2\]"):
        grpo_loss(rows, local["ids"][: rank + 1], local["mask"][: rank + 1], x["advantages"][: rank + 1],
                  context_parallel_group=group)  # fmt: skip
    return messages


def test_context_parallel_refusals_name_what_they_refuse():
    assert run_ranks(_refusals, CP, timeout=300)[0]
    with pytest.raises(TypeError, match="context_parallel_group must be a torch.distributed ProcessGroup"):
        grpo_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2), torch.zeros(1),
                  context_parallel_group="cp")  # fmt: skip


TP = 2
MEGATRON_CASES = (dict(loss_type="grpo", beta=0.04), dict(loss_type="dapo", importance_sampling_level="sequence"))


def _megatron_rank(rank, world):
    """Megatron's own groups (tensor 2 x context 2 on 4 ranks): this rank's vocabulary slice of its context part's
    tokens, from logits, and from hidden states under sequence parallelism (the part's tokens split over the tensor
    group, gathered by Megatron's own mapping, whose backward reduce-scatters d hidden: reduce_hidden_grad=False)."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")  # megatron-core warns that Transformer Engine and Apex are absent
    torch.cuda.current_device = lambda: "cpu"  # Megatron's mappings allocate their buffers there
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, context_parallel_size=CP)
    tp_group, cp_group = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_context_parallel_group()
    tp_rank, cp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_context_parallel_rank()
    x = _problem(seed=1)
    shard = slice(tp_rank * V // TP, (tp_rank + 1) * V // TP) if V % TP == 0 else None
    assert shard is not None, "the vocabulary splits evenly over the tensor group"
    results = []
    for packed in (False, True):
        local, (rows, cols), cu = _mine(x, cp_rank, packed)
        local.update(advantages=x["advantages"], prompt_ids=x["prompt_ids"])
        for source in ("logits", "hidden states, sequence parallel", "hidden states"):
            from_hidden = source != "logits"
            for case in MEGATRON_CASES:
                options = GRPOOptions(**case)
                label = f"{case} packed={packed} {source} tp={tp_rank} cp={cp_rank}"
                key = "hidden" if from_hidden else "logits"
                whole_leaf = x[key].clone().requires_grad_()
                x["weight_leaf"] = x["weight"].clone().requires_grad_()
                whole = _call(x, whole_leaf, options, from_hidden=from_hidden)
                whole.loss.backward()
                common = dict(
                    old_logps=local["old"], ref_logps=local["ref"], cu_seqlens=cu, options=options,
                    vocab_parallel_group=tp_group, context_parallel_group=cp_group,
                )  # fmt: skip
                d_hidden = whole_leaf.grad[rows, cols].reshape(local[key].shape[:-1] + whole_leaf.shape[-1:])
                weight = x["weight"][shard].clone().requires_grad_()
                if source == "logits":
                    leaf = local["logits"][..., shard].clone().requires_grad_()
                    out = grpo_loss(leaf, local["ids"], local["mask"], x["advantages"], **common)
                    expected = d_hidden[..., shard]
                elif source == "hidden states":  # the same on every TP rank: the op all-reduces d hidden
                    leaf = local["hidden"].clone().requires_grad_()
                    out = fused_linear_grpo_loss(leaf, weight, local["ids"], local["mask"], x["advantages"], **common)
                    expected = d_hidden
                else:  # Megatron's [s, b, h], its s split over the tensor group, gathered by Megatron's own mapping
                    seq_first = local["hidden"].reshape(-1, local["mask"].shape[-1], H).transpose(0, 1)
                    part = seq_first.shape[0] // TP
                    leaf = seq_first[tp_rank * part : (tp_rank + 1) * part].clone().requires_grad_()
                    gathered = tensor_parallel.gather_from_sequence_parallel_region(leaf)
                    hidden = gathered.transpose(0, 1).reshape(local["hidden"].shape)
                    out = fused_linear_grpo_loss(
                        hidden, weight, local["ids"], local["mask"], x["advantages"], reduce_hidden_grad=False,
                        **common,
                    )  # fmt: skip
                    d_hidden = d_hidden.reshape(-1, local["mask"].shape[-1], H).transpose(0, 1)
                    expected = d_hidden[tp_rank * part : (tp_rank + 1) * part]
                out.loss.backward()
                _same_output(out, whole, label)
                _close(leaf.grad, expected, f"gradient, {label}")
                if from_hidden:  # each context part's share of the head's gradient, summed over the group
                    d_weight = weight.grad.clone()
                    dist.all_reduce(d_weight, group=cp_group)
                    _close(d_weight, x["weight_leaf"].grad[shard], f"d weight, {label}")
                results.append(label)
    # the log-prob family needs no group: per token, on each rank's packed chunks and its vocabulary slice
    local, (rows, cols), cu = _mine(x, cp_rank, packed=True)
    ids, whole_ids = local["ids"].clamp(min=0), x["ids"].clamp(min=0)
    logp, entropy, squares = token_logprobs(
        local["logits"][..., shard], ids, 0.7, True, cu_seqlens=cu, vocab_parallel_group=tp_group,
        return_sum_pi_squared=True,
    )  # fmt: skip
    whole = token_logprobs(x["logits"], whole_ids, 0.7, True, return_sum_pi_squared=True)
    for name, mine, expected in zip(("log-probs", "entropy", "sum pi^2"), (logp, entropy, squares), whole, strict=True):
        _close(mine, expected[rows, cols], f"{name}, tp={tp_rank} cp={cp_rank}")
    teacher_ids = torch.stack([whole_ids, (whole_ids + 5) % V, (whole_ids * 7 + 1) % V], dim=-1)
    topk = topk_logprobs(local["logits"][..., shard], teacher_ids[rows, cols], 0.7, cu_seqlens=cu,
                         vocab_parallel_group=tp_group)  # fmt: skip
    _close(topk, topk_logprobs(x["logits"], teacher_ids, 0.7)[rows, cols], f"top-k, tp={tp_rank} cp={cp_rank}")
    results.append("log-prob family")
    return results


def test_tensor_by_context_parallel_through_megatrons_groups_equals_one_process():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'grpo-kernels[megatron]')")
    results = run_ranks(_megatron_rank, TP * CP, timeout=600)
    assert all(len(r) == 6 * len(MEGATRON_CASES) + 1 for r in results)
