"""The cost follows the tokens that count: a loss call whose mask leaves out most tokens (an agentic rollout's tool
turns, scattered) runs the head's products, and on the torch path the logits' reads, over its active tokens alone
(``grpo_kernels.inputs.compacted``), with the same loss, metrics, log-probs and gradients as the dense call and the
specification, on both backends, from logits and from hidden states, padded and packed, with garbage at the masked
positions; the masked tokens' log-probs and gradients are 0."""

import pytest
import torch

from grpo_kernels import (
    KeptSet,
    fused_linear_grpo_loss,
    fused_linear_topk_distillation_loss,
    grpo_loss,
    grpo_loss_reference,
    inputs,
    reverse_kl_distillation_loss,
    topk_distillation_loss,
    torch_path,
)

B, T, H, V = 3, 20, 8, 37
BACKENDS = ["torch", "triton"]
TIGHT = dict(atol=1e-5, rtol=1e-5)


def _batch(share: float = 0.1, seed: int = 0):
    """Hidden states and a head, a scattered mask with ``share`` of the tokens active (one row with none), garbage
    (NaN logits' rows, ids out of range, NaN log-probs) at the masked positions."""
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(B, T, H, generator=g), 0.5 * torch.randn(V, H, generator=g)
    mask = (torch.rand(B, T, generator=g) < share).float()
    mask[1] = 0
    mask[0, 3] = mask[2, 7] = 1.0  # at least a token in each other row
    ids = torch.randint(0, V, (B, T), generator=g)
    logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    old, ref = logp + 0.3 * torch.randn(B, T, generator=g), logp + 0.2 * torch.randn(B, T, generator=g)
    masked = mask == 0
    batch = dict(
        completion_ids=torch.where(masked, -100, ids),
        completion_mask=mask,
        advantages=torch.randn(B, generator=g),
        old_logps=torch.where(masked, float("nan"), old),
        ref_logps=torch.where(masked, float("inf"), ref),
    )
    return hidden, weight, batch


def _logits(hidden, weight, mask):
    """The head's logits, NaN at the masked tokens' rows (a row the compaction must never read)."""
    logits = hidden @ weight.T
    return torch.where(mask.unsqueeze(-1) == 0, float("nan"), logits)


def _dense(run):
    """``run()`` with the compaction off: every token computed, as before it."""
    share = inputs.COMPACTION_SHARE
    inputs.COMPACTION_SHARE = 0.0
    try:
        return run()
    finally:
        inputs.COMPACTION_SHARE = share


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["logits", "hidden_states"])
def test_a_tenth_of_the_tokens_gives_the_dense_numbers(backend, form):
    """The loss, every metric, the log-probs and every gradient at 10 % active tokens equal the dense call's and the
    specification's; a masked token's log-prob and gradient are 0."""
    hidden, weight, batch = _batch()
    options = dict(beta=0.04, loss_type="grpo", entropy_coef=0.01, temperature=0.9)

    def run():
        leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        if form == "logits":
            x = _logits(leaves[0].detach(), leaves[1].detach(), batch["completion_mask"]).requires_grad_()
            out = grpo_loss(x, **batch, **options, backend=backend)
            leaves = [x]
        else:
            out = fused_linear_grpo_loss(*leaves, **batch, **options, backend=backend)
        out.loss.backward()
        return out, [t.grad for t in leaves]

    (ours, grads), (dense, dense_grads) = run(), _dense(run)
    torch.testing.assert_close(ours.loss, dense.loss, **TIGHT)
    assert set(ours.metrics) == set(dense.metrics)
    for name, value in dense.metrics.items():
        torch.testing.assert_close(ours.metrics[name], value, **TIGHT, msg=name)
    torch.testing.assert_close(ours.per_token_logps, dense.per_token_logps, **TIGHT)
    for got, want in zip(grads, dense_grads, strict=True):
        torch.testing.assert_close(got, want, **TIGHT, equal_nan=True)
    masked = batch["completion_mask"] == 0
    assert (ours.per_token_logps[masked] == 0).all()
    if form == "logits":
        assert (grads[0][masked] == 0).all()  # (not NaN: the masked rows were never read)
        clean = hidden @ weight.T
        finite = dict(batch, completion_ids=batch["completion_ids"].clamp(min=0))  # (the specification gathers all)
        finite["old_logps"], finite["ref_logps"] = (
            torch.nan_to_num(t, posinf=0.0) for t in (batch["old_logps"], batch["ref_logps"])
        )
        spec = grpo_loss_reference(clean.requires_grad_(), **finite, **options)
        torch.testing.assert_close(ours.loss, spec.loss, **TIGHT)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_packed_call_compacts_its_sequences(backend):
    """A packed call's mask compacts too: its sequences keep their order and their (fewer) tokens."""
    hidden, weight, batch = _batch(seed=1)
    lengths = torch.tensor([T, T - 5, 5])
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    keep = torch.arange(T)[None, :] < lengths[:, None]
    packed = {k: v[keep] if v.dim() == 2 else v for k, v in batch.items()}

    def run():
        h, w = hidden[keep].clone().requires_grad_(), weight.clone().requires_grad_()
        out = fused_linear_grpo_loss(h, w, **packed, cu_seqlens=cu, beta=0.04, backend=backend)
        out.loss.backward()
        return out, h.grad, w.grad

    ours, dense = run(), _dense(run)
    for got, want in zip(ours[1:], dense[1:], strict=True):
        torch.testing.assert_close(got, want, **TIGHT)
    torch.testing.assert_close(ours[0].loss, dense[0].loss, **TIGHT)
    torch.testing.assert_close(ours[0].per_token_logps, dense[0].per_token_logps, **TIGHT)


