"""Every fast path against the reference: loss, d loss / d logits, per-token log-probs, metrics.

"triton" runs the kernels in Triton's interpreter on a CPU machine (conftest sets
TRITON_INTERPRET=1) and compiled on a GPU machine; "torch" is the chunked torch path.
Tolerances: fp32 at 1e-5 relative (the same fp32 math in another order); bf16 / fp16
gradients at the rounding of the gradient's own dtype (values are computed in fp32 from
the same 16-bit logits, so only the final cast differs).
"""

import contextlib
import os
import zlib

import pytest
import torch
import triton
import triton.language as tl
from eager_baseline import grpo_loss_eager
from helpers import (
    BATCH_KEYS,
    KERNEL_LOSS_TYPES,
    LOSS_TYPE_REGISTRY,
    LOSS_TYPES,
    OPTION_CASES,
    assert_close,
    make_batch,
    split_row,
)

from grpo_kernels import GRPOLoss, GRPOOptions, grpo_loss, grpo_loss_reference, torch_path

# "triton" is the default one-pass kernel at token level (two-pass at sequence level);
# "triton-two-pass" forces the forward-then-backward kernels everywhere; "triton-split-row" runs the
# one-pass loss on the split-row kernel (each row over at most 4 programs, 256-logit blocks: at V = 1003 a block
# a chunk held in registers, at V = 4999 chunks of 5 blocks read again from L2; kernels/split_row.py).
BACKENDS = ["torch", "triton", "triton-two-pass", "triton-split-row"]
LOSS_TYPE_DEFAULTS = {
    "dr_grpo": dict(max_completion_length=8),
    "cispo": dict(epsilon_high=1.1),
    "dro": dict(dro_beta=0.3),
}
FP32_TOL = dict(atol=1e-6, rtol=1e-5)


def _run(backend, batch, importance_weights=None, normalizer=None, **options):
    """(output, dlogits) of one path; backend None is the reference, "eager" the materializing eager loss."""
    logits = batch["logits"].detach().clone().requires_grad_()
    inputs = {**batch, "logits": logits, "importance_weights": importance_weights, "normalizer": normalizer}
    if backend is None:
        out = grpo_loss_reference(**inputs, **options)
    elif backend == "eager":
        out = grpo_loss_eager(**inputs, **options)
    else:
        one_pass = backend != "triton-two-pass"
        with split_row(4) if backend == "triton-split-row" else contextlib.nullcontext():
            out = grpo_loss(**inputs, backend=backend.split("-")[0], one_pass=one_pass, **options)
    out.loss.backward()
    return out, logits.grad


def check_against_reference(backend, batch, *, grad_tol=FP32_TOL, loss_tol=FP32_TOL, **kwargs):
    expected, expected_grad = _run(None, batch, **kwargs)
    actual, actual_grad = _run(backend, batch, **kwargs)
    assert torch.isfinite(actual.loss)
    assert_close("loss", expected.loss, actual.loss, **loss_tol)
    assert_close("dlogits", expected_grad, actual_grad, **grad_tol)
    assert actual_grad.dtype == batch["logits"].dtype
    active = batch["completion_mask"] != 0
    assert_close(
        "per_token_logps", expected.per_token_logps[active], actual.per_token_logps[active], atol=1e-5, rtol=1e-5
    )
    assert sorted(expected.metrics) == sorted(actual.metrics)
    for name in expected.metrics:
        assert actual.metrics[name].dim() == 0
        assert_close(f"metric {name}", expected.metrics[name], actual.metrics[name], atol=1e-5, rtol=1e-5)
    return expected, actual


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", KERNEL_LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("off_policy", [True, False])
def test_every_loss_type_matches_reference(device, backend, loss_type, level, beta, off_policy):
    batch = make_batch(device=device, off_policy=off_policy, seed=zlib.crc32(f"{loss_type}/{level}".encode()) % 1000)
    check_against_reference(
        backend,
        batch,
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        **LOSS_TYPE_DEFAULTS.get(loss_type, {}),
    )


@pytest.mark.parametrize(
    "loss_type,level",
    [  # the levels each takes (vespo and the families make their own ratio from the token log-ratios)
        (loss_type, level)
        for loss_type in LOSS_TYPES
        for level in ["token", "sequence"]
        if level in LOSS_TYPE_REGISTRY[loss_type].levels
    ],
)
def test_eager_loss_matches_reference(device, loss_type, level):
    """The benchmarks' eager baseline (the materialized log-softmax, then the production math of
    grpo_kernels/objective.py) against the independent specification."""
    batch = make_batch(device=device, seed=zlib.crc32(f"eager/{loss_type}/{level}".encode()) % 1000, per_token_adv=True)
    check_against_reference(
        "eager",
        batch,
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=0.04,
        **LOSS_TYPE_DEFAULTS.get(loss_type, {}),
    )


