"""The O(N) kernels around a loss's logits pass (kernels/reduce.py) against the torch reductions they replace.

The token-weights kernel must give ``objective.reduction_weights`` (times the loss scale) and the entropy
bonus's ``entropy_bonus_weights`` for every loss type's reduction: the same operations in the same order, so
within 1e-6 relative (bit for bit in Triton's interpreter; a GPU's fp32 division may round differently);
the copies of the per-token inputs exactly; the loss-metrics kernel the reduced loss and TRL's masked means.
The end-to-end loss tests (test_loss.py and the rest) hold the whole call to the specification.
"""

import pytest
import torch

from grpo_kernels import GRPOOptions
from grpo_kernels.inputs import SequenceLayout
from grpo_kernels.kernels import reduce_launch
from grpo_kernels.kernels.contracts import FLAG_HIGH_CLIPPED, FLAG_LOW_CLIPPED, LossTokens, Sequences, TokenInputs
from grpo_kernels.objective import (
    clip_metric_values,
    entropy_divisor,
    masked_mean,
    metric_names,
    prompt_divisors,
    reduction_weights,
)
from grpo_kernels.pipeline import kernel_reduction

LOSS_TYPES = {
    "grpo": {},
    "bnpo": {},
    "dr_grpo": dict(max_completion_length=7),
    "dapo": {},
    "luspo": {},
    "cispo": dict(epsilon_high=1.1),
    "sapo": {},
}


def token_weights(
    mask, sequences, reduction, *, advantages=None, importance_weights=None, dropped_gradient=None, out=None
):
    """The token-weights kernel's ``TokenWeights`` from the mask (fp32, N elements) and the per-token or per-sequence
    advantages and importance weights (``reduce_launch.weighted_tokens`` on the ``LossTokens`` they make)."""
    tokens = TokenInputs(mask=mask, advantages=advantages, importance_weights=importance_weights)
    return reduce_launch.weighted_tokens(
        LossTokens(tokens, sequences, reduction), dropped_gradient=dropped_gradient, out=out
    )[1]


def entropy_bonus_weights(mask, opts, loss_mask=None, normalizer=None):
    """dLoss/dH per token of ``- objective.entropy_bonus``: -entropy_coef * M / its divisor (``entropy_divisor``), the
    torch side of the token-weights kernel's entropy weight."""
    return -opts.entropy_coef * mask / entropy_divisor(mask, opts, loss_mask, normalizer)


def _same(actual, expected):
    torch.testing.assert_close(actual, expected.float(), atol=0, rtol=1e-6)


def _mask(B, T, seed, fractional=False):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[-1] = 0  # a row with no active token
    if fractional:
        mask = mask * torch.rand(B, T, generator=g)
    return mask


@pytest.mark.parametrize(
    "loss_type,normalizer",
    [(t, None) for t in LOSS_TYPES]
    + [  # a normalizer: token_count's
        (t, n) for t in ("dapo", "cispo") for n in (37, 0, "tensor")
    ],
)
@pytest.mark.parametrize("loss_scale", [1.0, 0.25, "tensor"])
def test_token_weights_are_the_reductions_weights(device, loss_type, normalizer, loss_scale):
    B, T = 4, 9
    mask = _mask(B, T, seed=len(loss_type)).to(device)
    if normalizer == "tensor":
        normalizer = torch.tensor(23, device=device)  # an integer count, read and cast on the device
    scale = torch.tensor(0.5, device=device) if loss_scale == "tensor" else loss_scale
    opts = GRPOOptions(loss_type=loss_type, entropy_coef=0.03, **LOSS_TYPES[loss_type])
    advantages = torch.randn(B, device=device, dtype=torch.float64)  # any float dtype, written as fp32
    w = token_weights(mask, Sequences(B, T), kernel_reduction(opts, B, normalizer, scale), advantages=advantages)
    expected = reduction_weights(mask, opts, normalizer) * scale
    _same(w.weight.view(B, T), expected)
    _same(w.entropy_weight.view(B, T), entropy_bonus_weights(mask, opts) * scale)
    assert torch.equal(w.advantages.view(B, T), advantages.float()[:, None].expand(B, T))
    assert w.importance_weights is None


