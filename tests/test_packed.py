"""Packed (padding-free) batches: ``cu_seqlens`` and [total, V] logits give what the padded layout gives.

The oracle is the same loss on the padded [S, T_max] layout of the same sequences (itself
checked against the reference everywhere else): loss, the gradient of every real token's
logits, the per-token log-probs and every metric, for every loss type, importance-sampling
level and path. Packs hold sequences of very different lengths, an empty one, and one alone.
"""

import pytest
import torch
from helpers import LOSS_TYPE_REGISTRY, LOSS_TYPES, assert_close

from grpo_kernels import GRPOLoss, grpo_loss, grpo_loss_reference, token_logprobs

TOL = dict(atol=2e-6, rtol=1e-5)
PATHS = [("torch", None), ("triton", True), ("triton", False)]
LOSS_DEFAULTS = {
    "dr_grpo": dict(max_completion_length=9),
    "cispo": dict(epsilon_high=1.2),
    "dro": dict(dro_beta=0.3),
    "clip_cov": dict(clip_cov_ratio=0.25, clip_cov_lb=-2.0, clip_cov_ub=2.0),
    "kl_cov": dict(kl_cov_ratio=0.25),
}


def _pack(lengths, V=301, seed=0, per_token_adv=False, device="cpu"):
    """(padded inputs [S, T_max], packed inputs [total], cu_seqlens) of the same sequences."""
    g = torch.Generator().manual_seed(seed)
    S, T = len(lengths), max(max(lengths), 1)
    mask = (torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()
    if S > 2 and lengths[0] > 3:
        mask[0, 1] = 0  # a masked token inside a sequence too (a tool-output token, say)
    padded = dict(
        logits=2 * torch.randn(S, T, V, generator=g),
        completion_ids=torch.randint(0, V, (S, T), generator=g),
        completion_mask=mask,
        advantages=torch.randn((S, T) if per_token_adv else (S,), generator=g),
        old_logps=-5 + 0.5 * torch.randn(S, T, generator=g),
        ref_logps=-5 + 0.5 * torch.randn(S, T, generator=g),
    )
    valid = torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    # old and reference log-probs near the current ones: ratios on both sides of the clip range, VESPO's weight alive
    lp = torch.log_softmax(padded["logits"] / 0.9, -1).gather(-1, padded["completion_ids"].unsqueeze(-1))[..., 0]
    padded["old_logps"], padded["ref_logps"] = lp + padded["old_logps"] + 5, lp + padded["ref_logps"] + 5
    packed = {k: (v[valid] if v.dim() >= 2 and v.shape[:2] == (S, T) else v) for k, v in padded.items()}
    cu = torch.zeros(S + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    to = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
    return to(padded), to(packed), cu.to(device), valid.to(device)


def _run(inputs, backend, one_pass, **kwargs):
    logits = inputs["logits"].detach().clone().requires_grad_()
    out = grpo_loss(
        logits, **{k: v for k, v in inputs.items() if k != "logits"}, backend=backend, one_pass=one_pass, **kwargs
    )
    out.loss.backward()
    return out, logits.grad


def _assert_same(padded_run, packed_run, valid, mask):
    (expected, expected_grad), (out, grad) = padded_run, packed_run
    assert_close("loss", expected.loss, out.loss, **TOL)
    assert_close("dlogits of the real tokens", expected_grad[valid], grad, **TOL)
    assert torch.count_nonzero(expected_grad[~valid]) == 0
    active = mask[valid] != 0
    assert_close("per-token log-probs", expected.per_token_logps[valid][active], out.per_token_logps[active], **TOL)
    assert set(out.metrics) == set(expected.metrics)
    for name, value in expected.metrics.items():
        assert_close(name, value, out.metrics[name], **TOL)


# each at the levels it takes (vespo and the families make their own ratio from the token log-ratios)
CASES = [(loss_type, level) for loss_type in LOSS_TYPES for level in LOSS_TYPE_REGISTRY[loss_type].levels]


@pytest.mark.parametrize("loss_type, level", CASES)
@pytest.mark.parametrize("backend, one_pass", PATHS)
def test_packed_equals_padded(device, backend, one_pass, loss_type, level):
    padded, packed, cu, valid = _pack([5, 1, 0, 9, 3], seed=len(loss_type), device=device)
    options = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=0.04,
        temperature=0.9,
        **LOSS_DEFAULTS.get(loss_type, {}),
    )
    torch.manual_seed(0)  # Clip-Cov's draw: from the same generator state in both layouts
    padded_out = _run(padded, backend, one_pass, **options)
    torch.manual_seed(0)
    _assert_same(
        padded_out, _run(packed, backend, one_pass, cu_seqlens=cu, **options), valid, padded["completion_mask"]
    )


@pytest.mark.parametrize("backend, one_pass", PATHS)
def test_packed_with_every_input_form(device, backend, one_pass):
    """Per-token advantages, per-sequence importance weights, [1, total] shapes, the entropy bonus and
    both policy masks (whose per-sequence KL and entropy quantile must see the sequences)."""
    padded, packed, cu, valid = _pack([4, 8, 2, 6], seed=3, per_token_adv=True, device=device)
    iw = torch.tensor([0.9, 1.1, 1.3, 0.7], device=device)
    packed_1row = {k: (v.unsqueeze(0) if k != "logits" else v.unsqueeze(0)) for k, v in packed.items()}
    options = dict(beta=0.04, entropy_coef=0.05, top_entropy_quantile=0.6, off_policy_mask_threshold=0.02)
    expected = _run(padded, backend, one_pass, importance_weights=iw, **options)
    out, grad = _run(packed_1row, backend, one_pass, importance_weights=iw, cu_seqlens=cu, **options)
    assert out.per_token_logps.shape == (1, int(cu[-1]))
    flat = type(out)(out.loss, out.metrics, out.per_token_logps.reshape(-1))
    _assert_same(expected, (flat, grad[0]), valid, padded["completion_mask"])


@pytest.mark.parametrize("backend, one_pass", PATHS)
def test_a_pack_of_one_sequence_and_the_module(device, backend, one_pass):
    padded, packed, cu, valid = _pack([7], seed=4, device=device)
    module = GRPOLoss(beta=0.04, backend=backend, one_pass=one_pass)
    expected, out = module(**padded), module(**packed, cu_seqlens=cu)
    assert_close("loss", expected.loss, out.loss, **TOL)
    lp = token_logprobs(packed["logits"], packed["completion_ids"], 0.8, backend=backend, cu_seqlens=cu)
    assert lp.shape == (7,)
    assert_close(
        "token_logprobs", token_logprobs(padded["logits"], padded["completion_ids"], 0.8, backend=backend)[0], lp, **TOL
    )


def test_bad_packs_are_named():
    _, packed, cu, _ = _pack([3, 2], seed=5)
    with pytest.raises(
        ValueError,
        match=r"cu_seqlens must start at 0, never decrease and end at the packed token "
        r"count 5, got \[0, 3, 4\]",
    ):
        grpo_loss(**packed, cu_seqlens=torch.tensor([0, 3, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must be an int32 / int64 tensor"):
        grpo_loss(**packed, cu_seqlens=cu.float())
    with pytest.raises(
        ValueError,
        match=r"old_logps of a packed batch must be \[total\] or \[1, total\] with "
        r"total = 5, got \(4,\)",
    ):
        grpo_loss(**{**packed, "old_logps": packed["old_logps"][:4]}, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"advantages \(per token; or per sequence \[S\] = \[2\]\)"):
        grpo_loss(**{**packed, "advantages": torch.zeros(3)}, cu_seqlens=cu)
    with pytest.raises(ValueError, match="drop_last_position=True applies to padded"):
        grpo_loss(**packed, cu_seqlens=cu, drop_last_position=True)


@pytest.mark.parametrize(
    "loss_type, level",
    [("grpo", "token"), ("dr_grpo", "sequence"), ("luspo", "token"), ("vespo", "token"), ("sapo", "sequence_token")],
)
@pytest.mark.parametrize(
    "backend, lm_head_mode", [("torch", None), ("triton", "recompute"), ("triton", "three_products")]
)
def test_packed_hidden_states_equal_padded(device, backend, lm_head_mode, loss_type, level):
    """The fused lm_head on a packed batch: hidden states [total, H], the same loss and d hidden, d weight."""
    from grpo_kernels import fused_linear_grpo_loss

    padded, packed, cu, valid = _pack([6, 0, 2, 9], V=257, seed=7, device=device)
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(*valid.shape, 24, generator=g).to(device)
    weight = (0.4 * torch.randn(257, 24, generator=g)).to(device)
    options = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=0.04,
        entropy_coef=0.05,
        **LOSS_DEFAULTS.get(loss_type, {}),
    )
    runs = []
    for inputs, h, extra in ((padded, hidden, {}), (packed, hidden[valid], {"cu_seqlens": cu})):
        h, w = h.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fused_linear_grpo_loss(
            h,
            w,
            **{k: v for k, v in inputs.items() if k != "logits"},
            backend=backend,
            lm_head_mode=lm_head_mode,
            **options,
            **extra,
        )
        out.loss.backward()
        runs.append((out, h.grad, w.grad))
    (expected, dh_expected, dw_expected), (out, dh, dw) = runs
    assert_close("loss", expected.loss, out.loss, **TOL)
    assert_close("d hidden", dh_expected[valid], dh, atol=1e-5, rtol=1e-5)
    assert_close("d weight", dw_expected, dw, atol=1e-5, rtol=1e-5)
    for name, value in expected.metrics.items():
        assert_close(name, value, out.metrics[name], **TOL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_as_many_sequences_as_tokens_takes_no_guess(backend):
    """Lengths [1, 1, 1, 0, 2]: five sequences and five tokens. Advantages [5] could be one a sequence or one a token,
    and the two read them differently (the loss was silently the per-token reading's while the check took them per
    sequence; the Triton kernels read even [S, 1] per token, by its count): refused by name; [S, 1] and [1, total]
    each say which, and both equal the padded call's specification, on both backends."""
    g = torch.Generator().manual_seed(3)
    B, T, V = 5, 2, 11
    logits, ids = torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g)
    mask = torch.tensor([[1.0, 0], [0, 1], [0, 1], [0, 0], [1, 1]])
    advantages, old = torch.randn(B, generator=g), torch.randn(B, T, generator=g) - 2
    active = mask.reshape(-1) != 0
    cu = torch.tensor([0, 1, 2, 3, 3, 5])
    packed = dict(
        logits=logits.reshape(-1, V)[active], completion_ids=ids.reshape(-1)[active],
        completion_mask=torch.ones(5), old_logps=old.reshape(-1)[active], cu_seqlens=cu, backend=backend,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"advantages of shape \[5\] is ambiguous in this packed batch"):
        grpo_loss(**packed, advantages=advantages)
    padded = grpo_loss_reference(logits, ids, mask, advantages, old, loss_type="dapo")
    per_sequence = grpo_loss(**packed, advantages=advantages.reshape(-1, 1), loss_type="dapo")
    torch.testing.assert_close(per_sequence.loss, padded.loss)
    per_token = advantages[:, None].expand(B, T).reshape(-1)[active].reshape(1, -1)
    torch.testing.assert_close(grpo_loss(**packed, advantages=per_token, loss_type="dapo").loss, padded.loss)
