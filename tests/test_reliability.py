"""Padding garbage, extreme values and views: never a silent NaN, a leaked gradient or a corrupted tensor.

The randomized cases compare every path against ``oracle_loss``, an fp64 GRPO loss written
here from TRL's definitions (independent of ``grpo_kernels.reference``). The oracle gets the
clean inputs; the paths under test get the same inputs with garbage at every masked position
(NaN, +-inf, -100 ids, huge log-probs), which must change nothing.
"""

import math

import pytest
import torch
from helpers import KERNEL_LOSS_TYPES, assert_close

from grpo_kernels import (
    GRPOLoss,
    fused_linear_grpo_loss,
    grpo_loss,
    grpo_loss_reference,
    selective_log_softmax_and_entropy,
    token_entropy,
    token_logprobs,
)

# The garbage is meant: numpy's warnings about NaN and inf arithmetic in Triton's interpreter are expected.
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")

# Triton runs on the GPU where there is one (else in its interpreter, on CPU tensors); the torch path on CPU.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

PATHS = ["torch", "triton_one_pass", "triton_two_pass"]
EPS, EPS_HIGH, SAPO_POS, SAPO_NEG, MAX_LEN = 0.2, 0.28, 1.0, 1.05, 8
# fp32 against fp64: the lm_head gradients are sums of O(V + H) fp32 products of O(1) values,
# so their absolute error is a few 1e-6 (measured up to 2e-6 over 40 random draws).
LINEAR_ATOL = 1e-5