@pytest.mark.parametrize("normalizer", [None, 37, "tensor"])
@pytest.mark.parametrize("bonus_tokens", [False, True], ids=["mask", "bonus mask"])
def test_an_entropy_bonus_divided_as_the_loss_is(device, normalizer, bonus_tokens):
    """``entropy_reduction="loss"`` (OpenRLHF's entropy loss): the bonus's weights divide by the token-count loss's
    own divisor (the normalizer, else the active tokens), over the bonus's tokens, as ``entropy_bonus_weights``."""
    B, T = 4, 9
    mask = _mask(B, T, seed=5).to(device)
    bonus = (mask * (torch.rand(B, T, device=device) > 0.5)).contiguous() if bonus_tokens else None
    if normalizer == "tensor":
        normalizer = torch.tensor(23.0, device=device)
    opts = GRPOOptions(loss_type="dapo", entropy_coef=0.03, entropy_reduction="loss")
    w = token_weights(mask, Sequences(B, T), kernel_reduction(opts, B, normalizer, 0.5, bonus))
    expected = entropy_bonus_weights(mask if bonus is None else bonus, opts, mask, normalizer) * 0.5
    _same(w.entropy_weight.view(B, T), expected)
    _same(w.weight.view(B, T), reduction_weights(mask, opts, normalizer) * 0.5)
    if normalizer is None and bonus is None:  # the loss's divisor: its active tokens, as TRL's own count here
        _same(expected, entropy_bonus_weights(mask, opts.replace(entropy_reduction="token_mean")) * 0.5)


def test_fractional_masks_per_token_inputs_and_a_separate_bonus_mask(device):
    B, T = 3, 1100  # a row longer than the kernel's block of tokens
    mask = _mask(B, T, seed=1, fractional=True).to(device)
    bonus = (mask * (torch.rand(B, T, device=device) > 0.5)).contiguous()
    opts = GRPOOptions(entropy_coef=0.1)
    adv, iw = torch.randn(B, T, device=device), torch.rand(B, 1, device=device, dtype=torch.bfloat16)
    w = token_weights(
        mask, Sequences(B, T), kernel_reduction(opts, B, None, 1.0, bonus), advantages=adv, importance_weights=iw
    )
    close = dict(atol=0, rtol=1e-5)  # sums of fractional masks, in another order
    torch.testing.assert_close(w.weight.view(B, T), reduction_weights(mask, opts), **close)
    torch.testing.assert_close(w.entropy_weight.view(B, T), entropy_bonus_weights(bonus, opts), **close)
    assert torch.equal(w.advantages.view(B, T), adv)
    assert torch.equal(w.importance_weights.view(B, T), iw.float().expand(B, T))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "luspo"])
def test_a_packed_batch_takes_its_sequences_from_cu_seqlens(device, loss_type):
    """Sequences of 3, 0 (empty), 5 and 1 tokens: each token's weight is the padded layout's for its sequence."""
    cu_seqlens = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32, device=device)
    N, S = 9, 4
    mask = (torch.arange(N, device=device) % 4 != 1).float()
    layout = SequenceLayout(1, N, cu_seqlens)
    opts = GRPOOptions(loss_type=loss_type)
    per_sequence = torch.randn(S, device=device)
    w = token_weights(mask, layout.sequences, kernel_reduction(opts, S, None, 1.0), advantages=per_sequence)
    expected = layout.from_seq(reduction_weights(layout.seq(mask), opts))
    _same(w.weight, expected)
    assert torch.equal(w.advantages, per_sequence[layout.sequence_of_token])


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_prompt_mean_reads_each_sequences_divisor(device, packed):
    """``aggregation="prompt_mean"``: each sequence's divisor (prompts x its prompt's tokens, fp32 [S]) read by its
    program, padded and packed (sequences of 3, 0, 5, 1 and 4 tokens; prompts 9, 2, 9, 2 and 5, not sorted)."""
    opts = GRPOOptions(aggregation="prompt_mean", entropy_coef=0.03)
    prompt_ids = torch.tensor([9, 2, 9, 2, 5], device=device)
    if packed:
        cu_seqlens = torch.tensor([0, 3, 3, 8, 9, 13], dtype=torch.int32, device=device)
        layout = SequenceLayout(1, 13, cu_seqlens)
        mask = (torch.arange(13, device=device) % 4 != 1).float()
        sequences, mask_seq = layout.sequences, layout.seq(mask)
    else:
        mask = _mask(5, 7, seed=2).to(device)
        sequences, mask_seq = Sequences(5, 7), mask
    divisors = prompt_divisors(mask_seq, prompt_ids)
    w = token_weights(mask, sequences, kernel_reduction(opts, 5, None, 0.5, None, divisors))
    expected = reduction_weights(mask_seq, opts, prompt_ids=prompt_ids) * 0.5
    _same(w.weight, layout.from_seq(expected) if packed else expected.view(-1))
    _same(w.entropy_weight.view(-1), entropy_bonus_weights(mask, opts).view(-1) * 0.5)


def test_the_dropped_position_is_zeroed_and_nothing_else_written(device):
    B, T, V = 3, 4, 2500  # V over two of the kernel's zeroing blocks
    grad = torch.full((B, T + 1, V), 7.0, device=device, dtype=torch.bfloat16)
    mask = torch.ones(B, T, device=device)
    token_weights(
        mask,
        Sequences(B, T),
        kernel_reduction(GRPOOptions(), B, None, 1.0),
        advantages=torch.zeros(B, device=device),
        dropped_gradient=grad,
    )
    assert grad[:, -1].eq(0).all() and grad[:, :-1].eq(7).all()


