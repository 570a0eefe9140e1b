"""The split-row one-pass kernel (kernels/split_row.py) against the reference.

In Triton's interpreter the kernel runs as its two launches (publish every chunk's state; merge and
write), the same device functions as the single cooperative launch a GPU runs (compiled ahead of time
for sm_90 and sm_80 in tests/test_aot_compile.py). Every loss type and option also runs on it through
tests/test_loss.py's "triton-split-row" path; here: the number of chunks, a vocabulary that is not a
multiple of the chunks or blocks, -inf logits, masked rows, the entropy bonus and bf16, in both variants (a
chunk of one block held in registers, a longer chunk read again from L2) and with K = 1 (a row held whole).
"""

import pytest
import torch
from helpers import OPTION_CASES, assert_close, make_batch, split_row

from grpo_kernels import grpo_loss, grpo_loss_reference
from grpo_kernels.kernels import logits_launch, split_row_launch

TOL = dict(atol=1e-6, rtol=1e-5)


# the two variants: a chunk of one 256-logit block, held in registers (K = 4 at V = 1003, 20 at 4999); 4 chunks of
# 128-logit blocks (2 a chunk at V = 1003, 10 at 4999), read again from L2 for the gradient
VARIANTS = {"held": dict(chunks=64, block_v=256), "streamed": dict(chunks=4, block_v=128)}


def _spy(monkeypatch, module, name: str) -> list:
    """Each launch of ``module.name`` (a Triton kernel) records its keyword arguments, then runs; the list of them."""
    calls, kernel = [], getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            return lambda **kwargs: calls.append(kwargs) or kernel[grid](**kwargs)

        def __getattr__(self, attribute):  # warmup (a GPU's resident-program count) and the rest: the kernel's own
            return getattr(kernel, attribute)

    monkeypatch.setattr(module, name, Spy())
    return calls


def _seen(launches) -> list:
    """(K, HOLD_CHUNK, BLOCK_V) of each split-row launch: what a failed assertion shows."""
    return [(c["K"], c["HOLD_CHUNK"], c["BLOCK_V"]) for c in launches]


@pytest.fixture
def launched(monkeypatch):
    """The split-row kernel's launches in the test, each its keyword arguments (K, K_LANES, HOLD_CHUNK, ...)."""
    from grpo_kernels.kernels import split_row as split_row_kernels

    return _spy(monkeypatch, split_row_kernels, "split_row_forward_kernel")


def _both(batch, chunks, block_v=256, **options):
    """((loss, dlogits, output) of the reference, (the same) of the split-row kernel)."""
    results = []
    for ours in (False, True):
        logits = batch["logits"].detach().clone().requires_grad_()
        inputs = {**batch, "logits": logits}
        if ours:
            with split_row(chunks, block_v):
                out = grpo_loss(**inputs, backend="triton", one_pass=True, **options)
        else:
            out = grpo_loss_reference(
                **{**inputs, "logits": logits.float()} if logits.dtype != torch.float32 else inputs, **options
            )
        out.loss.backward()
        results.append((out.loss, logits.grad, out))
    return results