def _kept_sets(batch, seed: int = 2):
    """The sampler's kept sets of every token, padded [B, T, 4] and CSR, each token's own id among them, garbage at
    the masked tokens (out of range in CSR, ids of no entry padded)."""
    g = torch.Generator().manual_seed(seed)
    ids, masked = batch["completion_ids"].clamp(min=0), batch["completion_mask"] == 0
    padded = torch.stack([torch.randperm(V, generator=g)[:4] for _ in range(B * T)]).view(B, T, 4)
    padded[..., 0] = ids
    padded[..., 3] = torch.where(torch.rand(B, T, generator=g) < 0.5, -1, padded[..., 3])  # some keep 3
    padded = torch.where(masked.unsqueeze(-1), -7, padded)
    counts = torch.randint(1, 5, (B * T,), generator=g)
    offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    csr = torch.cat([torch.randperm(V, generator=g)[:c] for c in counts.tolist()])
    csr[offsets[:-1]] = ids.reshape(-1)
    csr = torch.where(masked.reshape(-1).repeat_interleave(counts), V + 7, csr)
    return KeptSet.from_padded(padded), KeptSet.from_vllm(csr, offsets)


# (from logits the Triton kernel reads no masked row already: it compacts on the torch path)
@pytest.mark.parametrize(
    "backend, form", [("torch", "logits"), ("torch", "hidden_states"), ("triton", "hidden_states")]
)
def test_a_kept_set_compacts_with_its_tokens(backend, form, monkeypatch):
    """The sampler's kept sets (padded and CSR) go with their tokens: at 10 % active the call runs compacted (the sets
    taken at the active tokens) and its loss, metrics, log-probs and gradients equal the dense call's, the masked
    tokens' sets never read."""
    compacted_sets = []
    at_tokens = KeptSet.at_tokens
    monkeypatch.setattr(KeptSet, "at_tokens", lambda self, p: compacted_sets.append(p.numel()) or at_tokens(self, p))
    hidden, weight, batch = _batch(seed=3)
    for kept in _kept_sets(batch):

        def run(kept=kept):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            if form == "logits":
                x = _logits(h.detach(), w.detach(), batch["completion_mask"]).requires_grad_()
                out = grpo_loss(x, **batch, beta=0.04, kept_set=kept, backend=backend)
                leaves = [x]
            else:
                out = fused_linear_grpo_loss(h, w, **batch, beta=0.04, kept_set=kept, backend=backend)
                leaves = [h, w]
            out.loss.backward()
            return out, [t.grad for t in leaves]

        (ours, grads), (dense, dense_grads) = run(), _dense(run)
        assert compacted_sets.pop() == int((batch["completion_mask"] != 0).sum()) and not compacted_sets
        torch.testing.assert_close(ours.loss, dense.loss, **TIGHT)
        torch.testing.assert_close(ours.per_token_logps, dense.per_token_logps, **TIGHT)
        for name, value in dense.metrics.items():
            torch.testing.assert_close(ours.metrics[name], value, **TIGHT, msg=name)
        for got, want in zip(grads, dense_grads, strict=True):
            torch.testing.assert_close(got, want, **TIGHT, equal_nan=True)


