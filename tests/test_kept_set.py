"""The sampler's kept set (top-k / top-p replay): every log-prob and loss entry point against the dense oracle
(``reference.kept_token_logprobs_and_entropy``: x = logits / T, -inf outside the set, the log-softmax), values and
every gradient, both backends, both set forms (vLLM's CSR, prime-rl's padded), both conventions for a target outside
its set and both entropies; from logits and from hidden states (both fused head modes); packed; a vocabulary split on
two processes; the sets transformers' own warpers keep reproduce the sampler's log-probs; bad sets are refused by name.

Each batch holds the edge sets: one id (the target), the whole vocabulary, an empty set, a target outside its set, a
masked token (its set never read), beside ordinary sets of a few ids.
"""

import pytest
import torch
from gloo_ranks import run_ranks

from grpo_kernels import (
    GRPOLoss,
    KeptSet,
    fused_linear_grpo_loss,
    grpo_loss,
    grpo_loss_reference,
    linear_selective_log_softmax_and_entropy,
    linear_token_logprobs,
    selective_log_softmax,
    selective_log_softmax_and_entropy,
    token_logprobs,
)
from grpo_kernels.reference import kept_token_logprobs_and_entropy

B, T, V, H = 2, 6, 29, 12
TEMPERATURE = 0.8
CONVENTIONS = [(outside, entropy) for outside in ("vocabulary", "add_target") for entropy in ("vocabulary", "set")]
FP32 = dict(atol=2e-6, rtol=2e-5)  # fp32 kernels against the fp64 oracle
FP64 = dict(atol=1e-12, rtol=1e-12)  # the torch path computes fp64 inputs in fp64


def _sets(ids: torch.Tensor, seed: int = 0) -> list[torch.Tensor]:
    """Each token's kept ids (ascending, as vLLM gives them): the edge sets first, then a few ids with the target."""
    g = torch.Generator().manual_seed(seed)
    flat = ids.reshape(-1)
    sets = []
    for n in range(flat.numel()):
        y = int(flat[n])
        others = torch.randperm(V, generator=g)
        if n == 0:
            s = torch.tensor([y])  # a set of one id
        elif n == 1:
            s = torch.arange(V)  # the whole vocabulary
        elif n == 2:
            s = torch.tensor([], dtype=torch.long)  # an empty set
        elif n == 3:
            s = others[others != y][:4]  # the target outside its set
        else:
            s = torch.cat([others[others != y][: 1 + n % 5], torch.tensor([y])])
        sets.append(torch.sort(s).values)
    return sets


def _kept(sets, form: str, outside: str = "vocabulary", entropy: str = "vocabulary", shape=(B, T)) -> KeptSet:
    if form == "csr":
        offsets = torch.tensor([0] + [len(s) for s in sets]).cumsum(0)
        return KeptSet.from_vllm(torch.cat(sets).to(torch.int32), offsets, outside=outside, entropy=entropy)
    width = max(len(s) for s in sets)
    padded = torch.full((len(sets), width), -1, dtype=torch.long)
    for n, s in enumerate(sets):
        padded[n, : len(s)] = s
    return KeptSet.from_padded(padded.view(*shape, width), outside=outside, entropy=entropy)


def _batch(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(B, T, V, generator=g)).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[1, 4:] = 0
    lp = torch.log_softmax(logits.double() / TEMPERATURE, -1).gather(-1, ids.unsqueeze(-1))[..., 0]
    return dict(
        logits=logits,
        completion_ids=ids,
        completion_mask=mask,
        advantages=torch.randn(B, generator=g),
        old_logps=(lp + 0.1 * torch.randn(B, T, generator=g)).float(),
        ref_logps=(lp + 0.1 * torch.randn(B, T, generator=g)).float(),
    )