def _check(expected, actual, tol=TOL, batch=None):
    assert_close("loss", expected[0], actual[0], **tol)
    assert_close("dlogits", expected[1], actual[1], **tol)
    assert sorted(expected[2].metrics) == sorted(actual[2].metrics)
    for name, value in expected[2].metrics.items():
        assert_close(f"metric {name}", value, actual[2].metrics[name], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("V", [1003, 64, 4999])
def test_any_number_of_chunks_and_any_vocabulary(device, chunks, V):
    """At most K chunks of whole 256-logit blocks, none empty, the last one short (V not a multiple of
    anything); K = 1 (V = 64: one block) is a row in one program, waiting on no sibling."""
    batch = make_batch(device=device, V=V, seed=V + chunks)
    _check(*_both(batch, chunks, beta=0.04, temperature=0.9))


def test_the_chunks_cover_the_row_in_whole_blocks():
    """At most the K asked for, chunks of whole blocks, as few blocks a chunk as that allows, none empty."""
    for V, block, chunks in [
        (151936, 4096, 8),
        (151936, 4096, 16),
        (151936, 4096, 64),
        (151936, 8192, 19),
        (32000, 4096, 4),
        (32000, 4096, 8),
        (1003, 256, 4),
        (5, 2, 8),
        (1, 2, 4),
        (7, 2, 3),
    ]:
        k, chunk_len, held = split_row_launch.split_row_chunks(V, block, chunks)
        assert held == (chunk_len == block)
        blocks = -(-V // block)
        assert chunk_len % block == 0 and k * chunk_len >= V > (k - 1) * chunk_len  # covered, the last not empty
        assert k <= chunks and (chunk_len == block or -(-blocks // (chunk_len // block - 1)) > chunks)
    assert split_row_launch.split_row_chunks(151936, 4096, 8) == (8, 5 * 4096, False)  # 5 blocks of L2-read chunks
    assert split_row_launch.split_row_chunks(151936, 4096, 16) == (13, 3 * 4096, False)  # not 16 chunks with 3 empty
    assert split_row_launch.split_row_chunks(151936, 4096, 64) == (38, 4096, True)  # a block a chunk: held in registers
    assert split_row_launch.split_row_chunks(32000, 4096, 8) == (8, 4096, True)


@pytest.mark.parametrize(
    "V, chunks, block_v, dtype, held",
    [
        (4999, 2, 2048, torch.float32, False),  # 3 blocks: chunks of 2 blocks, the second read from L2
        (4999, 3, 2048, torch.float32, True),  # a block a chunk, K = 3 (not a power of 2: the merge masks lanes)
        (4999, 8, 1024, torch.float32, True),  # more chunks than blocks: K = 5, a block each
        (1003, 4, 1024, torch.float32, True),  # K = 1: the row in one program, a block held (no sibling to wait on)
        (32000, 8, None, torch.bfloat16, True),  # the launcher's 4096-logit blocks: 8 chunks held
    ],
)
def test_which_variant_runs_and_both_match_the_reference(device, launched, V, chunks, block_v, dtype, held):
    """A chunk of one block is held in registers from its load to its gradient (HOLD_CHUNK), a longer one is
    read again; K is any number of chunks. Both against the reference, with the entropy bonus's gradient too."""
    batch = make_batch(device=device, V=V, seed=V + chunks, dtype=dtype)
    expected, actual = _both(batch, chunks, block_v, beta=0.04, entropy_coef=0.03, temperature=0.9)
    assert launched and all(c["HOLD_CHUNK"] == held for c in launched), _seen(launched)
    k = launched[0]["K"]
    assert k <= chunks and launched[0]["K_LANES"] == 1 << (k - 1).bit_length()
    if dtype == torch.float32:
        _check(expected, actual)
    else:
        assert_close("loss", expected[0], actual[0], atol=1e-5, rtol=1e-4)
        assert_close("dlogits", expected[1], actual[1], atol=1e-5, rtol=2 * torch.finfo(dtype).eps)


# the loss options in the held variant; in the streamed one those that reach its own code (the entropy off, rows
# not 16-byte aligned, one token, several blocks a chunk): the loss terms are one function for every kernel
LAYOUT_CASES = ["no_entropy", "strided_logits_view", "one_token", "vocab_over_several_blocks"]
LOSS_CASES = [
    "delta_and_dual_clip_per_token_adv",
    "kl_k3_clamped_verl",
    "bias_corrected_kl",
    "cispo_per_token_adv",
    "sapo_temperatures",
]


@pytest.mark.parametrize(
    "case, variant",
    [(case, "held") for case in LOSS_CASES + LAYOUT_CASES] + [(case, "streamed") for case in LAYOUT_CASES],
)
def test_options(device, launched, case, variant):
    from helpers import BATCH_KEYS

    options = dict(OPTION_CASES[case])
    batch = make_batch(device=device, seed=5, **{k: options.pop(k) for k in list(options) if k in BATCH_KEYS})
    _check(*_both(batch, **VARIANTS[variant], **options))
    assert all(c["HOLD_CHUNK"] == (variant == "held") for c in launched), _seen(launched)


@pytest.mark.parametrize("variant", VARIANTS)
def test_minus_inf_logits_and_masked_rows(device, launched, variant):
    """-inf logits (a vocabulary masked out) in several chunks, including a whole chunk of them; the
    partly and fully masked rows of make_batch are never read and get zero gradient rows."""
    batch = make_batch(device=device, V=1003, seed=2)
    logits = batch["logits"].clone()
    logits[..., 5:40] = float("-inf")
    logits[..., 512:768] = float("-inf")  # a whole chunk of 256 (either variant at K = 4)
    logits[..., 900:950] = float("-inf")
    batch["logits"] = logits
    batch["completion_ids"] = batch["completion_ids"].clamp(min=40, max=511)
    expected, actual = _both(batch, **VARIANTS[variant], beta=0.04)
    _check(expected, actual)
    assert all(c["HOLD_CHUNK"] == (variant == "held") and c["K"] == 4 for c in launched), _seen(launched)
    masked = batch["completion_mask"] == 0
    assert masked.any() and torch.count_nonzero(actual[1][masked]) == 0
    assert torch.isfinite(actual[2].metrics["entropy"])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_the_entropy_bonus(device, loss_type, variant):
    batch = make_batch(device=device, V=1003, seed=7)
    extra = {"cispo": dict(epsilon_high=1.1)}.get(loss_type, {})
    _check(*_both(batch, **VARIANTS[variant], loss_type=loss_type, entropy_coef=0.05, temperature=0.8, **extra))


def test_bf16_logits(device):
    batch = make_batch(device=device, V=4999, seed=4, dtype=torch.bfloat16)
    expected, actual = _both(batch, 8, beta=0.04)
    eps = torch.finfo(torch.bfloat16).eps
    assert_close("loss", expected[0], actual[0], atol=1e-5, rtol=1e-4)
    assert_close("dlogits", expected[1], actual[1], atol=1e-5, rtol=2 * eps)
    assert actual[1].dtype == torch.bfloat16


def test_the_default_schedule_is_unchanged_until_measured(device, monkeypatch):
    """Without a K (tuned.json's "split_row", or SPLIT_ROW_CHUNKS) the one-pass loss keeps its kernel."""
    assert split_row_launch.SPLIT_ROW_CHUNKS is None
    calls = []
    real = split_row_launch.split_row_forward
    monkeypatch.setattr(split_row_launch, "split_row_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    batch = make_batch(device=device, seed=1)
    grpo_loss(**batch, backend="triton", one_pass=True)
    assert not calls
    with split_row(2):
        logits = batch["logits"].clone().requires_grad_()
        grpo_loss(**{**batch, "logits": logits}, backend="triton", one_pass=True).loss.backward()
    assert calls == [1]


@pytest.mark.parametrize("chunks, held", [(32, True), (8, False)])  # 20 chunks of a block; 7 of 3 blocks
def test_no_wait_times_out(device, launched, chunks, held):
    """On a GPU the kernel is one cooperative launch whose every wait must return (no timeout recorded);
    in the interpreter there is no wait (two launches) and no flag. Both variants (the sanitizer's case)."""
    from grpo_kernels import GRPOOptions
    from grpo_kernels.kernels.contracts import OnePassGradient, TokenInputs

    batch = make_batch(device=device, V=4999, seed=3)
    logits, ids = batch["logits"], batch["completion_ids"]
    N = ids.numel()
    f32 = dict(device=device, dtype=torch.float32)
    with split_row(chunks):
        tokens = TokenInputs(
            mask=batch["completion_mask"].reshape(-1),
            advantages=batch["advantages"].repeat_interleave(ids.shape[1]).contiguous(),
            old_logps=batch["old_logps"].reshape(-1).contiguous(),
            ref_logps=batch["ref_logps"].reshape(-1).contiguous(),
        )
        r = logits_launch.forward(
            logits,
            ids,
            kernel_loss=GRPOOptions(beta=0.04).kernel_loss,
            tokens=tokens,
            compute_entropy=True,
            gradient=OnePassGradient(torch.full((N,), 1.0 / N, **f32)),
        )
    assert r.grad_logits is not None and torch.isfinite(r.grad_logits).all()
    assert launched and all(c["HOLD_CHUNK"] == held for c in launched), _seen(launched)
    if logits.is_cuda:
        assert int(r.split_row_error) == 0
    else:
        assert r.split_row_error is None


@pytest.mark.parametrize("variant", VARIANTS)
def test_full_logits_with_a_dropped_position(device, launched, variant):
    """[B, T + 1, V] logits (drop_last_position): the kernel writes the first T positions of the full-size
    gradient, whose last position stays zero, as the one-pass kernel does (what a measured default would meet)."""
    batch = make_batch(device=device, V=1003, seed=6)
    B, T, V = batch["logits"].shape
    inputs = {k: v for k, v in batch.items() if k != "logits"}
    options = dict(beta=0.04, temperature=0.8, entropy_coef=0.02)
    view = batch["logits"].detach().clone().requires_grad_()
    expected = grpo_loss_reference(view, **inputs, **options)
    expected.loss.backward()
    last = 3.0 * torch.randn(B, 1, V, generator=torch.Generator().manual_seed(5)).to(device)
    full = torch.cat([batch["logits"].detach(), last], dim=1).requires_grad_()
    with split_row(**VARIANTS[variant]):
        out = grpo_loss(full, **inputs, **options, backend="triton", one_pass=True, drop_last_position=True)
    out.loss.backward()
    assert launched and all(c["HOLD_CHUNK"] == (variant == "held") for c in launched), _seen(launched)
    assert_close("loss", expected.loss, out.loss, **TOL)
    assert_close("dlogits", view.grad, full.grad[:, :-1], **TOL)
    assert torch.count_nonzero(full.grad[:, -1]) == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_packed_batch(device, launched, variant):
    """A packed [total, V] batch (cu_seqlens, an empty sequence, per-token advantages, the entropy bonus) equals
    the padded one under the reference, token for token."""
    from test_packed import _pack

    padded, packed, cu, valid = _pack([5, 1, 0, 9, 3], V=1003, seed=8, per_token_adv=True, device=device)
    options = dict(beta=0.04, temperature=0.9, entropy_coef=0.05)
    leaf = padded["logits"].detach().clone().requires_grad_()
    expected = grpo_loss_reference(leaf, **{k: v for k, v in padded.items() if k != "logits"}, **options)
    expected.loss.backward()
    logits = packed["logits"].detach().clone().requires_grad_()
    with split_row(**VARIANTS[variant]):
        out = grpo_loss(
            logits,
            **{k: v for k, v in packed.items() if k != "logits"},
            **options,
            backend="triton",
            one_pass=True,
            cu_seqlens=cu,
        )
    out.loss.backward()
    assert launched and all(c["HOLD_CHUNK"] == (variant == "held") for c in launched), _seen(launched)
    assert_close("loss", expected.loss, out.loss, **TOL)
    assert_close("dlogits of the real tokens", leaf.grad[valid], logits.grad, **TOL)


def test_the_backward_ignores_the_forwards_schedules(device, monkeypatch):
    """A measured default that splits rows (or a persistent grid) is the one-pass forward's schedule: the two-pass
    backward, given the same configuration (tuned.json's entry, or a sweep candidate's), runs its own kernel and
    passes it neither (Triton would take them for compile options: another cache entry, compiled again)."""
    from grpo_kernels.kernels import logits

    calls = _spy(monkeypatch, logits, "logprob_backward_kernel")
    batch = make_batch(device=device, V=1003, seed=9)
    logits, ids = batch["logits"], batch["completion_ids"]
    N = ids.numel()
    lse = torch.logsumexp(logits.float(), -1).reshape(-1)
    g = torch.randn(N, generator=torch.Generator().manual_seed(1)).to(device)
    plain = logits_launch.backward(logits, ids, lse, g, 1.0)
    scheduled = logits_launch.backward(logits, ids, lse, g, 1.0, config={"split_row": 8, "programs_per_sm": 2})
    assert torch.equal(plain, scheduled)
    assert set(calls[0]) == set(calls[1]) and not set(calls[1]) & {"split_row", "programs_per_sm"}
