"""The prompt-level aggregation (``aggregation="prompt_mean"`` with the call's ``prompt_ids``), held to SkyRL 0.3.0's
own code (``tests/skyrl_code.py``: ``apply_loss_reduction_to_advantages_minibatch(..., "prompt_mean", ...)`` and its
``ppo_policy_loss``, summed as its workers sum it): the loss and every gradient on both backends, from logits and
from hidden states, padded and packed, with the rows in any order; every loss type against the specification; bf16
within its rounding; a step split over calls by ``loss_scale``; the errors by name."""

import pytest
import torch
from skyrl_code import skyrl_code

from grpo_kernels import (
    FusedLinearGRPOLoss,
    GRPOLoss,
    GRPOOptions,
    fused_linear_grpo_loss,
    grpo_loss,
    grpo_loss_reference,
)
from grpo_kernels.objective import prompt_divisors
from grpo_kernels.options import LOSS_TYPES

BACKENDS = ["torch", "triton"]
FP32 = dict(atol=1e-6, rtol=1e-5)
# SkyRL's step-wise batches: a prompt's sequences are contiguous and their number varies; prompt "c"'s one row and
# a row of "d" have no active token (the prompt's count is at least 1 and still counts among the prompts)
UIDS = ("a", "a", "a", "b", "b", "c", "d", "d", "d", "d")
LENGTHS = (5, 9, 2, 7, 3, 0, 6, 0, 4, 8)
T, V, H = max(LENGTHS), 19, 8


def _batch(seed=0):
    """Logits from hidden states and a head; ids, a ragged mask, per-row advantages, old log-probs near the current
    ones (some tokens clipped at epsilon 0.2 / 0.28, some not), each row's prompt as SkyRL's uids and as integers."""
    g = torch.Generator().manual_seed(seed)
    B = len(UIDS)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    logits = hidden @ weight.T
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    adv = torch.randn(B, generator=g)
    lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    old = (lp + 0.3 * torch.randn(B, T, generator=g)) * mask
    prompt_ids = torch.tensor([ord(u) * 7 for u in UIDS])  # any integers: equal ids, one prompt
    return hidden, weight, logits, ids, mask, adv, old, prompt_ids


def _skyrl_loss(logits, ids, mask, adv, old, policy_loss_type="regular"):
    """SkyRL's loss of a mini-batch with loss_reduction "prompt_mean": its trainer scales the advantages
    (``apply_loss_reduction_to_advantages_minibatch``, the prompts' slices from the uids), its policy loss sums."""
    code = skyrl_code()
    B = len(UIDS)
    scaled = code.apply_loss_reduction_to_advantages_minibatch(
        advantages=adv[:, None].expand(B, T).clone(),
        loss_mask=mask,
        loss_reduction="prompt_mean",
        micro_batch_size=B,
        max_seq_len=T,
        prompt_boundaries=code.compute_prompt_boundaries(list(UIDS)),
    )
    config = _Config(policy_loss_type=policy_loss_type)
    log_probs = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None])[..., 0]
    loss, _ = code.ppo_policy_loss(log_probs, old, scaled, config, loss_mask=mask)
    return loss


class _Config:
    """The fields of SkyRL's ``AlgorithmConfig`` its ``ppo_policy_loss`` reads, at SkyRL's defaults (eps_clip_low
    0.2, eps_clip_high 0.2 there; 0.28 here, so that the two bounds differ) and without off-policy correction (no
    rollout log-probs are passed)."""

    def __init__(self, policy_loss_type):
        self.policy_loss_type = policy_loss_type
        self.eps_clip_low, self.eps_clip_high, self.clip_ratio_c = 0.2, 0.28, 3.0
        self.off_policy_correction = None