def _oracle(logits, ids, kept, mask=None):
    """(log-probs, entropy, Σπ², d sum(sin logp) + 0.1 t H / d logits) of the dense fp64 oracle."""
    x = logits.detach().double().requires_grad_()
    logp, entropy, squares = kept_token_logprobs_and_entropy(
        x, ids, kept, TEMPERATURE, mask=mask, return_sum_pi_squared=True
    )
    _objective(logp, entropy).backward()
    return logp.detach(), entropy.detach(), squares.detach(), x.grad


def _objective(logp, entropy):
    """A loss that weighs every token's log-prob and entropy differently (each gradient path checked)."""
    weights = torch.arange(logp.numel(), dtype=logp.dtype).view(logp.shape) / logp.numel()
    return logp.sin().sum() + 0.1 * (weights * entropy).sum()


def test_the_oracle_is_prime_rls_formula_and_slimes():
    """The dense oracle, token by token: z_y - logsumexp(z over the set) with z = logits / T (the whole vocabulary
    for an empty set or a target outside it: prime-rl's), or over the set plus the target (slime's)."""
    batch = _batch()
    logits, ids = batch["logits"].double(), batch["completion_ids"]
    sets = _sets(ids)
    for outside in ("vocabulary", "add_target"):
        logp, entropy = kept_token_logprobs_and_entropy(logits, ids, _kept(sets, "csr", outside, "set"), TEMPERATURE)
        for n, s in enumerate(sets):
            z, y = logits.view(-1, V)[n] / TEMPERATURE, int(ids.reshape(-1)[n])
            members = s.tolist()
            if outside == "add_target" and y not in members:
                members.append(y)
            if y not in members:
                members = list(range(V))
            expected = z[y] - torch.logsumexp(z[members], 0)
            q = torch.softmax(z[members], 0)
            torch.testing.assert_close(logp.view(-1)[n], expected, **FP64)
            torch.testing.assert_close(entropy.view(-1)[n], -(q * q.log()).sum(), **FP64)


def _logit_paths():
    return [("torch", None), ("triton", None)]