def test_no_token_gives_empty_weights_and_zeroes_the_dropped_position(device):
    grad = torch.ones(2, 1, 5, device=device)
    w = token_weights(
        torch.ones(2, 0, device=device),
        Sequences(2, 0),
        kernel_reduction(GRPOOptions(), 2, None, 1.0),
        advantages=torch.ones(2, device=device),
        dropped_gradient=grad,
    )
    assert w.weight.numel() == 0 and w.advantages.numel() == 0 and grad.eq(0).all()


def test_inputs_of_neither_a_token_nor_a_sequence_each_are_refused(device):
    with pytest.raises(ValueError, match="advantages must hold one value a token"):
        token_weights(torch.ones(6, device=device), Sequences(2, 3), None, advantages=torch.ones(4, device=device))


@pytest.mark.parametrize("loss_type", ["grpo", "cispo", "sapo"])
@pytest.mark.parametrize(
    "with_kl,with_entropy,with_bonus",
    [(True, True, True), (False, True, False), (True, False, False), (False, False, False)],
)
def test_loss_metrics_are_the_reduced_loss_and_trls_means(device, loss_type, with_kl, with_entropy, with_bonus):
    B, T = 3, 2100  # over one block of the kernel's tokens
    g = torch.Generator().manual_seed(3)
    mask = _mask(B, T, seed=2, fractional=True).reshape(-1).to(device)
    active = mask != 0
    at_active = lambda t: torch.where(active, t.to(device), 0.0)  # noqa: E731  (the kernels write 0 at masked)
    loss_t, entropy = at_active(torch.randn(B * T, generator=g)), at_active(torch.rand(B * T, generator=g))
    kl = at_active(torch.rand(B * T, generator=g))
    flags = torch.where(active, torch.randint(0, 4, (B * T,), generator=g).to(device), 0).to(torch.int8)
    opts = GRPOOptions(
        loss_type=loss_type,
        beta=0.04 if with_kl else 0.0,
        compute_entropy=with_entropy,
        entropy_coef=0.02 if with_bonus else 0.0,
        **LOSS_TYPES[loss_type],
    )
    weights = token_weights(mask, Sequences(B, T), kernel_reduction(opts, B, None, 0.5))
    loss, metrics = reduce_launch.loss_metrics(
        mask,
        opts.kernel_loss,
        loss=loss_t,
        entropy=entropy if with_entropy else None,
        kl=kl if with_kl else None,
        flags=flags,
        weights=weights,
    )
    expected_loss = (loss_t * weights.weight).sum() + ((entropy * weights.entropy_weight).sum() if with_bonus else 0)
    torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=1e-5)
    low, high = ((flags.int() & bit) != 0 for bit in (FLAG_LOW_CLIPPED, FLAG_HIGH_CLIPPED))
    clip = clip_metric_values(opts, low.float(), high.float())
    expected = {
        "kl": masked_mean(kl, mask),
        "entropy": masked_mean(entropy, mask),
        **{name: masked_mean(v, mask) for name, v in clip.items()},
    }
    names = metric_names(opts, with_kl, with_entropy)
    assert metrics.shape == (len(names),)
    for name, value in zip(names, metrics, strict=True):
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=1e-5, msg=name)


def test_loss_metrics_of_no_token_are_zero(device):
    opts = GRPOOptions(beta=0.04)
    empty = torch.empty(0, device=device)
    weights = token_weights(empty, Sequences(0, 0), kernel_reduction(opts, 0, None, 1.0))
    loss, metrics = reduce_launch.loss_metrics(
        empty, opts.kernel_loss, loss=empty, entropy=empty, kl=empty, flags=empty.to(torch.int8), weights=weights
    )
    assert loss.item() == 0 and metrics.eq(0).all() and metrics.numel() == 5


def test_scalars_are_read_where_the_kernel_can_read_them(device):
    """A loss scale or normalizer tensor on the kernel's device is read there (no host sync); a CPU one beside
    CUDA tensors (torch's arithmetic accepts a CPU 0-d tensor) is read on the host, a normalizer of 0 as 1."""
    on_device = torch.tensor(3.0, device=device)
    assert reduce_launch._scalar(on_device, on_device.device) == (1.0, on_device)
    assert reduce_launch._scalar(torch.tensor(2, dtype=torch.int64), torch.device("meta")) == (2.0, None)
    assert reduce_launch._scalar(0.5, torch.device("cpu")) == (0.5, None)
    B, T = 2, 3
    mask = torch.ones(B, T, device=device)
    opts = GRPOOptions(loss_type="dapo")
    for normalizer, scale in (
        (torch.tensor(0.0), torch.tensor(0.5)),  # CPU tensors (on a GPU: read on the host)
        (torch.tensor(0.0, device=device), torch.tensor(0.5, device=device)),
    ):
        w = token_weights(mask, Sequences(B, T), kernel_reduction(opts, B, normalizer, scale))
        _same(w.weight, 0.5 * mask.reshape(-1))  # divided as 1, as the torch reduction does