@pytest.mark.parametrize("backend", BACKENDS + ["eager"])
@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_options_match_reference(device, backend, case):
    spec = dict(OPTION_CASES[case])
    batch = make_batch(device=device, **{k: spec[k] for k in BATCH_KEYS if k in spec}, seed=7)
    options = {k: v for k, v in spec.items() if k not in BATCH_KEYS or k == "temperature"}
    check_against_reference(backend, batch, **options)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", ["row", "column", "token"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_weights_scale_policy_term_only(device, backend, shape, level):
    batch = make_batch(device=device, seed=3)
    B, T = batch["completion_ids"].shape
    weights = {"row": torch.rand(B) + 0.5, "column": torch.rand(B, 1) + 0.5, "token": torch.rand(B, T) + 0.5}[shape]
    check_against_reference(
        backend, batch, importance_weights=weights.to(device), beta=0.1, importance_sampling_level=level
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_importance_weights_leave_kl_alone(device, backend):
    """With zero advantages only the KL term is left, and a rollout weight must not touch it."""
    batch = make_batch(device=device, seed=4)
    batch["advantages"] = torch.zeros_like(batch["advantages"])
    plain, grad = _run(backend, batch, beta=0.1)
    weighted, weighted_grad = _run(backend, batch, beta=0.1, importance_weights=torch.full((3,), 7.0, device=device))
    assert_close("loss", plain.loss, weighted.loss, **FP32_TOL)
    assert_close("dlogits", grad, weighted_grad, **FP32_TOL)
    assert plain.loss > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
def test_dapo_normalizer(device, backend, loss_type):
    batch = make_batch(device=device, seed=5)
    check_against_reference(backend, batch, loss_type=loss_type, normalizer=37.5)
    default, _ = _run(backend, batch, loss_type=loss_type)
    given, _ = _run(backend, batch, loss_type=loss_type, normalizer=batch["completion_mask"].sum())
    assert_close("default normalizer is the local token count", default.loss, given.loss, **FP32_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_half_precision_logits(device, backend, dtype, level):
    """16-bit logits: values in fp32 from the same 16-bit inputs; the gradient is rounded to the dtype."""
    batch = make_batch(device=device, dtype=dtype, seed=11, V=2053)
    eps = torch.finfo(dtype).eps
    check_against_reference(
        backend,
        batch,
        beta=0.04,
        temperature=0.9,
        importance_sampling_level=level,
        grad_tol=dict(atol=1e-5, rtol=2 * eps),
        loss_tol=dict(atol=1e-5, rtol=1e-4),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", KERNEL_LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_fully_masked_batch_is_finite_with_zero_gradient(device, backend, loss_type, level):
    batch = make_batch(device=device, seed=6)
    batch["completion_mask"] = torch.zeros_like(batch["completion_mask"])
    out, grad = _run(
        backend,
        batch,
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=0.04,
        **LOSS_TYPE_DEFAULTS.get(loss_type, {}),
    )
    assert torch.isfinite(out.loss) and out.loss.item() == 0.0
    assert torch.count_nonzero(grad) == 0
    assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_positions_get_zero_gradient_rows(device, backend):
    batch = make_batch(device=device, seed=8)
    _, grad = _run(backend, batch, beta=0.04)
    masked = batch["completion_mask"] == 0
    assert masked.any() and torch.count_nonzero(grad[masked]) == 0
    assert (grad[~masked].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_on_policy_ratio_is_one_and_gradient_flows(device, backend):
    """old_logps=None behaves as TRL's per_token_logps.detach(): ratio 1, no clipping, gradient -A/|o|."""
    batch = make_batch(device=device, off_policy=False, seed=9)
    out, grad = _run(backend, batch, beta=0.0)
    assert out.metrics["clip_ratio/region_mean"].item() == 0.0
    assert grad.abs().sum() > 0
    explicit_old = dict(batch, old_logps=out.per_token_logps)  # the same values, given explicitly
    out_explicit, grad_explicit = _run(backend, explicit_old, beta=0.0)
    assert_close("loss", out.loss, out_explicit.loss, **FP32_TOL)
    assert_close("dlogits", grad, grad_explicit, **FP32_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_clip_metrics_see_low_high_and_unclipped_tokens(device, backend):
    batch = make_batch(device=device, seed=10, clip_spread=0.6, per_token_adv=True)
    _, out = check_against_reference(backend, batch)
    low, high = out.metrics["clip_ratio/low_mean"].item(), out.metrics["clip_ratio/high_mean"].item()
    assert 0 < low < 1 and 0 < high < 1 and low + high < 1
    assert out.metrics["clip_ratio/region_mean"].item() == pytest.approx(low + high)


def test_module_is_the_functional_api_and_update_changes_options(device):
    batch = make_batch(device=device, seed=12)
    loss_fn = GRPOLoss(beta=0.04, epsilon=0.2, backend="torch")
    assert loss_fn(**batch).loss.item() == pytest.approx(grpo_loss(**batch, beta=0.04, backend="torch").loss.item())
    loss_fn.update(beta=0.5, temperature=0.8)
    assert loss_fn.options == GRPOOptions(beta=0.5, temperature=0.8)
    expected = grpo_loss_reference(**batch, beta=0.5, temperature=0.8).loss
    assert_close("loss after update", expected, loss_fn(**batch).loss, **FP32_TOL)


def test_torch_path_never_materializes_full_fp32_logits(monkeypatch):
    """With a small chunk, the torch path works in pieces and still matches the reference."""
    monkeypatch.setattr(torch_path, "CHUNK_ELEMENTS", 2500)  # two rows of V = 1003 per piece
    for strided in (False, True):
        batch = make_batch(seed=13, strided=strided, T=6)
        check_against_reference("torch", batch, beta=0.04, temperature=0.6)


def test_reduction_weights_are_trls_reductions():
    """reduce_loss against TRL 1.16's formulas, transcribed (grpo_trainer.py::_compute_loss)."""
    from grpo_kernels.objective import reduce_loss

    g = torch.Generator().manual_seed(0)
    loss, mask = torch.randn(4, 6, generator=g), (torch.rand(4, 6, generator=g) > 0.4).float()
    mask[2] = 0
    trl = {
        "grpo": ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean(),
        "sapo": ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean(),
        "bnpo": (loss * mask).sum() / mask.sum().clamp(min=1.0),
        "dr_grpo": (loss * mask).sum() / (loss.size(0) * 9),
        "dapo": (loss * mask).sum() / 7.0,
        "cispo": (loss * mask).sum() / 7.0,
        "luspo": (loss * mask).sum(-1).mean(),
    }
    for loss_type, expected in trl.items():
        opts = GRPOOptions(loss_type=loss_type, max_completion_length=9 if loss_type == "dr_grpo" else None)
        normalizer = 7.0 if loss_type in ("dapo", "cispo") else None
        assert_close(loss_type, expected, reduce_loss(loss, mask, opts, normalizer), atol=1e-6, rtol=1e-6)


def test_one_pass_backward_reads_no_logits(device):
    """After the forward, the logits are overwritten with NaN: the one-pass backward never looks."""
    batch = make_batch(device=device, seed=15)
    logits = batch.pop("logits").clone().requires_grad_()
    out = grpo_loss(logits, **batch, beta=0.04, backend="triton")
    expected, expected_grad = _run(None, dict(batch, logits=logits.detach()), beta=0.04)
    with torch.no_grad():
        logits.data.fill_(float("nan"))  # .data: no version bump, so nothing can notice but a read
    (3.0 * out.loss).backward()  # a grad_output that is not 1 is applied too
    assert_close("dlogits", 3.0 * expected_grad, logits.grad, **FP32_TOL)
    assert_close("loss", expected.loss, out.loss, **FP32_TOL)


def test_one_pass_and_two_pass_agree_with_each_other(device):
    batch = make_batch(device=device, seed=16, per_token_adv=True)
    one, one_grad = _run("triton", batch, beta=0.1, delta=1.4, dual_clip=2.5, temperature=0.8)
    two, two_grad = _run("triton-two-pass", batch, beta=0.1, delta=1.4, dual_clip=2.5, temperature=0.8)
    assert_close("loss", two.loss, one.loss, **FP32_TOL)
    assert_close("dlogits", two_grad, one_grad, **FP32_TOL)


def _launch_with_config(device, one_pass, config, V=1003):
    """(the default launch's ForwardResult, the one with ``config``) of one batch's loss forward."""
    from grpo_kernels.kernels import logits_launch
    from grpo_kernels.kernels.contracts import OnePassGradient, TokenInputs
    from grpo_kernels.options import GRPOOptions

    batch = make_batch(B=3, T=5, V=V, seed=11, device=device)
    opts = GRPOOptions(beta=0.04)
    B, T = 3, 5
    flat = lambda t: t.reshape(-1).float().contiguous()  # noqa: E731
    tokens = TokenInputs(
        mask=flat(batch["completion_mask"]),
        advantages=flat(batch["advantages"][:, None].expand(B, T)),
        old_logps=flat(batch["old_logps"]),
        ref_logps=flat(batch["ref_logps"]),
    )
    gradient = OnePassGradient(torch.full((B * T,), 0.1, device=batch["logits"].device)) if one_pass else None
    common = dict(kernel_loss=opts.kernel_loss, temperature=1.0, tokens=tokens, compute_entropy=True, gradient=gradient)
    return (
        logits_launch.forward(batch["logits"], batch["completion_ids"], **common),
        logits_launch.forward(batch["logits"], batch["completion_ids"], config=config, **common),
    )


RESULT_NAMES = ("logp", "entropy", "lse", "loss", "dloss_dlogp", "kl", "flags", "grad_logits")


@pytest.mark.parametrize("programs_per_sm", [1, 3, "l2"])
@pytest.mark.parametrize("one_pass", [True, False])
def test_persistent_schedule_matches_one_program_per_token(device, programs_per_sm, one_pass):
    """The persistent grid (a few programs striding over the tokens; "l2": as many as keep the rows within L2)
    computes exactly what the default does."""
    default, persistent = _launch_with_config(device, one_pass, {"programs_per_sm": programs_per_sm})
    for name in RESULT_NAMES:
        expected, actual = getattr(default, name), getattr(persistent, name)
        assert (expected is None) == (actual is None), name
        if expected is not None:
            assert torch.equal(expected, actual), name


@pytest.mark.parametrize(
    "config",
    [
        {"loop_stages": 3},
        {"l2_hints": False},
        {"l2_hints": True},
        {"loop_stages": 2, "l2_hints": True, "programs_per_sm": "l2"},
    ],
    ids=str,
)
@pytest.mark.parametrize("one_pass", [True, False])
def test_pipelining_and_l2_hints_change_no_value(device, config, one_pass):
    """The row loops' software pipelining and L2 eviction hints are scheduling only: every output is bit for bit
    the default's (the backward's own loop too, through the two-pass loss)."""
    default, scheduled = _launch_with_config(device, one_pass, config)
    for name in RESULT_NAMES:
        expected, actual = getattr(default, name), getattr(scheduled, name)
        if expected is not None:
            assert torch.equal(expected, actual), name
    batch = make_batch(B=2, T=4, V=1003, seed=12, device=device)
    from grpo_kernels.kernels import logits_launch

    r = logits_launch.forward(batch["logits"], batch["completion_ids"])
    g = torch.linspace(-1, 1, 8, device=r.lse.device)
    plain = logits_launch.backward(batch["logits"], batch["completion_ids"], r.lse, g, 1.0)
    assert torch.equal(
        plain, logits_launch.backward(batch["logits"], batch["completion_ids"], r.lse, g, 1.0, config=config)
    )


@pytest.mark.parametrize(
    "V, config", [(1003, {"BLOCK_V": 256, "num_warps": 8}), (5000, {"BLOCK_V": 1024, "num_warps": 16})], ids=str
)
@pytest.mark.parametrize("one_pass", [True, False])
def test_a_block_over_many_warps_matches_the_default(device, V, config, one_pass):
    """Each block is loaded whole (every thread's logits contiguous: 128-bit loads at any warp count) and folded as
    its even and odd logits; with other blocks and warps the sums run in another order, so the results agree with
    the default's to fp32 rounding, the remainder's masked block included (V not a block multiple)."""
    default, other = _launch_with_config(device, one_pass, config, V=V)
    for name in RESULT_NAMES:
        expected, actual = getattr(default, name), getattr(other, name)
        if expected is not None and name != "flags":
            assert_close(name, expected.float(), actual.float(), **FP32_TOL)


def _entropy_slow_path_poisoned(row_ptr, V, c, softcap, lse2, BLOCK_V: tl.constexpr):
    return float("nan")


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="replaces a @triton.jit helper by name, which only the interpreter resolves at call time",
)
@pytest.mark.parametrize("V, block_v", [(1003, None), (5000, 1024), (5000, 4096), (4096, 1024)])
def test_entropy_takes_the_one_pass_path_when_v_is_not_a_block_multiple(monkeypatch, V, block_v):
    """The entropy's slow path (a second read of the row) is only for rows holding a -inf logit.

    The slow path is replaced by one that returns NaN: a finite row must still get the right
    entropy, so the fast path handled it, including the padding of the last, partial block;
    a row with a -inf logit must now come out NaN, which shows the replacement is in effect.
    """
    from grpo_kernels.kernels import logits, logits_launch

    monkeypatch.setattr(logits, "_mean_x2", triton.jit(_entropy_slow_path_poisoned))
    gen = torch.Generator().manual_seed(V)
    logits = 3 * torch.randn(1, 4, V, generator=gen)
    logits[0, 3, 11] = float("-inf")
    ids = torch.randint(0, V, (1, 4), generator=gen)
    config = None if block_v is None else {"BLOCK_V": block_v}
    out = logits_launch.forward(logits, ids, temperature=0.7, compute_entropy=True, config=config)
    scaled = logits[0, :3].double() / 0.7
    expected = -(scaled.softmax(-1) * scaled.log_softmax(-1)).sum(-1)
    assert_close("entropy", out.entropy[:3], expected.float(), **FP32_TOL)
    assert torch.isnan(out.entropy[3]), "the poisoned slow path did not run for the -inf row"