def test_a_kept_sets_rows_at_some_tokens():
    """``KeptSet.at_tokens``: each chosen token's set, in order, from either form."""
    padded = torch.tensor([[[1, 2, -1], [3, 4, 5]], [[6, -1, -1], [7, 8, 9]]])
    assert torch.equal(
        KeptSet.from_padded(padded).at_tokens(torch.tensor([3, 0])).ids, torch.tensor([[7, 8, 9], [1, 2, -1]])
    )
    csr = KeptSet.from_vllm(torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([0, 2, 5, 6, 7]))
    picked = csr.at_tokens(torch.tensor([1, 3]))
    assert torch.equal(picked.ids, torch.tensor([3, 4, 5, 7])) and torch.equal(picked.offsets, torch.tensor([0, 3, 4]))


def _counting_compactions(monkeypatch) -> list:
    """The active counts of the calls that ran compacted from here on (``pipeline.active_tokens`` not None)."""
    from grpo_kernels import pipeline

    counts, real = [], pipeline.active_tokens

    def counted(*args, **kwargs):
        active = real(*args, **kwargs)
        if active is not None:
            counts.append(active[0].numel())
        return active

    monkeypatch.setattr(pipeline, "active_tokens", counted)
    return counts


@pytest.mark.parametrize("convention", ["verl", "trl"])
@pytest.mark.parametrize(
    "backend, form", [("torch", "logits"), ("torch", "hidden_states"), ("triton", "hidden_states")]
)
def test_the_distillation_losses_compact_their_pass(backend, form, convention, monkeypatch):
    """The top-k distillation's pass (the student's log-probs at the teacher's ids) and the reverse-KL one run on the
    active tokens alone at 10 % active: loss, metrics, per-token losses and gradients equal the dense call's."""
    compactions = _counting_compactions(monkeypatch)
    hidden, weight, batch = _batch(seed=4)
    mask, active = batch["completion_mask"], int((batch["completion_mask"] != 0).sum())
    g = torch.Generator().manual_seed(4)
    teacher_ids = torch.stack([torch.randperm(V, generator=g)[:3] for _ in range(B * T)]).view(B, T, 3)
    teacher_ids = torch.where(mask.unsqueeze(-1) == 0, V + 5, teacher_ids)  # garbage where nothing is read
    teacher_logps = torch.log_softmax(torch.randn(B, T, 3, generator=g), -1) - 0.5
    teacher_logp = torch.where(mask == 0, float("nan"), -torch.rand(B, T, generator=g))

    def run(loss):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if form == "logits":
            x = _logits(h.detach(), w.detach(), mask).requires_grad_()
            head, leaves = dict(logits=x), [x]
        else:
            head, leaves = dict(logits=h, weight=w), [h, w]
        if loss == "top-k":
            logits = head.pop("logits")
            out = (
                topk_distillation_loss(
                    logits, teacher_ids, teacher_logps, mask, convention=convention, backend=backend, **head
                )
                if form == "logits"
                else fused_linear_topk_distillation_loss(
                    logits, head["weight"], teacher_ids, teacher_logps, mask, convention=convention, backend=backend
                )
            )
        else:
            out = reverse_kl_distillation_loss(
                head.pop("logits"), batch["completion_ids"], teacher_logp, mask, backend=backend, **head
            )
        out.loss.backward()
        return out, [t.grad for t in leaves]

    for loss in ("top-k", "reverse KL"):
        (ours, grads), (dense, dense_grads) = run(loss), _dense(lambda loss=loss: run(loss))
        assert compactions == [active], (loss, compactions)
        compactions.clear()
        torch.testing.assert_close(ours.loss, dense.loss, **TIGHT)
        torch.testing.assert_close(ours.per_token_loss, dense.per_token_loss, **TIGHT, equal_nan=True)
        assert set(ours.metrics) == set(dense.metrics)
        for name, value in dense.metrics.items():
            torch.testing.assert_close(ours.metrics[name], value, **TIGHT, equal_nan=True, msg=name)
        for got, want in zip(grads, dense_grads, strict=True):
            torch.testing.assert_close(got, want, **TIGHT, equal_nan=True)