@pytest.mark.parametrize("outside, entropy", CONVENTIONS)
@pytest.mark.parametrize("form", ["csr", "padded"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_log_probs_from_logits_over_the_set(backend, form, outside, entropy):
    """selective_log_softmax(_and_entropy) and token_logprobs (with the entropy and Σπ²) over the sets: values and
    the gradient of the logits, equal to the oracle."""
    batch = _batch()
    ids = batch["completion_ids"]
    kept = _kept(_sets(ids), form, outside, entropy)
    dtype = torch.float64 if backend == "torch" else torch.float32
    tol = FP64 if backend == "torch" else FP32
    logits = batch["logits"].to(dtype)
    logp_o, entropy_o, squares_o, grad_o = _oracle(logits, ids, kept)
    x = logits.clone().requires_grad_()
    logp, ent = selective_log_softmax_and_entropy(x, ids, TEMPERATURE, backend=backend, kept_set=kept)
    _objective(logp, ent).backward()
    torch.testing.assert_close(logp.double(), logp_o, **tol)
    torch.testing.assert_close(ent.double(), entropy_o, **tol)
    torch.testing.assert_close(x.grad.double(), grad_o, **tol)
    x = logits.clone().requires_grad_()
    selective_log_softmax(x, ids, TEMPERATURE, backend=backend, kept_set=kept).sin().sum().backward()
    y = logits.double().clone().requires_grad_()
    kept_token_logprobs_and_entropy(y, ids, kept, TEMPERATURE)[0].sin().sum().backward()
    torch.testing.assert_close(x.grad.double(), y.grad, **tol)
    logp, ent, squares = token_logprobs(
        logits, ids, TEMPERATURE, True, backend=backend, kept_set=kept, return_sum_pi_squared=True
    )
    for got, expected in ((logp, logp_o), (ent, entropy_o), (squares, squares_o)):
        torch.testing.assert_close(got.double(), expected, **tol)


def test_a_set_of_the_whole_vocabulary_is_no_set():
    """Every token's set the whole vocabulary: the log-probs and gradient of the call without a set."""
    batch = _batch()
    logits, ids = batch["logits"], batch["completion_ids"]
    kept = _kept([torch.arange(V)] * (B * T), "csr")
    for backend in ("torch", "triton"):
        x, y = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        with_set = selective_log_softmax(x, ids, TEMPERATURE, backend=backend, kept_set=kept)
        without = selective_log_softmax(y, ids, TEMPERATURE, backend=backend)
        with_set.sin().sum().backward()
        without.sin().sum().backward()
        torch.testing.assert_close(with_set, without, **FP32)
        torch.testing.assert_close(x.grad, y.grad, **FP32)


def _loss_paths():
    return [("torch", None), ("triton", True), ("triton", False)]


@pytest.mark.parametrize("outside, entropy", CONVENTIONS)
@pytest.mark.parametrize("backend, one_pass", _loss_paths())
def test_grpo_loss_over_the_set(backend, one_pass, outside, entropy):
    """grpo_loss with the sets (token level with a KL term and an entropy bonus; one-pass and two-pass kernels, the
    torch path): the loss, log-probs, metrics and gradient of the specification with the same sets."""
    batch = _batch()
    kept = _kept(_sets(batch["completion_ids"]), "padded", outside, entropy)
    options = dict(beta=0.04, temperature=TEMPERATURE, entropy_coef=0.05)
    rest = {k: v for k, v in batch.items() if k != "logits"}
    x = batch["logits"].double().requires_grad_()
    expected = grpo_loss_reference(x, **rest, kept_set=kept, **options)
    expected.loss.backward()
    y = batch["logits"].clone().requires_grad_()
    out = grpo_loss(y, **rest, kept_set=kept, backend=backend, one_pass=one_pass, **options)
    out.loss.backward()
    active = batch["completion_mask"].bool()
    torch.testing.assert_close(out.loss.double(), expected.loss.detach(), **FP32)
    torch.testing.assert_close(out.per_token_logps[active].double(), expected.per_token_logps[active], **FP32)
    torch.testing.assert_close(y.grad.double(), x.grad, **FP32)
    for name, value in expected.metrics.items():
        torch.testing.assert_close(out.metrics[name].double(), value.double(), atol=1e-5, rtol=1e-4, msg=name)


def test_the_loss_module_takes_the_set():
    """GRPOLoss(...)(..., kept_set=) is grpo_loss with it."""
    batch = _batch()
    kept = _kept(_sets(batch["completion_ids"]), "csr", "add_target")
    rest = {k: v for k, v in batch.items() if k != "logits"}
    module = GRPOLoss(beta=0.04, temperature=TEMPERATURE)
    got = module(batch["logits"], **rest, kept_set=kept)
    expected = grpo_loss(batch["logits"], **rest, kept_set=kept, beta=0.04, temperature=TEMPERATURE)
    torch.testing.assert_close(got.loss, expected.loss)
    without = module(batch["logits"], **rest)
    assert not torch.allclose(got.per_token_logps, without.per_token_logps)


# ---- From hidden states: each kept logit its own dot product, no [N, V] logits -----------------------------------


def _head(seed: int = 1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (0.6 * torch.randn(V, H, generator=g)).to(dtype)
    bias = (0.3 * torch.randn(V, generator=g)).to(dtype)
    return hidden, weight, bias


def _head_logits(hidden, weight, bias):
    """The unfused head in the inputs' dtype (a 16-bit head rounds its logits once), as the oracle reads it."""
    return torch.nn.functional.linear(hidden, weight, bias)


@pytest.mark.parametrize("outside, entropy", CONVENTIONS)
@pytest.mark.parametrize("form", ["csr", "padded"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_log_probs_from_hidden_states_over_the_set(backend, form, outside, entropy):
    """linear_selective_log_softmax_and_entropy and linear_token_logprobs (with Σπ²) over the sets: values and the
    gradients of the hidden states, the weight and the bias, equal to the oracle on the head's logits."""
    ids = _batch()["completion_ids"]
    kept = _kept(_sets(ids), form, outside, entropy)
    dtype = torch.float64 if backend == "torch" else torch.float32
    tol = FP64 if backend == "torch" else FP32
    head = [t.double().requires_grad_() for t in _head()]
    logp_o, entropy_o, squares_o = kept_token_logprobs_and_entropy(
        _head_logits(*head), ids, kept, TEMPERATURE, return_sum_pi_squared=True
    )
    _objective(logp_o, entropy_o).backward()
    ours = [t.detach().to(dtype).requires_grad_() for t in head]
    hidden, weight, bias = ours
    logp, ent = linear_selective_log_softmax_and_entropy(
        hidden, weight, ids, bias, TEMPERATURE, backend=backend, kept_set=kept
    )
    _objective(logp, ent).backward()
    torch.testing.assert_close(logp.double(), logp_o.detach(), **tol)
    torch.testing.assert_close(ent.double(), entropy_o.detach(), **tol)
    for got, expected in zip(ours, head, strict=True):
        torch.testing.assert_close(got.grad.double(), expected.grad, **tol)
    logp, ent, squares = linear_token_logprobs(
        hidden, weight, ids, bias, TEMPERATURE, True, backend=backend, kept_set=kept, return_sum_pi_squared=True
    )
    for got, expected in ((logp, logp_o), (ent, entropy_o), (squares, squares_o)):
        torch.testing.assert_close(got.double(), expected.detach(), **tol)


@pytest.mark.parametrize("outside, entropy", CONVENTIONS)
@pytest.mark.parametrize("backend, mode", [("torch", None), ("triton", "recompute"), ("triton", "three_products")])
def test_the_fused_head_loss_over_the_set(backend, mode, outside, entropy):
    """fused_linear_grpo_loss with the sets, every schedule: the specification's loss and gradients on the head's
    logits."""
    batch = _batch()
    rest = {k: v for k, v in batch.items() if k != "logits"}
    kept = _kept(_sets(batch["completion_ids"]), "csr", outside, entropy)
    options = dict(beta=0.04, temperature=TEMPERATURE, entropy_coef=0.05)
    head = [t.double().requires_grad_() for t in _head()]
    expected = grpo_loss_reference(_head_logits(*head), **rest, kept_set=kept, **options)
    expected.loss.backward()
    ours = [t.detach().float().requires_grad_() for t in head]
    hidden, weight, bias = ours
    out = fused_linear_grpo_loss(
        hidden, weight, **rest, bias=bias, kept_set=kept, backend=backend, lm_head_mode=mode, **options
    )
    out.loss.backward()
    active = batch["completion_mask"].bool()
    torch.testing.assert_close(out.loss.double(), expected.loss.detach(), **FP32)
    torch.testing.assert_close(out.per_token_logps[active].double(), expected.per_token_logps[active], **FP32)
    for got, wanted in zip(ours, head, strict=True):
        torch.testing.assert_close(got.grad.double(), wanted.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_16_bit_inputs_over_the_set(backend):
    """bf16 logits: fp32 arithmetic on exact inputs, the fp32 tolerance. bf16 hidden states: each kept logit is its
    own dot product, rounded once to bf16 as the unfused head rounds it, where the head's GEMM sums in another order:
    a logit whose fp32 sum lands on a rounding boundary may differ by one bf16 ulp (2^-6 at |z| < 4), so the
    log-probs are held to 2e-2 (documented in docs/loss-semantics.md)."""
    batch = _batch(dtype=torch.bfloat16)
    ids = batch["completion_ids"]
    kept = _kept(_sets(ids), "csr")
    logp_o = kept_token_logprobs_and_entropy(batch["logits"], ids, kept, TEMPERATURE)[0]
    logp = selective_log_softmax(batch["logits"], ids, TEMPERATURE, backend=backend, kept_set=kept)
    torch.testing.assert_close(logp.double(), logp_o.double(), **FP32)
    head = _head(dtype=torch.bfloat16)
    logp_o = kept_token_logprobs_and_entropy(_head_logits(*head), ids, kept, TEMPERATURE)[0]
    logp = linear_token_logprobs(head[0], head[1], ids, head[2], TEMPERATURE, backend=backend, kept_set=kept)
    torch.testing.assert_close(logp.double(), logp_o.double(), atol=2e-2, rtol=0)


# ---- Packed and vocabulary-parallel -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_packed_batch_takes_its_sets_in_packed_order(backend):
    """A packed batch (cu_seqlens) with CSR sets in the packed tokens' order equals the padded batch with the same
    sets, loss and gradient."""
    batch = _batch()
    lengths = batch["completion_mask"].sum(1).long()
    sets = _sets(batch["completion_ids"])
    active = batch["completion_mask"].reshape(-1).bool()
    packed_sets = [s for s, a in zip(sets, active.tolist(), strict=True) if a]
    options = dict(beta=0.04, temperature=TEMPERATURE, backend=backend)
    rest = {k: v for k, v in batch.items() if k != "logits"}
    x = batch["logits"].clone().requires_grad_()
    padded = grpo_loss(x, **rest, kept_set=_kept(sets, "csr"), **options)
    padded.loss.backward()
    y = batch["logits"].reshape(-1, V)[active].clone().requires_grad_()
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    packed = grpo_loss(
        y,
        batch["completion_ids"].reshape(-1)[active],
        torch.ones(int(active.sum())),
        batch["advantages"],
        batch["old_logps"].reshape(-1)[active],
        batch["ref_logps"].reshape(-1)[active],
        cu_seqlens=cu,
        kept_set=_kept(packed_sets, "csr", shape=(int(active.sum()),)),
        **options,
    )
    packed.loss.backward()
    torch.testing.assert_close(packed.loss, padded.loss, **FP32)
    torch.testing.assert_close(y.grad, x.grad.reshape(-1, V)[active], **FP32)


def _rank_sharded(rank: int, world: int, backend: str):
    import torch.distributed as dist

    group, part = dist.group.WORLD, V // world + 1  # uneven slices: 15 and 14 ids
    start, stop = rank * part, min((rank + 1) * part, V)
    batch = _batch()
    ids, mask = batch["completion_ids"], batch["completion_mask"]
    kept = _kept(_sets(ids), "csr", "add_target", "set")
    x = batch["logits"][..., start:stop].clone().requires_grad_()
    logp, ent = selective_log_softmax_and_entropy(
        x, ids, TEMPERATURE, backend=backend, kept_set=kept, vocab_parallel_group=group, vocab_start_index=start
    )
    _objective(logp, ent).backward()
    squares = token_logprobs(
        batch["logits"][..., start:stop], ids, TEMPERATURE, backend=backend, kept_set=kept,
        return_sum_pi_squared=True, vocab_parallel_group=group, vocab_start_index=start,
    )[1]  # fmt: skip
    hidden, weight, bias = (t.clone().requires_grad_() for t in _head())
    w, b = weight[start:stop].detach().requires_grad_(), bias[start:stop].detach().requires_grad_()
    head_logp, head_ent = linear_selective_log_softmax_and_entropy(
        hidden, w, ids, b, TEMPERATURE, backend=backend, kept_set=kept, vocab_parallel_group=group,
        vocab_start_index=start,
    )  # fmt: skip
    _objective(head_logp, head_ent).backward()
    loss = grpo_loss(
        batch["logits"][..., start:stop], ids, mask, batch["advantages"], batch["old_logps"], batch["ref_logps"],
        beta=0.04, temperature=TEMPERATURE, backend=backend, kept_set=kept, vocab_parallel_group=group,
        vocab_start_index=start,
    ).loss  # fmt: skip
    return dict(
        logp=logp.detach(), entropy=ent.detach(), grad=x.grad, squares=squares, head_logp=head_logp.detach(),
        d_hidden=hidden.grad, d_weight=w.grad, d_bias=b.grad, loss=loss.detach(), rows=(start, stop),
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_vocabulary_split_over_two_processes(backend):
    """Two ranks, each holding a slice of the logits (and of the head's weight); the sets' ids are global, slime's
    conventions (the target joins its set; the set's entropy): each rank's log-probs, entropy, Σπ² and loss are the
    whole vocabulary's, its gradients its slice of the unsplit ones."""
    batch = _batch()
    ids = batch["completion_ids"]
    kept = _kept(_sets(ids), "csr", "add_target", "set")
    logp_o, entropy_o, squares_o, grad_o = _oracle(batch["logits"], ids, kept)
    head = [t.clone().requires_grad_() for t in _head()]
    head_logp, head_ent = linear_selective_log_softmax_and_entropy(
        *head[:2], ids, head[2], TEMPERATURE, backend="torch", kept_set=kept
    )
    _objective(head_logp, head_ent).backward()
    loss = grpo_loss(
        batch["logits"], ids, batch["completion_mask"], batch["advantages"], batch["old_logps"], batch["ref_logps"],
        beta=0.04, temperature=TEMPERATURE, backend="torch", kept_set=kept,
    ).loss  # fmt: skip
    for result in run_ranks(_rank_sharded, 2, backend, timeout=600):
        start, stop = result["rows"]
        torch.testing.assert_close(result["logp"].double(), logp_o, **FP32)
        torch.testing.assert_close(result["entropy"].double(), entropy_o, **FP32)
        torch.testing.assert_close(result["squares"].double(), squares_o, **FP32)
        torch.testing.assert_close(result["grad"].double(), grad_o[..., start:stop], **FP32)
        torch.testing.assert_close(result["head_logp"], head_logp.detach(), **FP32)
        torch.testing.assert_close(result["d_hidden"], head[0].grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(result["d_weight"], head[1].grad[start:stop], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(result["d_bias"], head[2].grad[start:stop], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(result["loss"], loss.detach(), **FP32)


# ---- The sets a sampler keeps ---------------------------------------------------------------------------------------


def _sampled_with_warpers(logits, top_k, top_p, seed):
    """Sample as transformers' generate does (temperature, then top-k, then top-p warpers), with the kept set of each
    token the finite entries of its warped logits (ties at the top-k boundary all kept): (ids, the sampler's
    log-probs of them, CSR ids, offsets)."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList(
        [TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(top_k), TopPLogitsWarper(top_p)]
    )
    flat = logits.reshape(-1, logits.shape[-1])
    warped = warpers(torch.zeros(flat.shape[0], 1, dtype=torch.long), flat.clone())
    g = torch.Generator().manual_seed(seed)
    ids = torch.multinomial(torch.softmax(warped, -1), 1, generator=g).squeeze(1)
    sampler_logp = torch.log_softmax(warped, -1).gather(-1, ids.unsqueeze(1)).squeeze(1)
    kept = torch.isfinite(warped)
    offsets = torch.nn.functional.pad(kept.sum(1).cumsum(0), (1, 0))
    return ids.view(logits.shape[:-1]), sampler_logp.view(logits.shape[:-1]), kept.nonzero()[:, 1], offsets


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (50, 0.9), (8, 0.7)])
def test_the_sampler_log_probs_are_reproduced_with_its_sets(backend, top_k, top_p):
    """Tokens sampled with transformers' temperature, top-k and top-p warpers (logits with ties at the top-k
    boundary: more than k ids kept): with the kept sets, the trainer's log-prob of each sampled token is the
    sampler's; without them it is not."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(B, T, V, generator=g).round(decimals=1)  # many ties
    ids, sampler_logp, kept_ids, offsets = _sampled_with_warpers(logits, top_k, top_p, seed=3)
    kept = KeptSet.from_vllm(kept_ids.to(torch.int32), offsets)
    if top_p == 1.0:  # top-k alone: the boundary's ties were kept (more than k ids for some token)
        assert (offsets.diff() > top_k).any()
    replayed = token_logprobs(logits, ids, TEMPERATURE, backend=backend, kept_set=kept)
    torch.testing.assert_close(replayed, sampler_logp, atol=2e-6, rtol=1e-5)
    whole = token_logprobs(logits, ids, TEMPERATURE, backend=backend)
    assert (whole - sampler_logp).abs().max() > 1e-2


# ---- Bad sets -----------------------------------------------------------------------------------------------------


def _bad(kept, match, error=ValueError, **call):
    batch = _batch()
    with pytest.raises(error, match=match):
        selective_log_softmax(batch["logits"], batch["completion_ids"], TEMPERATURE, kept_set=kept, **call)


def test_bad_sets_are_refused_by_name():
    ids = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    N = B * T
    even = torch.arange(0, N + 1).clamp(max=4)
    _bad(KeptSet(ids, even.flip(0)), r"kept_set.offsets must start at 0, never decrease")
    _bad(KeptSet(ids, torch.arange(0, N + 1).clamp(max=3)), r"end at the ids' count 4")
    _bad(KeptSet(ids, even[:-1]), r"kept_set.offsets must hold one more than the call's 12 tokens")
    out_of_range = rf"\[0, V\) = \[0, {V}\) at active tokens, got "
    _bad(KeptSet(torch.tensor([1, 2, 3, V], dtype=torch.int32), even), rf"{out_of_range}{V}$")
    # an int64 id past 2**32 is refused as given, not read as its low 32 bits (id 4)
    _bad(KeptSet(torch.tensor([1, 2, 3, 2**32 + 4]), even), rf"{out_of_range}{2**32 + 4}$")
    padded = torch.tensor([[[1, -1, 2]] * T] * B)
    padded[0, 0, 2] = V
    _bad(KeptSet.from_padded(padded), rf"at active tokens \(a padded set's negative ids mean no entry\), got {V}$")
    _bad(KeptSet(torch.tensor([1, 1, 3, 4], dtype=torch.int32), torch.tensor([0, 2] + [4] * (N - 1))), "repeat")
    _bad(KeptSet.from_padded(torch.zeros(B, T + 1, 3, dtype=torch.long)), r"completion ids' shape \(2, 6\) plus")
    _bad(KeptSet.from_padded(torch.tensor([[[0, 0, -1]] * T] * B)), "repeat")
    _bad(KeptSet.from_padded(torch.full((B, T, 2), 1.0)), "kept_set.ids must be an integer tensor", TypeError)
    _bad(KeptSet(ids, even.float()), "kept_set.offsets must be a 1-D integer tensor", TypeError)
    _bad(KeptSet(ids, even, outside="target"), r"kept_set.outside must be one of")
    _bad(KeptSet(ids, even, entropy="kept"), r"kept_set.entropy must be one of")
    _bad(ids, "kept_set must be a grpo_kernels.KeptSet", TypeError)


def test_a_masked_tokens_set_is_never_read():
    """A masked token's set may hold anything (the ids of a padded batch's filler): it is neither checked nor read."""
    batch = _batch()
    sets = _sets(batch["completion_ids"])
    sets[B * T - 1] = torch.tensor([V + 5, -3])  # the last token is masked (_batch)
    kept = _kept(sets, "csr")
    out = grpo_loss(**batch, kept_set=kept, temperature=TEMPERATURE)
    sets[B * T - 1] = torch.tensor([0])
    again = grpo_loss(**batch, kept_set=_kept(sets, "csr"), temperature=TEMPERATURE)
    torch.testing.assert_close(out.loss, again.loss)


def test_a_set_inside_a_compiled_graph_is_refused_by_name():
    batch = _batch()
    kept = _kept(_sets(batch["completion_ids"]), "csr")

    @torch.compile(backend="eager", fullgraph=True)
    def step(logits):
        return selective_log_softmax(logits, batch["completion_ids"], TEMPERATURE, kept_set=kept)

    with pytest.raises(Exception, match="kept_set inside a torch.compile graph"):
        step(batch["logits"])