def oracle_loss(logits, ids, mask, adv, old, ref, iw, *, loss_type, level, beta, temperature, normalizer=None):
    """TRL 1.16's GRPO loss in fp64, from its definitions: per-token terms, then TRL's reduction."""
    B, T, _ = logits.shape
    m = mask.double()
    lp = torch.log_softmax(logits.double() / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    old = lp.detach() if old is None else old.double()
    A = adv.double() if adv.dim() == 2 else adv.double()[:, None]
    if level == "sequence":
        log_w = ((lp - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    else:
        log_w = lp - old
    ratio = torch.exp(log_w)
    if loss_type == "cispo":
        capped = ratio.clamp(max=EPS_HIGH).detach()
        policy = torch.where(capped == 0, 0.0, -capped * A * lp)
    elif loss_type == "sapo":
        tau = torch.where(A > 0, SAPO_POS, SAPO_NEG)
        policy = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * A
    else:
        policy = -torch.minimum(ratio * A, ratio.clamp(1 - EPS, 1 + EPS_HIGH) * A)
    if iw is not None:
        policy = policy * (iw.double() if iw.dim() == 2 else iw.double()[:, None])
    per_token = policy.expand(B, T)
    if beta:
        x = ref.double() - lp
        per_token = per_token + beta * (torch.exp(x) - x - 1)
    total = per_token * m
    if loss_type in ("grpo", "sapo"):
        return (total.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return total.sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return total.sum() / (B * MAX_LEN)
    if loss_type in ("dapo", "cispo"):
        return total.sum() / (m.sum().clamp(min=1.0) if normalizer is None else normalizer)
    return total.sum(-1).mean()  # luspo


def _options(case):
    return dict(
        loss_type=case["loss_type"],
        importance_sampling_level=case["level"],
        beta=case["beta"],
        temperature=case["temperature"],
        epsilon=EPS,
        epsilon_high=EPS_HIGH,
        max_completion_length=MAX_LEN if case["loss_type"] == "dr_grpo" else None,
    )


def _random_case(seed):
    """Clean inputs and a copy with garbage at every masked position."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    B, T, V = pick([1, 2, 3, 4]), pick([1, 3, 6]), pick([7, 33, 130])
    case = dict(
        loss_type=pick(KERNEL_LOSS_TYPES),
        level=pick(["token", "token", "sequence"]),
        beta=pick([0.0, 0.04]),
        temperature=pick([1.0, 0.7]),
        B=B,
        T=T,
        V=V,
    )
    logits = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.7).float()
    if pick([False, True]):
        mask = mask * pick([0.5, 1.0, 2.0])  # fractional weights count as in TRL
    if B > 1 and pick([False, True]):
        mask[pick(list(range(B)))] = 0  # a fully masked row
    lp = torch.log_softmax(logits / case["temperature"], -1).gather(-1, ids[..., None])[..., 0]
    clean = dict(
        logits=logits,
        ids=ids,
        mask=mask,
        adv=torch.randn((B, T) if pick([False, True]) else (B,), generator=g),
        old=pick([None, lp + 0.4 * torch.randn(B, T, generator=g)]),
        ref=lp + 0.3 * torch.randn(B, T, generator=g),
        iw=pick([None, torch.rand(B, generator=g) + 0.5, torch.rand(B, T, generator=g) + 0.5]),
    )
    case["normalizer"] = pick([None, 5.0]) if case["loss_type"] in ("dapo", "cispo") else None
    masked = mask == 0
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), -100.0, 1e30])
    noise = lambda shape: garbage[torch.randint(len(garbage), shape, generator=g)]  # noqa: E731
    dirty = dict(clean)
    dirty["logits"] = torch.where(masked[..., None], noise((B, T, V)), logits)
    dirty["ids"] = torch.where(masked, torch.tensor([-100, V + 3])[torch.randint(2, (B, T), generator=g)], ids)
    for key in ("old", "ref", "adv", "iw"):
        t = clean[key]
        if t is None:
            continue
        if t.dim() == 2:
            dirty[key] = torch.where(masked, noise((B, T)), t)
        else:  # a per-row value of a row with no active token is padding too
            dirty[key] = torch.where(masked.all(-1), noise((B,)), t)
    return case, clean, dirty


def _device(backend):
    return TRITON_DEVICE if backend == "triton" else "cpu"


def _to(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


def _run(path, d, case, check_ids):
    """(the logits leaf, the output) of one path on the inputs ``d``; the leaf holds the gradient."""
    backend = "torch" if path.startswith("torch") else "triton"
    in_place = path.endswith("in_place")
    leaf = d["logits"].to(_device(backend), copy=True).requires_grad_()
    # in place, the gradient overwrites a model output's storage; here, a product with the leaf
    logits = leaf * 1.0 if in_place else leaf
    ids, mask, adv, old, ref, iw = _to(
        _device(backend), d["ids"], d["mask"], d["adv"], d["old"], d["ref"] if case["beta"] else None, d["iw"]
    )
    out = grpo_loss(
        logits,
        ids,
        mask,
        adv,
        old,
        ref,
        iw,
        case["normalizer"],
        backend=backend,
        one_pass=path == "triton_one_pass",
        check_ids=check_ids,
        in_place_backward=in_place,
        **_options(case),
    )
    return leaf, out


SEEDS = list(range(36))


@pytest.mark.parametrize("seed", SEEDS)
def test_randomized_against_an_fp64_oracle_with_padding_garbage(seed):
    case, clean, dirty = _random_case(seed)
    logits64 = clean["logits"].double().requires_grad_()
    expected = oracle_loss(
        logits64,
        clean["ids"],
        clean["mask"],
        clean["adv"],
        clean["old"],
        clean["ref"],
        clean["iw"],
        loss_type=case["loss_type"],
        level=case["level"],
        beta=case["beta"],
        temperature=case["temperature"],
        normalizer=case["normalizer"],
    )
    (expected_grad,) = torch.autograd.grad(expected, logits64)
    active = clean["mask"] != 0
    expected_lp = torch.log_softmax(clean["logits"].double() / case["temperature"], -1).gather(
        -1, clean["ids"][..., None]
    )[..., 0]
    for path in PATHS + ["torch_in_place", "triton_in_place"]:
        if path == "triton_one_pass" and case["level"] == "sequence":
            continue  # the sequence level has one Triton path; it runs as triton_two_pass
        logits, out = _run(path, dirty, case, check_ids=seed % 2 == 0)
        out.loss.backward()
        where = f"{path} {case}"
        assert_close(f"loss {where}", expected, out.loss, atol=1e-6, rtol=1e-5)
        assert_close(f"dlogits {where}", expected_grad, logits.grad, atol=1e-7, rtol=1e-4)
        assert_close(f"logps {where}", torch.where(active, expected_lp, 0.0), out.per_token_logps, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", SEEDS[:12])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_lm_head_randomized_against_an_fp64_oracle_with_padding_garbage(seed, backend):
    case, clean, dirty = _random_case(seed)
    B, T, V = case["B"], case["T"], case["V"]
    g = torch.Generator().manual_seed(1000 + seed)
    H = 12
    hidden = torch.randn(B, T, H, generator=g)
    weight, bias = torch.randn(V, H, generator=g) * 0.5, torch.randn(V, generator=g)
    masked = clean["mask"] == 0
    dirty_hidden = torch.where(masked[..., None], torch.tensor(float("nan")), hidden)
    h64, w64, b64 = (t.double().requires_grad_() for t in (hidden, weight, bias))
    expected = oracle_loss(
        h64 @ w64.T + b64,
        clean["ids"],
        clean["mask"],
        clean["adv"],
        clean["old"],
        clean["ref"],
        clean["iw"],
        loss_type=case["loss_type"],
        level=case["level"],
        beta=case["beta"],
        temperature=case["temperature"],
        normalizer=case["normalizer"],
    )
    expected_grads = torch.autograd.grad(expected, (h64, w64, b64))
    h, w, b = (t.to(_device(backend), copy=True).requires_grad_() for t in (dirty_hidden, weight, bias))
    out = fused_linear_grpo_loss(
        h,
        w,
        *_to(
            _device(backend),
            dirty["ids"],
            dirty["mask"],
            dirty["adv"],
            dirty["old"],
            dirty["ref"] if case["beta"] else None,
            dirty["iw"],
        ),
        case["normalizer"],
        bias=b,
        backend=backend,
        **_options(case),
    )
    out.loss.backward()
    assert_close(f"loss {case}", expected, out.loss, atol=1e-6, rtol=1e-5)
    for name, e, a in zip(("d hidden", "d weight", "d bias"), expected_grads, (h.grad, w.grad, b.grad), strict=True):
        assert_close(f"{name} {backend} {case}", e, a, atol=LINEAR_ATOL, rtol=1e-4)


def _small_batch(seed=0, B=3, T=4, V=33):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[0, -1] = 0
    lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    return dict(
        logits=logits,
        ids=ids,
        mask=mask,
        adv=torch.randn(B, generator=g),
        old=lp + 0.3 * torch.randn(B, T, generator=g),
        ref=lp + 0.2 * torch.randn(B, T, generator=g),
        iw=torch.rand(B, T, generator=g) + 0.5,
    )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_no_gradient_reaches_the_per_token_inputs(path, level):
    backend = "torch" if path == "torch" else "triton"
    d = {k: v.to(_device(backend)) for k, v in _small_batch().items()}
    inputs = {k: d[k].clone().requires_grad_() for k in ("adv", "old", "ref", "iw")}
    normalizer = torch.tensor(7.0, requires_grad=True, device=_device(backend))
    logits = d["logits"].clone().requires_grad_()
    out = grpo_loss(
        logits,
        d["ids"],
        d["mask"],
        inputs["adv"],
        inputs["old"],
        inputs["ref"],
        inputs["iw"],
        normalizer,
        loss_type="dapo",
        beta=0.04,
        importance_sampling_level=level,
        backend=backend,
        one_pass=path == "triton_one_pass",
    )
    out.loss.backward()
    assert logits.grad is not None
    for name, t in list(inputs.items()) + [("normalizer", normalizer)]:
        assert t.grad is None, f"{name} got a gradient on {path}"


def test_fused_lm_head_gives_no_gradient_to_the_per_token_inputs():
    d = _small_batch()
    adv, old = d["adv"].clone().requires_grad_(), d["old"].clone().requires_grad_()
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 4, 8, generator=g).requires_grad_()
    weight = torch.randn(33, 8, generator=g).requires_grad_()
    fused_linear_grpo_loss(hidden, weight, d["ids"], d["mask"], adv, old, backend="torch").loss.backward()
    assert adv.grad is None and old.grad is None and hidden.grad is not None


def test_in_place_backward_refuses_a_view_of_a_leaf():
    d = _small_batch(T=5)
    leaf = torch.randn(3, 6, 33, requires_grad=True)
    with pytest.raises(
        ValueError,
        match=r"in_place_backward=True would overwrite logits, a view of a leaf tensor "
        r"\(shape \(3, 6, 33\)\) that requires grad",
    ):
        GRPOLoss(in_place_backward=True)(leaf[:, :-1], d["ids"], d["mask"], d["adv"])
    with pytest.raises(ValueError, match="a view of a leaf tensor"):
        GRPOLoss(in_place_backward=True)(leaf[:, :-1][:, 1:], d["ids"][:, 1:], d["mask"][:, 1:], d["adv"])
    assert leaf.grad is None


def test_in_place_backward_on_a_view_of_a_model_output_is_allowed():
    d = _small_batch(T=5)
    head = torch.nn.Linear(8, 33)
    logits = head(torch.randn(3, 6, 8))  # the README's slicing pattern on a model output
    out = GRPOLoss(in_place_backward=True)(logits[:, :-1], d["ids"], d["mask"], d["adv"])
    out.loss.backward()
    assert head.weight.grad is not None and torch.isfinite(head.weight.grad).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("loss_type", KERNEL_LOSS_TYPES)
def test_a_minus_inf_target_logit_gives_a_finite_loss_and_gradient(path, loss_type):
    """A vocabulary entry masked to -inf at a sampled token: logp is -inf, the ratio 0, the term its limit."""
    d = _small_batch(seed=5)
    d["logits"][1, 2, d["ids"][1, 2]] = -float("inf")
    d["logits"][2, :, 0] = -float("inf")  # a masked-out vocabulary column elsewhere
    case = dict(loss_type=loss_type, level="token", beta=0.0, temperature=1.0, normalizer=None)
    logits64 = d["logits"].double().requires_grad_()
    expected = oracle_loss(
        logits64,
        d["ids"],
        d["mask"],
        d["adv"],
        d["old"],
        None,
        d["iw"],
        loss_type=loss_type,
        level="token",
        beta=0.0,
        temperature=1.0,
    )
    (expected_grad,) = torch.autograd.grad(expected, logits64)
    assert torch.isfinite(expected) and torch.isfinite(expected_grad).all()
    logits, out = _run(path, d, case, check_ids=True)
    out.loss.backward()
    assert out.per_token_logps[1, 2] == -float("inf")
    assert_close(f"loss {path}", expected, out.loss, atol=1e-6, rtol=1e-5)
    assert_close(f"dlogits {path}", expected_grad, logits.grad, atol=1e-7, rtol=1e-4)
    assert (logits.grad[1, 2] == 0).all(), "the -inf target's row: the ratio is 0, so is its gradient"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("loss_type", ["grpo", "cispo", "sapo"])
def test_a_minus_inf_bias_entry_at_a_target_keeps_d_weight_finite(backend, loss_type):
    d = _small_batch(seed=6)
    g = torch.Generator().manual_seed(6)
    hidden, weight, bias = (torch.randn(*shape, generator=g) for shape in ((3, 4, 8), (33, 8), (33,)))
    bias[d["ids"][1, 1]] = -float("inf")
    h64, w64, b64 = (t.double().requires_grad_() for t in (hidden, weight, bias))
    expected = oracle_loss(
        h64 @ w64.T + b64,
        d["ids"],
        d["mask"],
        d["adv"],
        d["old"],
        None,
        None,
        loss_type=loss_type,
        level="token",
        beta=0.0,
        temperature=1.0,
    )
    expected_grads = torch.autograd.grad(expected, (h64, w64))
    device = _device(backend)
    h, w = (t.to(device, copy=True).requires_grad_() for t in (hidden, weight))
    out = fused_linear_grpo_loss(
        h,
        w,
        *_to(device, d["ids"], d["mask"], d["adv"], d["old"]),
        bias=bias.to(device),
        loss_type=loss_type,
        epsilon=EPS,
        epsilon_high=EPS_HIGH,
        backend=backend,
    )
    out.loss.backward()
    assert_close("loss", expected, out.loss, atol=1e-6, rtol=1e-5)
    assert_close("d hidden", expected_grads[0], h.grad, atol=LINEAR_ATOL, rtol=1e-4)
    assert_close("d weight", expected_grads[1], w.grad, atol=LINEAR_ATOL, rtol=1e-4)


@pytest.mark.parametrize("path", PATHS)
def test_an_infinite_kl_gives_a_non_finite_loss_and_log_ratio_clamp_keeps_it_finite(path):
    """With beta > 0 a -inf target log-prob makes k3's KL infinite (exp(x) - x at x = +inf is NaN in floats):
    the loss is not finite, so a trainer sees it; verl's log_ratio_clamp keeps loss and gradient finite."""
    backend = "torch" if path == "torch" else "triton"
    d = {k: v.to(_device(backend)) for k, v in _small_batch(seed=7).items()}
    d["logits"][1, 2, d["ids"][1, 2]] = -float("inf")

    def run(logits, **kw):
        one_pass = path == "triton_one_pass"
        return grpo_loss(
            logits,
            d["ids"],
            d["mask"],
            d["adv"],
            d["old"],
            d["ref"],
            beta=0.04,
            backend=backend,
            one_pass=one_pass,
            **kw,
        )

    assert not torch.isfinite(run(d["logits"].clone().requires_grad_()).loss)
    logits = d["logits"].clone().requires_grad_()
    out = run(logits, log_ratio_clamp=20.0)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("poison", ["nan_advantage", "nan_logit", "inf_logit"])
def test_a_non_finite_active_input_stays_in_its_row(path, poison):
    """NaN in, NaN out: the loss is NaN (loud) and only the row that carries it has a non-finite gradient.

    A +inf logit counts as NaN: the row's softmax is undefined (inf - inf), on every backend."""
    d = _small_batch(seed=8)
    d["adv"] = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))  # per token, so one token is poisoned
    clean_logits = d["logits"].clone()
    if poison == "nan_advantage":
        d["adv"][1, 1] = float("nan")
    else:
        d["logits"][1, 1, 3] = float("nan") if poison == "nan_logit" else float("inf")
    logits, out = _run(
        path, d, dict(loss_type="grpo", level="token", beta=0.0, temperature=1.0, normalizer=None), check_ids=True
    )
    out.loss.backward()
    assert math.isnan(out.loss.item())
    logits64 = clean_logits.double().requires_grad_()
    adv = torch.where(torch.isnan(d["adv"]), 0.0, d["adv"])
    (expected_grad,) = torch.autograd.grad(
        oracle_loss(
            logits64,
            d["ids"],
            d["mask"],
            adv,
            d["old"],
            None,
            d["iw"],
            loss_type="grpo",
            level="token",
            beta=0.0,
            temperature=1.0,
        ),
        logits64,
    )
    other_rows = torch.ones(3, 4, dtype=torch.bool)
    other_rows[1, 1] = False
    assert_close(f"other rows {path}", expected_grad[other_rows], logits.grad[other_rows], atol=1e-7, rtol=1e-4)


# ----- the last bad inputs: an empty batch's normalizer of 0, a vocabulary of one token -----------------


def _lm_head_paths():
    return [("torch", "recompute"), ("triton", "recompute"), ("triton", "three_products")]


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
@pytest.mark.parametrize("zero", ["python", "tensor"])
def test_a_normalizer_of_zero_with_no_active_token_gives_a_zero_loss_and_gradient(loss_type, zero):
    """A micro-batch whose completions are all empty: TRL's count clamps to 1 and gives 0; so does a count
    of 0, on every path (logits, packed, the fused lm_head), where 0 / 0 would have given NaN."""
    d = _small_batch(seed=8)
    d["mask"].zero_()
    expected = grpo_loss_reference(
        d["logits"], d["ids"], d["mask"], d["adv"], d["old"], normalizer=0.0, loss_type=loss_type
    )
    assert expected.loss == 0
    for path in PATHS:
        backend = "torch" if path == "torch" else "triton"
        dev = _device(backend)
        normalizer = 0 if zero == "python" else torch.tensor(0.0, device=dev)
        logits = d["logits"].to(dev, copy=True).requires_grad_()
        ids, mask, adv, old = _to(dev, d["ids"], d["mask"], d["adv"], d["old"])
        out = grpo_loss(
            logits,
            ids,
            mask,
            adv,
            old,
            normalizer=normalizer,
            loss_type=loss_type,
            backend=backend,
            one_pass=path == "triton_one_pass",
        )
        out.loss.backward()
        assert out.loss.item() == 0 and torch.equal(logits.grad, torch.zeros_like(logits)), path
        # the same batch packed: three empty sequences of 4 tokens
        packed = d["logits"].reshape(-1, d["logits"].shape[-1]).to(dev, copy=True).requires_grad_()
        cu = torch.tensor([0, 4, 8, 12], device=dev)
        out = grpo_loss(
            packed,
            ids.reshape(-1),
            mask.reshape(-1),
            adv,
            old.reshape(-1),
            normalizer=normalizer,
            loss_type=loss_type,
            backend=backend,
            cu_seqlens=cu,
            one_pass=path == "triton_one_pass",
        )
        out.loss.backward()
        assert out.loss.item() == 0 and torch.equal(packed.grad, torch.zeros_like(packed)), f"packed {path}"
    g = torch.Generator().manual_seed(9)
    hidden, weight = torch.randn(3, 4, 8, generator=g), torch.randn(33, 8, generator=g)
    for backend, mode in _lm_head_paths():
        dev = _device(backend)
        normalizer = 0 if zero == "python" else torch.tensor(0.0, device=dev)
        h, w = (t.to(dev, copy=True).requires_grad_() for t in (hidden, weight))
        out = fused_linear_grpo_loss(
            h,
            w,
            *_to(dev, d["ids"], d["mask"], d["adv"], d["old"]),
            normalizer=normalizer,
            loss_type=loss_type,
            backend=backend,
            lm_head_mode=mode,
        )
        out.loss.backward()
        assert out.loss.item() == 0 and not h.grad.any() and not w.grad.any(), f"lm_head {backend} {mode}"


@pytest.mark.parametrize("zero", [0, 0.0, torch.tensor(0)])
def test_a_normalizer_of_zero_with_active_tokens_is_still_refused(zero):
    d = _small_batch(seed=8)
    with pytest.raises(ValueError, match="0 is accepted only for a batch with no active token, this one has 11"):
        grpo_loss(d["logits"], d["ids"], d["mask"], d["adv"], normalizer=zero, loss_type="dapo")


ONE_TOKEN_CASES = {
    "kl": dict(beta=0.1),
    "entropy_bonus": dict(loss_type="dapo", entropy_coef=0.05),
    "cispo_sequence": dict(importance_sampling_level="sequence", loss_type="cispo"),
}


# the sequence level has one Triton path (two-pass): no one-pass case for it
@pytest.mark.parametrize(
    "path, options",
    [
        pytest.param(path, options, id=f"{path}-{name}")
        for name, options in ONE_TOKEN_CASES.items()
        for path in PATHS
        if not (path == "triton_one_pass" and options.get("importance_sampling_level") == "sequence")
    ],
)
def test_a_vocabulary_of_one_token_works_on_every_path(path, options):
    """V = 1: every log-prob is 0 and the entropy 0; the loss is the reference's and the gradient 0."""
    backend = "torch" if path == "torch" else "triton"
    dev = _device(backend)
    d = _small_batch(seed=10, V=1)
    d["old"], d["ref"] = 0.3 * torch.randn(3, 4), 0.2 * torch.randn(3, 4)
    expected = grpo_loss_reference(
        d["logits"].double(), d["ids"], d["mask"], d["adv"].double(), d["old"].double(), d["ref"].double(), **options
    )
    logits = d["logits"].to(dev, copy=True).requires_grad_()
    ids, mask, adv, old, ref = _to(dev, d["ids"], d["mask"], d["adv"], d["old"], d["ref"])
    out = grpo_loss(
        logits,
        ids,
        mask,
        adv,
        old,
        ref if options.get("beta") else None,
        backend=backend,
        one_pass=path == "triton_one_pass",
        **options,
    )
    out.loss.backward()
    assert_close(f"loss {path}", expected.loss, out.loss, atol=1e-6, rtol=1e-6)
    # 0 up to fp32 rounding: the kernels take the log-sum-exp in base 2
    assert_close(f"logps {path}", torch.zeros(3, 4), out.per_token_logps, atol=2e-7, rtol=0)
    assert_close(f"dlogits {path}", torch.zeros(3, 4, 1), logits.grad, atol=1e-7, rtol=0)
    for name, value in expected.metrics.items():
        assert_close(f"{name} {path}", value, out.metrics[name], atol=1e-6, rtol=1e-6)
    x = d["logits"].to(dev, copy=True).requires_grad_()
    lp, entropy = selective_log_softmax_and_entropy(x, ids, backend=backend)
    (lp.sum() + entropy.sum()).backward()
    for name, value in [
        ("log-probs", lp),
        ("entropy", entropy),
        ("their gradient", x.grad),
        ("token_logprobs", token_logprobs(x.detach(), ids, backend=backend)),
        ("token_entropy", token_entropy(x.detach(), backend=backend)),
    ]:
        assert_close(f"{name} {path}", torch.zeros_like(value), value, atol=2e-7, rtol=0)


@pytest.mark.parametrize("backend, mode", _lm_head_paths())
def test_a_vocabulary_of_one_token_works_from_hidden_states(backend, mode):
    d = _small_batch(seed=11, V=1)
    g = torch.Generator().manual_seed(11)
    hidden, weight = torch.randn(3, 4, 8, generator=g), torch.randn(1, 8, generator=g)
    d["old"] = 0.3 * torch.randn(3, 4, generator=g)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    expected = grpo_loss_reference(h64 @ w64.T, d["ids"], d["mask"], d["adv"].double(), d["old"].double())
    expected.loss.backward()
    dev = _device(backend)
    h, w = (t.to(dev, copy=True).requires_grad_() for t in (hidden, weight))
    out = fused_linear_grpo_loss(
        h, w, *_to(dev, d["ids"], d["mask"], d["adv"], d["old"]), backend=backend, lm_head_mode=mode
    )
    out.loss.backward()
    assert_close(f"loss {backend} {mode}", expected.loss, out.loss, atol=1e-6, rtol=1e-6)
    assert_close("d hidden", h64.grad, h.grad, atol=1e-7, rtol=0)
    assert_close("d weight", w64.grad, w.grad, atol=1e-7, rtol=0)
