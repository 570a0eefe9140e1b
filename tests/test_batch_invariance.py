"""One log-prob for a token whatever else is in the batch ("truly on-policy"): on the default paths, a token's
log-prob and entropy are bitwise the same (a) at batch sizes 1, 7 and 64 with its row unchanged, (b) padded or
packed, (c) wherever the torch path's chunk boundaries fall, and (d) in the no-grad pass (old / reference
log-probs) and the training forward; then, on-policy, the ratio is exactly 1 and the KL to an identical reference
exactly 0. From logits (both backends) and from hidden states (the fused head's default mode, both backends), with one
exception: the torch path's head product is the CPU BLAS's GEMM, which picks its kernel and its threads' split by the
batch's size, so there (d) holds at each batch size and (a) to fp32 rounding only.

On a GPU (the device suite runs this file first) the same tests hold the compiled kernels' default schedules to it:
each row is one program's (the one-pass kernel) and each lm_head tile a fixed [64, 128] shape, so nothing depends on
the batch. The schedules that divide the work by the batch (the persistent grid, split rows, the 3-product head's
cuBLAS tiles) are not defaults for these shapes; the README says which paths keep the promise."""

import pytest
import torch

from grpo_kernels import (
    fused_linear_grpo_loss,
    grpo_loss,
    linear_selective_log_softmax_and_entropy,
    linear_token_logprobs,
    token_logprobs,
    torch_path,
)

T, V, H = 6, 503, 32
SIZES = (1, 7, 64)
ROW = 3  # where the watched row sits in the larger batches (row 0 alone)


def _batch(size, seed=0, device="cpu"):
    """``size`` rows of logits, the watched row (the same values every time) at ``ROW`` (row 0 of a batch of 1)."""
    g = torch.Generator().manual_seed(seed)
    watched = torch.randn(T, V, generator=torch.Generator().manual_seed(123)) * 3
    logits = torch.randn(size, T, V, generator=g) * 3
    at = 0 if size == 1 else ROW
    logits[at] = watched
    ids = torch.randint(0, V, (size, T), generator=g)
    ids[at] = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(7))
    return logits.to(device), ids.to(device), at


def _loss_inputs(ids, device):
    size = ids.shape[0]
    mask = torch.ones(size, T, device=device)
    advantages = torch.linspace(-1, 1, size, device=device)
    return mask, advantages


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_logprobs_are_batch_invariant(device, backend):
    """(a) and (d): the watched row's log-probs and entropy are the same bits at every batch size, in the no-grad
    pass and in the training forward."""
    seen = []
    for size in SIZES:
        logits, ids, at = _batch(size, seed=size, device=device)
        logp, entropy = token_logprobs(logits, ids, 0.9, return_entropy=True, backend=backend)
        mask, advantages = _loss_inputs(ids, device)
        train = grpo_loss(logits.clone().requires_grad_(), ids, mask, advantages, temperature=0.9, backend=backend)
        seen.append((logp[at], entropy[at], train.per_token_logps[at]))
    first = seen[0]
    for size, (logp, entropy, trained) in zip(SIZES, seen, strict=True):
        assert torch.equal(logp, first[0]), f"log-probs at batch size {size}"
        assert torch.equal(entropy, first[1]), f"entropy at batch size {size}"
        assert torch.equal(trained, first[0]), f"the training forward's log-probs at batch size {size}"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_logprobs_are_invariant_to_padding_and_packing(device, backend):
    """(b): the watched row padded (among rows of other lengths) and packed (in a [total] batch) gives the same
    bits."""
    logits, ids, at = _batch(7, seed=1, device=device)
    alone = token_logprobs(logits[at : at + 1], ids[at : at + 1], 0.9, backend=backend)[0]
    lengths = [T, 2, T, T, 4, 1, T]
    packed_logits = torch.cat([logits[i, :n] for i, n in enumerate(lengths)])
    packed_ids = torch.cat([ids[i, :n] for i, n in enumerate(lengths)])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    packed = token_logprobs(packed_logits, packed_ids, 0.9, backend=backend, cu_seqlens=cu)
    start = int(cu[at])
    assert torch.equal(packed[start : start + T], alone)