def test_the_heads_products_run_over_the_active_tokens_alone(monkeypatch):
    """The torch path's head computes the active tokens' rows alone, forward and backward (a masked token costs no
    product), and the dense path all of them; at more than ``COMPACTION_SHARE`` of the tokens active, all of them."""
    hidden, weight, batch = _batch(share=0.1)
    active = int((batch["completion_mask"] != 0).sum())
    rows = []
    for name in ("linear_forward", "linear_backward"):
        original = getattr(torch_path, name)

        def recorded(hidden_rows, *args, original=original, **kwargs):
            rows.append(hidden_rows.shape[0])
            return original(hidden_rows, *args, **kwargs)

        monkeypatch.setattr(torch_path, name, recorded)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    fused_linear_grpo_loss(h, w, **batch, backend="torch").loss.backward()
    assert rows == [active, active]
    rows.clear()
    mostly_active = dict(batch, completion_mask=torch.ones(B, T), completion_ids=batch["completion_ids"].clamp(min=0))
    mostly_active["old_logps"] = mostly_active["ref_logps"] = None
    fused_linear_grpo_loss(hidden.clone().requires_grad_(), weight, **mostly_active, backend="torch").loss.backward()
    assert rows == [B * T, B * T]


def _vocabulary_split_rank(rank, world):
    import torch.distributed as dist

    hidden, weight, batch = _batch(seed=2)
    part = V // world + 1
    start, stop = rank * part, min((rank + 1) * part, V)
    h, w = hidden.clone().requires_grad_(), weight[start:stop].clone().requires_grad_()
    out = fused_linear_grpo_loss(
        h, w, **batch, beta=0.04, backend="torch", vocab_parallel_group=dist.group.WORLD, vocab_start_index=start
    )
    out.loss.backward()
    return out.loss.detach(), out.per_token_logps, h.grad, w.grad, (start, stop)


def test_a_vocabulary_split_compacts_alike_on_every_rank():
    """Two ranks, each a slice of the head: every rank compacts the same tokens (the mask is the call's), and the
    loss, log-probs and gradients equal one process's dense call."""
    from gloo_ranks import run_ranks

    hidden, weight, batch = _batch(seed=2)

    def whole():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fused_linear_grpo_loss(h, w, **batch, beta=0.04, backend="torch")
        out.loss.backward()
        return out, h.grad, w.grad

    dense, d_hidden, d_weight = _dense(whole)
    for loss, logps, h_grad, w_grad, (start, stop) in run_ranks(_vocabulary_split_rank, 2, timeout=300):
        torch.testing.assert_close(loss, dense.loss.detach(), **TIGHT)
        torch.testing.assert_close(logps, dense.per_token_logps, **TIGHT)
        torch.testing.assert_close(h_grad, d_hidden, **TIGHT)
        torch.testing.assert_close(w_grad, d_weight[start:stop], **TIGHT)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_method_family_compacts_its_log_prob_pass(backend, monkeypatch):
    """SFT, RFT and DPO (their masks' log-prob pass) on a tenth of the tokens: the head's products over the active rows
    alone on the torch path, and the loss, log-probs and gradients of the dense call, from hidden states and logits."""
    from grpo_kernels import dpo_loss, rft_loss, sft_loss

    hidden, weight, batch = _batch(seed=4)
    ids, mask = batch["completion_ids"], batch["completion_mask"]
    B2 = B - 1 if B % 2 else B  # DPO pairs its rows
    calls = {
        "sft hidden states": lambda h, w: sft_loss(h, ids, mask, weight=w, backend=backend),
        "rft logits": lambda h, w: rft_loss(
            _logits(h, w, mask), ids, mask, torch.tensor([1.0, 0.0, 1.0]), backend=backend
        ),  # fmt: skip
        "dpo hidden states": lambda h, w: dpo_loss(
            h[:B2], ids[:B2], mask[:B2], torch.zeros(B2, T), weight=w, backend=backend
        ),
    }
    for name, call in calls.items():

        def run(call=call):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            out = call(h, w)
            out.loss.backward()
            return out, h.grad, w.grad

        (ours, *grads), (dense, *dense_grads) = run(), _dense(run)
        torch.testing.assert_close(ours.loss, dense.loss, **TIGHT, msg=name)
        torch.testing.assert_close(ours.per_token_logps, dense.per_token_logps, **TIGHT, msg=name)
        for got, want in zip(grads, dense_grads, strict=True):
            torch.testing.assert_close(got, want, **TIGHT, equal_nan=True, msg=name)
    rows = []
    original = torch_path.linear_forward
    monkeypatch.setattr(
        torch_path, "linear_forward", lambda h, *a, **k: rows.append(h.shape[0]) or original(h, *a, **k)
    )
    sft_loss(hidden, ids, mask, weight=weight, backend="torch")
    assert rows == [int((mask != 0).sum())]