def _options(policy_loss_type="regular", **extra):
    """Ours for SkyRL's PPO loss: its clip bounds, its +-20 clamp of the log-ratio before the exp, dual-clip c."""
    dual = dict(dual_clip=3.0) if policy_loss_type == "dual_clip" else {}
    return GRPOOptions(
        loss_type="grpo",
        epsilon=0.2,
        epsilon_high=0.28,
        log_ratio_clamp=20.0,
        aggregation="prompt_mean",
        **dual,
        **extra,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy_loss_type", ["regular", "dual_clip"])
def test_equals_skyrl_from_logits_and_hidden_states_in_any_row_order(policy_loss_type, backend):
    """SkyRL's loss and its gradient (through the same log-softmax) on its contiguous mini-batch; ours on the rows
    shuffled (the prompts interleaved: ids, not slices, group them), from logits and from hidden states."""
    hidden, weight, logits, ids, mask, adv, old, prompt_ids = _batch(seed=1)
    theirs = logits.clone().requires_grad_()
    expected = _skyrl_loss(theirs, ids, mask, adv, old, policy_loss_type)
    expected.backward()
    order = torch.randperm(len(UIDS), generator=torch.Generator().manual_seed(3))
    ours = logits[order].clone().requires_grad_()
    options = _options(policy_loss_type)
    batch = (ids[order], mask[order], adv[order], old[order])
    actual = grpo_loss(ours, *batch, prompt_ids=prompt_ids[order], options=options, backend=backend)
    actual.loss.backward()
    torch.testing.assert_close(actual.loss, expected, **FP32)
    torch.testing.assert_close(ours.grad, theirs.grad[order], **FP32)
    h, w = hidden[order].clone().requires_grad_(), weight.clone().requires_grad_()
    fused = FusedLinearGRPOLoss(options=options, backend=backend)(h, w, *batch, prompt_ids=prompt_ids[order])
    fused.loss.backward()
    torch.testing.assert_close(fused.loss, expected, **FP32)
    torch.testing.assert_close(h.grad, theirs.grad[order] @ weight, **FP32)
    torch.testing.assert_close(w.grad, torch.einsum("btv,bth->vh", theirs.grad, hidden), **FP32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_over_two_calls_is_skyrls_mini_batch_by_loss_scale(backend):
    """A mini-batch split over two calls (gradient accumulation, or two processes whose gradients are summed): each
    call's prompt mean times its prompts / the step's, summed, is SkyRL's loss of the whole mini-batch."""
    _, _, logits, ids, mask, adv, old, prompt_ids = _batch(seed=2)
    theirs = logits.clone().requires_grad_()
    expected = _skyrl_loss(theirs, ids, mask, adv, old)
    expected.backward()
    ours = logits.clone().requires_grad_()
    total = torch.zeros(())
    for rows, prompts in ((slice(0, 5), 2), (slice(5, 10), 2)):  # a, b | c, d: whole prompts in each call
        out = GRPOLoss(options=_options(), backend=backend)(
            ours[rows], ids[rows], mask[rows], adv[rows], old[rows], prompt_ids=prompt_ids[rows], loss_scale=prompts / 4
        )
        out.loss.backward()
        total = total + out.loss.detach()
    torch.testing.assert_close(total, expected.detach(), **FP32)
    torch.testing.assert_close(ours.grad, theirs.grad, **FP32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_packed_batch_is_the_padded_one(backend):
    """Packed (cu_seqlens, prompt_ids one a sequence): the padded call's loss, gradient and metrics."""
    _, _, logits, ids, mask, adv, old, prompt_ids = _batch(seed=4)
    options = _options(beta=0.04, entropy_coef=0.01)
    ref_logps = (old - 0.1) * mask
    padded_logits = logits.clone().requires_grad_()
    padded = grpo_loss(padded_logits, ids, mask, adv, old, ref_logps, prompt_ids=prompt_ids, options=options)
    padded.loss.backward()
    keep = mask.bool()
    lengths = mask.sum(-1).long()
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()
    packed_logits = logits[keep].clone().requires_grad_()
    packed = grpo_loss(
        packed_logits,
        ids[keep],
        torch.ones(int(lengths.sum())),
        adv,
        old[keep],
        ref_logps[keep],
        prompt_ids=prompt_ids,
        options=options,
        backend=backend,
        cu_seqlens=cu,
    )
    packed.loss.backward()
    torch.testing.assert_close(packed.loss, padded.loss, **FP32)
    torch.testing.assert_close(packed_logits.grad, padded_logits.grad[keep], **FP32)
    for key, value in padded.metrics.items():
        torch.testing.assert_close(packed.metrics[key], value, **FP32, msg=key)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_is_the_specification(loss_type):
    """Each loss type's per-token terms, KL and entropy bonus under the prompt mean: the specification's loss,
    gradient and metrics, on the torch path and on the kernels where the loss type runs there (the kernels read the
    prompt mean's per-sequence divisors; the others reduce in torch)."""
    _, _, logits, ids, mask, adv, old, prompt_ids = _batch(seed=5)
    extra = dict(max_completion_length=T) if loss_type == "dr_grpo" else {}
    extra |= dict(dro_beta=0.1) if loss_type == "dro" else {}
    options = GRPOOptions(loss_type=loss_type, beta=0.04, entropy_coef=0.01, aggregation="prompt_mean", **extra)
    ref_logps = (old - 0.1) * mask
    torch.manual_seed(0)  # Clip-Cov draws its tokens from torch's generator: the same draw on each side
    full = logits.clone().requires_grad_()
    expected = grpo_loss_reference(full, ids, mask, adv, old, ref_logps, options=options, prompt_ids=prompt_ids)
    expected.loss.backward()
    for backend in ("torch", "triton") if options.loss_in_kernel else ("torch",):
        torch.manual_seed(0)
        ours = logits.clone().requires_grad_()
        actual = grpo_loss(
            ours, ids, mask, adv, old, ref_logps, options=options, prompt_ids=prompt_ids, backend=backend
        )
        actual.loss.backward()
        torch.testing.assert_close(actual.loss, expected.loss, **FP32, msg=backend)
        torch.testing.assert_close(ours.grad, full.grad, **FP32, msg=backend)
        for key, value in expected.metrics.items():
            torch.testing.assert_close(actual.metrics[key], value, **FP32, msg=f"{backend} {key}")


def test_the_aggregation_changes_the_loss_types_reduction():
    """Not a relabelling: on a batch whose prompts differ in tokens, the prompt mean is neither grpo's row mean nor
    dapo's token mean, and each token weighs 1 / (prompts x its prompt's tokens)."""
    _, _, logits, ids, mask, adv, old, prompt_ids = _batch(seed=6)
    losses = {
        name: float(grpo_loss(logits, ids, mask, adv, old, prompt_ids=prompt_ids if name else None, **kw).loss)
        for name, kw in (
            ("prompt_mean", dict(aggregation="prompt_mean")),
            ("", dict(loss_type="grpo")),
        )
    }
    assert losses["prompt_mean"] != pytest.approx(losses[""], rel=1e-3)
    tokens = {uid: sum(n for u, n in zip(UIDS, LENGTHS, strict=True) if u == uid) for uid in UIDS}
    expected = torch.tensor([4.0 * max(tokens[u], 1) for u in UIDS])
    torch.testing.assert_close(prompt_divisors(mask, prompt_ids), expected, atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_logits_are_the_specification_within_their_rounding(backend):
    """bf16 logits: the loss as the fp32 specification on the same values, the bf16 gradient within two ulps."""
    _, _, logits, ids, mask, adv, old, prompt_ids = _batch(seed=7)
    half = logits.bfloat16().requires_grad_()
    full = half.detach().float().requires_grad_()
    options = _options(beta=0.04)
    ref_logps = (old - 0.1) * mask
    expected = grpo_loss_reference(full, ids, mask, adv, old, ref_logps, options=options, prompt_ids=prompt_ids)
    actual = grpo_loss(half, ids, mask, adv, old, ref_logps, options=options, prompt_ids=prompt_ids, backend=backend)
    expected.loss.backward()
    actual.loss.backward()
    assert half.grad.dtype == torch.bfloat16
    torch.testing.assert_close(actual.loss, expected.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(half.grad.float(), full.grad, atol=1e-4, rtol=2 * 2**-8)


def test_the_errors_name_the_argument():
    _, weight, logits, ids, mask, adv, old, prompt_ids = _batch()
    options = _options()
    with pytest.raises(ValueError, match=r"aggregation='prompt_mean' needs prompt_ids: an integer tensor \[10\]"):
        grpo_loss(logits, ids, mask, adv, old, options=options)
    with pytest.raises(ValueError, match="aggregation='loss_type' does not read them"):
        grpo_loss(logits, ids, mask, adv, old, prompt_ids=prompt_ids)
    with pytest.raises(ValueError, match=r"prompt_ids must be \[10\], one id for each of the 10 rows"):
        grpo_loss(logits, ids, mask, adv, old, options=options, prompt_ids=prompt_ids[:4])
    with pytest.raises(TypeError, match="prompt_ids must hold integers"):
        grpo_loss(logits, ids, mask, adv, old, options=options, prompt_ids=prompt_ids.float())
    with pytest.raises(TypeError, match="prompt_ids must be an integer torch.Tensor"):
        grpo_loss(logits, ids, mask, adv, old, options=options, prompt_ids=list(range(10)))
    with pytest.raises(ValueError, match=r"one id for each of the 3 sequences \(cu_seqlens' S\)"):
        grpo_loss(
            logits[0, :6], ids[0, :6], mask[0, :6], adv[:3], options=options, prompt_ids=prompt_ids,
            cu_seqlens=torch.tensor([0, 2, 4, 6]),
        )  # fmt: skip
    with pytest.raises(ValueError, match="aggregation='prompt_mean' divides by the call's prompts"):
        grpo_loss(
            logits,
            ids,
            mask,
            adv,
            old,
            normalizer=100.0,
            prompt_ids=prompt_ids,
            loss_type="dapo",
            aggregation="prompt_mean",
        )
    with pytest.raises(ValueError, match=r"aggregation must be one of \['loss_type', 'prompt_mean'\], got 'seq_mean'"):
        GRPOOptions(aggregation="seq_mean")
    with pytest.raises(ValueError, match="entropy_reduction='loss' divides the entropy bonus by the loss type's"):
        GRPOOptions(loss_type="dapo", entropy_reduction="loss", aggregation="prompt_mean")
    with pytest.raises(ValueError, match="preset='verl' reduces the loss as verl's loss types do"):
        GRPOLoss(preset="verl", aggregation="prompt_mean")
    with pytest.raises(TypeError, match="did you mean 'aggregation'"):
        GRPOOptions(loss_reduction="prompt_mean")
    with pytest.raises(ValueError, match="needs prompt_ids"):
        fused_linear_grpo_loss(logits[..., :H], weight, ids, mask, adv, old, options=options)