def test_logprobs_are_invariant_to_the_torch_paths_chunk_boundaries(device, monkeypatch):
    """(c): the torch path works a chunk of tokens at a time; with chunks of 5 tokens the watched row's tokens fall
    on both sides of a boundary in one batch and inside one chunk in another: the same bits."""
    monkeypatch.setattr(torch_path, "CHUNK_ELEMENTS", 5 * V)
    logits, ids, at = _batch(7, seed=2, device=device)
    chunked = token_logprobs(logits, ids, 0.9, return_entropy=True, backend="torch")
    monkeypatch.setattr(torch_path, "CHUNK_ELEMENTS", 1 << 21)
    whole = token_logprobs(logits, ids, 0.9, return_entropy=True, backend="torch")
    for a, b in zip(chunked, whole, strict=True):
        assert torch.equal(a[at], b[at])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_on_policy_the_ratio_is_one_and_the_kl_zero_exactly(device, backend):
    """The old and reference log-probs from the no-grad pass on the same logits: the training forward's log-probs
    are the same bits, so every ratio is exactly 1 (no token clipped, the policy loss exactly -A per token) and the
    KL to an identical reference exactly 0."""
    logits, ids, _ = _batch(7, seed=3, device=device)
    mask, advantages = _loss_inputs(ids, device)
    old = token_logprobs(logits, ids, 0.9, backend=backend)
    out = grpo_loss(
        logits.clone().requires_grad_(),
        ids,
        mask,
        advantages,
        old_logps=old,
        ref_logps=old,
        beta=0.04,
        temperature=0.9,
        backend=backend,
        loss_type="dapo",
    )
    assert torch.equal(out.per_token_logps, old)
    assert out.metrics["kl"].item() == 0.0
    assert out.metrics["clip_ratio/region_mean"].item() == 0.0
    # ratio exactly 1 everywhere: the loss is -sum(A) / tokens, computed in the same order as the kernel's sum
    assert out.loss.item() == pytest.approx(-(advantages[:, None] * mask).sum().item() / mask.sum().item(), abs=1e-7)


def _hidden_batch(size, seed, device):
    """Hidden states with the watched row at ``ROW`` on a GPU; on the CPU at row 0 at every size: Triton's
    interpreter computes ``tl.dot`` with numpy's BLAS, whose result for a row depends on where the row sits in the
    tile (OpenBLAS 0.3.31's kernels; a GPU's MMA computes every row alike), so there the watched row keeps its
    place in its [64, BLOCK_V] tile while the batch around it grows."""
    g = torch.Generator().manual_seed(seed)
    watched = torch.randn(T, H, generator=torch.Generator().manual_seed(321))
    hidden = torch.randn(size, T, H, generator=g)
    at = 0 if size == 1 or device == "cpu" else ROW
    hidden[at] = watched
    weight = torch.randn(V, H, generator=torch.Generator().manual_seed(5)) * 0.3
    ids = torch.randint(0, V, (size, T), generator=g)
    ids[at] = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(7))
    return hidden.to(device), weight.to(device), ids.to(device), at


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_fused_heads_logprobs_are_batch_invariant(device, backend):
    """(a) and (d) from hidden states, on the fused head's default mode: the no-grad pass, the differentiable op
    and the loss's training forward give the watched row the same bits at every batch size. On the torch path (CPU
    BLAS: its GEMM kernel and thread split depend on the batch's size, e.g. MKL on an AMD EPYC with 2 threads) the
    three agree bit for bit at each batch size, and across sizes to fp32 rounding."""
    seen = []
    for size in SIZES:
        hidden, weight, ids, at = _hidden_batch(size, seed=size, device=device)
        logp, entropy = linear_token_logprobs(hidden, weight, ids, None, 0.9, return_entropy=True, backend=backend)
        op_logp, op_entropy = linear_selective_log_softmax_and_entropy(
            hidden.clone().requires_grad_(), weight, ids, None, 0.9, backend=backend
        )
        mask, advantages = _loss_inputs(ids, device)
        train = fused_linear_grpo_loss(
            hidden.clone().requires_grad_(),
            weight,
            ids,
            mask,
            advantages,
            temperature=0.9,
            backend=backend,
            lm_head_mode="recompute",
        )
        seen.append((logp[at], entropy[at], op_logp[at].detach(), op_entropy[at].detach(), train.per_token_logps[at]))
    first = seen[0]
    names = ("log-probs", "entropy", "the op's log-probs", "the op's entropy", "the training forward's log-probs")
    for size, values in zip(SIZES, seen, strict=True):
        for name, value, expected in zip(
            names, values, (first[0], first[1], first[0], first[1], first[0]), strict=True
        ):
            if backend == "triton":
                assert torch.equal(value, expected), f"{name} at batch size {size}"
            else:
                torch.testing.assert_close(value, expected, atol=1e-5, rtol=1e-6, msg=f"{name} at batch size {size}")
        same_batch = (values[0], values[1], values[0], values[1], values[0])
        for name, value, expected in zip(names, values, same_batch, strict=True):
            assert torch.equal(value, expected), f"{name} against the no-grad pass at batch size {size}"
