"""The fused lm_head path against the materialized one: values, d hidden, d weight, d bias, across options.

"triton" runs the kernels (the forward with the loss math inside it at token level, the
chunked backward) in Triton's interpreter on a CPU machine, compiled on a GPU; "torch" is
the chunked torch path. The expected values are the reference on ``hidden @ weight.T + bias``.
"""

import zlib

import pytest
import torch
from helpers import BATCH_KEYS, KERNEL_LOSS_TYPES, OPTION_CASES, assert_close, make_batch

from grpo_kernels import (
    FusedLinearGRPOLoss,
    fused_linear_grpo_loss,
    grpo_loss,
    grpo_loss_reference,
    linear_selective_log_softmax,
    linear_token_logprobs,
    selective_log_softmax,
)
from grpo_kernels.kernels import fused_linear as FL
from grpo_kernels.kernels import fused_linear_launch, logits_launch

BACKENDS = ["torch", "triton"]
B, T, H, V = 3, 5, 37, 203  # odd H and V: every tile has a ragged edge
LOSS_TYPE_DEFAULTS = {"dr_grpo": dict(max_completion_length=8), "cispo": dict(epsilon_high=1.1)}


def _inputs(device, dtype=torch.float32, seed=0, b=B, t=T, h=H, v=V, **batch_kw):
    """A batch from ``make_batch`` (masks, old and ref log-probs near the true ones), hidden states and lm_head."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g)
    weight = 0.3 * torch.randn(v, h, generator=g)
    bias = 0.1 * torch.randn(v, generator=g)
    batch = make_batch(B=b, T=t, V=v, device=device, seed=seed, **batch_kw)
    # old / ref log-probs near this model's own, so that ratios fall on both sides of the clip range
    temperature = batch_kw.get("temperature", 1.0)
    true_lp = (
        torch.log_softmax((hidden @ weight.T + bias) / temperature, -1)
        .gather(-1, batch["completion_ids"].cpu().unsqueeze(-1))
        .squeeze(-1)
    )
    spread = batch_kw.get("clip_spread", 0.4)
    for key, scale in (("old_logps", spread), ("ref_logps", 0.3)):
        if batch[key] is not None:
            batch[key] = (true_lp + scale * torch.randn(b, t, generator=g)).to(device)
    del batch["logits"]
    to = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
    return batch, to(hidden), to(weight), to(bias)


def _run(fn, batch, hidden, weight, bias, freeze_weight=False, **options):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_(not freeze_weight)
    b = None if bias is None else bias.detach().clone().requires_grad_(not freeze_weight)
    out = fn(h, w, b, batch, options)
    out.loss.backward()
    return out, h.grad, w.grad, None if b is None else b.grad


def fused(backend):
    return lambda h, w, b, batch, options: fused_linear_grpo_loss(h, w, **batch, bias=b, backend=backend, **options)


def materialized(h, w, b, batch, options, round_to=None):
    """The reference on the materialized logits; ``round_to`` a 16-bit dtype: the logits rounded to it first, as an
    unfused head in that dtype computes them (the fused head's default, ``head_precision="input"``)."""
    logits = h @ w.T if b is None else h @ w.T + b
    if round_to in (torch.bfloat16, torch.float16):
        logits = logits.to(round_to).to(logits.dtype)
    return grpo_loss_reference(logits, **batch, **options)


def three_products(h, w, b, batch, options):
    return fused_linear_grpo_loss(h, w, **batch, bias=b, backend="triton", lm_head_mode="three_products", **options)


def check(backend, batch, hidden, weight, bias, tol=None, freeze_weight=False, path=None, **options):
    tol = dict(atol=1e-5, rtol=1e-5) if tol is None else tol
    # the expected values: fp32 math on the same (possibly 16-bit) values, the logits rounded to a 16-bit input's
    # dtype as an unfused head's are, gradients cast back
    up = lambda t: None if t is None else t.float()  # noqa: E731
    unfused = lambda h, w, b, batch, options: materialized(h, w, b, batch, options, round_to=hidden.dtype)  # noqa: E731
    expected = _run(unfused, batch, up(hidden), up(weight), up(bias), freeze_weight, **options)
    expected = expected[:1] + tuple(None if e is None else e.to(hidden.dtype) for e in expected[1:])
    actual = _run(path or fused(backend), batch, hidden, weight, bias, freeze_weight, **options)
    assert_close("loss", expected[0].loss, actual[0].loss, **tol)
    active = batch["completion_mask"] != 0
    assert_close("per_token_logps", expected[0].per_token_logps[active], actual[0].per_token_logps[active], **tol)
    # A 16-bit token whose ratio lies within rounding of a clip bound may be clipped on one path and not the
    # other: the clip shares may differ by the share of the tokens whose side of a bound the rounding changed.
    flips = (
        _clip_side_changes(batch, expected[0].per_token_logps, actual[0].per_token_logps, options)
        if hidden.dtype != torch.float32
        else 0.0
    )
    for name in expected[0].metrics:
        metric_tol = dict(tol, atol=tol["atol"] + flips) if name.startswith("clip_ratio") else tol
        assert_close(name, expected[0].metrics[name], actual[0].metrics[name], **metric_tol)
    for name, e, a in zip(("d hidden", "d weight", "d bias"), expected[1:], actual[1:], strict=True):
        if e is None:
            assert a is None, name
        else:
            assert a.dtype == e.dtype
            scale = e.float().abs().max().item()
            assert_close(name, e, a, atol=tol["atol"] * max(scale, 1.0), rtol=tol["rtol"])


def _clip_side_changes(batch, expected_logps, actual_logps, options):
    """The share of active tokens whose token-level ratio is on one side of a clip bound (1 - epsilon,
    1 + epsilon_high) under the expected log-probs and on the other under the actual ones."""
    eps_low = options.get("epsilon", 0.2)
    eps_high = eps_low if options.get("epsilon_high") is None else options["epsilon_high"]  # GRPOOptions' rule
    active = batch["completion_mask"] != 0
    old = batch["old_logps"] if batch.get("old_logps") is not None else expected_logps.detach()

    def sides(logps):
        log_ratio = logps.detach().float() - old.float()
        return log_ratio < torch.log1p(torch.tensor(-eps_low)), log_ratio > torch.log1p(torch.tensor(eps_high))

    changed = torch.zeros_like(active)
    for e, a in zip(sides(expected_logps), sides(actual_logps), strict=True):
        changed |= e != a
    return (changed & active).sum().item() / max(active.sum().item(), 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", KERNEL_LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("off_policy", [True, False])
def test_every_loss_type_matches_materialized_logits(device, backend, loss_type, level, beta, off_policy):
    batch, hidden, weight, bias = _inputs(
        device, seed=zlib.crc32(f"{loss_type}/{level}".encode()) % 1000, off_policy=off_policy
    )
    check(
        backend,
        batch,
        hidden,
        weight,
        bias,
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        temperature=0.8,
        **LOSS_TYPE_DEFAULTS.get(loss_type, {}),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(c for c in OPTION_CASES if "strided" not in c))  # strides are the logits'
def test_options_match_materialized_logits(device, backend, case):
    spec = dict(OPTION_CASES[case])
    shape = {k.lower(): spec[k] for k in ("B", "T", "V") if k in spec}
    batch, hidden, weight, bias = _inputs(
        device, seed=7, **shape, **{k: spec[k] for k in BATCH_KEYS if k in spec and k not in ("B", "T", "V")}
    )
    options = {k: v for k, v in spec.items() if k not in BATCH_KEYS or k == "temperature"}
    check(backend, batch, hidden, weight, bias, **options)


def _block_spanning_inputs(device, dtype=torch.float32):
    """N = 160 tokens (three token blocks of 64), H = 150 (three K slices), V = 300 (three V tiles);
    rows 2 and 3 fully masked, so tokens 64..127 form a block with no active token."""
    batch, hidden, weight, bias = _inputs(device, dtype, seed=11, b=5, t=32, h=150, v=300)
    batch["completion_mask"][:] = 1
    batch["completion_mask"][2:4] = 0
    batch["completion_mask"][0, 20:] = 0
    return batch, hidden, weight, bias


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_token_blocks_k_slices_and_a_masked_block(device, backend):
    check(backend, *_block_spanning_inputs(device), beta=0.04, temperature=0.9)


@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize(
    "options",
    [
        dict(beta=0.04, temperature=0.9),
        dict(loss_type="cispo", epsilon_high=1.1),
        dict(loss_type="sapo", importance_sampling_level="sequence", beta=0.04),
    ],
    ids=["grpo", "cispo", "sapo-sequence"],
)
def test_forward_split_over_the_vocabulary(device, monkeypatch, splits, options):
    """The small-batch forward grid: V = 300 in 128-wide tiles cut into 2 splits (256 + 44 columns) or
    3 (one tile each), merged by the combine kernel; entropy, KL and clip metrics included."""
    calls = []
    combine = FL.linear_grpo_combine_kernel
    monkeypatch.setattr(FL, "linear_grpo_combine_kernel", _Recorder(combine, calls))
    monkeypatch.setattr(fused_linear_launch, "LINEAR_FORWARD_SPLITS", splits)
    check("triton", *_block_spanning_inputs(device), **options)
    assert calls and all(args["splits"] == splits for args in calls)  # every split's partials were merged


class _Recorder:
    """Wraps a kernel: records each launch's arguments by parameter name, then launches it."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        def launch_kernel(*args, **kwargs):
            self.calls.append({**dict(zip(self.kernel.arg_names, args, strict=False)), **kwargs})
            return self.kernel[grid](*args, **kwargs)

        return launch_kernel


@pytest.mark.parametrize(
    "budget, min_tile, tiles",
    [
        # 160 tokens x 128 columns fit: every token in one chunk, the vocabulary of 300 in tiles of 128, 128, 44
        (160 * 128 * 4, 64, [(160, 128), (160, 128), (160, 44)]),
        # not even 128 columns of every token: tiles of the narrowest width over chunks of 64, 64 and 32 tokens
        (64 * 128 * 4, 128, [(64, 128), (64, 128), (64, 44)] * 2 + [(32, 128), (32, 128), (32, 44)]),
    ],
    ids=["vocab", "both"],
)
def test_triton_backward_works_in_bounded_tiles(device, monkeypatch, budget, min_tile, tiles):
    """The recomputing mode's backward within a workspace budget (``LINEAR_TILED_WORKSPACE_BYTES``): tiles of the
    vocabulary (d hidden accumulated over them), and of the tokens where needed (d weight accumulated over those),
    each written into the same workspace, no tile over the budget; the gradients still match the reference."""
    calls = []
    monkeypatch.setattr(FL, "linear_dlogits_kernel", _Recorder(FL.linear_dlogits_kernel, calls))
    monkeypatch.setattr(fused_linear_launch, "LINEAR_TILED_WORKSPACE_BYTES", budget)
    monkeypatch.setattr(fused_linear_launch, "MIN_VOCAB_TILE", min_tile)
    check("triton", *_block_spanning_inputs(device), beta=0.04, loss_type="dapo")
    workspaces = [args["dx_ptr"] for args in calls]
    assert [tuple(w.shape) for w in workspaces] == tiles
    assert all(w.numel() * w.element_size() <= budget for w in workspaces)
    assert len({w.data_ptr() for w in workspaces}) == 1  # one buffer, reused


def test_triton_token_level_runs_the_loss_inside_the_kernel(device, monkeypatch):
    """Token level: the forward kernel returns the per-token loss; no log-prob-only Function runs."""
    from grpo_kernels import from_hidden_states

    def refuse(*args, **kwargs):
        raise AssertionError("the log-prob-only Function ran at token level")

    monkeypatch.setattr(from_hidden_states.HiddenStatesLogprobs, "apply", refuse)
    batch, hidden, weight, bias = _inputs(device, seed=5)
    out = fused_linear_grpo_loss(hidden, weight, **batch, bias=bias, backend="triton", beta=0.04)
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_bias_per_token_advantages_and_importance_weights(device, backend):
    batch, hidden, weight, _ = _inputs(device, seed=1, per_token_adv=True)
    batch["importance_weights"] = torch.rand(B, device=device) + 0.5
    check(backend, batch, hidden, weight, None, beta=0.1, delta=1.5, dual_clip=3.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_weight_gets_no_gradient(device, backend):
    batch, hidden, weight, bias = _inputs(device, seed=2)
    check(backend, batch, hidden, weight, bias, freeze_weight=True, beta=0.04)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1.6e-2), (torch.float16, 4e-3)], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", ["odd", "blocks"])
def test_half_precision(device, backend, dtype, tol, shape):
    """16-bit inputs against fp32 math on the same values, the logits rounded to the dtype as an unfused head in
    that dtype rounds them (accumulated in fp32, rounded once). The gradients are rounded to the input dtype, and
    the Triton path feeds dtype-rounded dlogits to its products, so the tolerance is 4 ulps of the dtype (2^-6
    bf16, 2^-8 fp16) relative to the largest gradient entry. "blocks": several token blocks, H slices and V
    tiles."""
    if shape == "odd":
        batch, hidden, weight, bias = _inputs(device, dtype=dtype, seed=3)
    else:
        batch, hidden, weight, bias = _block_spanning_inputs(device, dtype)
    # values on a coarse grid (hidden states in quarters, the head in eighths): every product and partial sum is
    # exact in fp32 whatever the order of accumulation, so each path rounds the same logits to the dtype (with
    # arbitrary values an order-dependent last bit may put a logit on the other side of a rounding boundary, one
    # ulp of the dtype apart, on the unfused head as on ours)
    hidden, weight, bias = (
        (t.float() * k).round().clamp(-12, 12) / k for t, k in ((hidden, 4), (weight, 8), (bias, 8))
    )
    hidden, weight, bias = (t.to(dtype) for t in (hidden, weight, bias))
    check(backend, batch, hidden, weight, bias, tol=dict(atol=tol, rtol=tol), beta=0.04)


def test_module_and_bad_input(device):
    batch, hidden, weight, bias = _inputs(device)
    loss_fn = FusedLinearGRPOLoss(beta=0.04, backend="torch")
    assert torch.isfinite(loss_fn(hidden, weight, **batch, bias=bias).loss)
    with pytest.raises(ValueError, match=r"weight must be the lm_head weight \[V, H\] with H = 37, got \(203, 36\)"):
        loss_fn(hidden, weight[:, :36], **batch)
    with pytest.raises(ValueError, match=r"hidden_states must be \[B, T, H\]"):
        loss_fn(hidden[0], weight, **batch)
    with pytest.raises(ValueError, match=r"bias must be \[V\]"):
        loss_fn(hidden, weight, **batch, bias=bias[:5])
    with pytest.raises(ValueError, match=r"completion_ids must lie in \[0, V\) = \[0, 203\)"):
        loss_fn(hidden, weight, **dict(batch, completion_ids=batch["completion_ids"] + 500))


def test_torch_path_works_in_bounded_chunks(monkeypatch):
    from grpo_kernels import torch_path

    monkeypatch.setattr(torch_path, "CHUNK_ELEMENTS", 450)  # two tokens of V = 203 per chunk
    batch, hidden, weight, bias = _inputs("cpu", seed=4)
    check("torch", batch, hidden, weight, bias, beta=0.04)


# The 3-product mode (Triton, token level): each chunk's logits computed once, the gradient complete
# at the end of the forward.


@pytest.mark.parametrize("loss_type", KERNEL_LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("off_policy", [True, False])
def test_three_products_mode_matches_materialized_logits(device, loss_type, beta, off_policy):
    batch, hidden, weight, bias = _inputs(
        device, seed=zlib.crc32(f"3p/{loss_type}".encode()) % 1000, off_policy=off_policy
    )
    check(
        "triton",
        batch,
        hidden,
        weight,
        bias,
        path=three_products,
        loss_type=loss_type,
        beta=beta,
        temperature=0.8,
        **LOSS_TYPE_DEFAULTS.get(loss_type, {}),
    )


@pytest.mark.parametrize("case", sorted(c for c in OPTION_CASES if "strided" not in c and "sequence" not in c))
def test_three_products_mode_options(device, case):
    spec = dict(OPTION_CASES[case])
    shape = {k.lower(): spec[k] for k in ("B", "T", "V") if k in spec}
    batch, hidden, weight, bias = _inputs(
        device, seed=8, **shape, **{k: spec[k] for k in BATCH_KEYS if k in spec and k not in ("B", "T", "V")}
    )
    options = {k: v for k, v in spec.items() if k not in BATCH_KEYS or k == "temperature"}
    check("triton", batch, hidden, weight, bias, path=three_products, **options)


def test_three_products_mode_in_bounded_chunks_frozen_weight_and_no_bias(device, monkeypatch):
    """A workspace of 64 tokens: three chunks (64, 64, 32), one buffer; a frozen head skips d weight."""
    monkeypatch.setattr(fused_linear_launch, "LINEAR_WORKSPACE_BYTES", 64 * 300 * 4)
    calls = []
    original = logits_launch.forward

    def recording_forward(logits, *args, **kwargs):
        calls.append((tuple(logits.shape), logits.data_ptr(), kwargs["gradient"].in_place))
        return original(logits, *args, **kwargs)

    monkeypatch.setattr(logits_launch, "forward", recording_forward)
    batch, hidden, weight, bias = _block_spanning_inputs(device)
    check("triton", batch, hidden, weight, bias, path=three_products, beta=0.04, loss_type="dapo")
    assert [c[0] for c in calls] == [(1, 64, 300), (1, 64, 300), (1, 32, 300)]
    assert len({c[1] for c in calls}) == 1 and all(c[2] for c in calls)  # one buffer, dlogits written in place
    check("triton", batch, hidden, weight, None, path=three_products, freeze_weight=True, beta=0.04)


def test_three_products_mode_scales_and_refuses_a_second_backward(device):
    batch, hidden, weight, bias = _inputs(device, seed=9)
    expected = _run(materialized, batch, hidden, weight, bias)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fused_linear_grpo_loss(h, w, **batch, bias=bias, backend="triton", lm_head_mode="three_products")
    (out.loss * 0.25).backward(retain_graph=True)
    assert_close("d hidden scaled", expected[1] * 0.25, h.grad, atol=1e-6, rtol=1e-5)
    assert_close("d weight scaled", expected[2] * 0.25, w.grad, atol=1e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="second backward through a retained graph"):
        out.loss.backward()
    with pytest.raises(ValueError, match="lm_head_mode must be one of"):
        FusedLinearGRPOLoss(lm_head_mode="fast")


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo"])
def test_three_products_mode_without_gradient_is_the_chunked_forward(device, monkeypatch, loss_type):
    """No gradient wanted (evaluation, old log-probs): cuBLAS logits a [tokens, columns] tile at a time within
    the tiled budget (64 tokens x 128 columns: the vocabulary of 300 in three tiles over chunks of 64, 64, 32
    tokens), each tile's log-sum-exp states merged, no gradient buffer and no one-pass kernel; loss, log-probs
    and metrics as materialized (a target in any tile, masked tokens never read)."""
    budget = 64 * 128 * 4
    monkeypatch.setattr(fused_linear_launch, "LINEAR_TILED_WORKSPACE_BYTES", budget)
    monkeypatch.setattr(fused_linear_launch, "MIN_VOCAB_TILE", 128)
    calls = []
    monkeypatch.setattr(FL, "logits_tile_state_kernel", _Recorder(FL.logits_tile_state_kernel, calls))

    def refuse(*args, **kwargs):
        raise AssertionError("the logits kernel ran on whole rows without a gradient")

    monkeypatch.setattr(logits_launch, "forward", refuse)
    batch, hidden, weight, bias = _block_spanning_inputs(device)
    options = dict(loss_type=loss_type, beta=0.04, temperature=0.9, **LOSS_TYPE_DEFAULTS.get(loss_type, {}))
    expected = materialized(hidden, weight, bias, batch, options)
    with torch.no_grad():
        actual = three_products(hidden, weight, bias, batch, options)
    tiles = [(64, 128, 0), (64, 128, 128), (64, 44, 256)] * 2 + [(32, 128, 0), (32, 128, 128), (32, 44, 256)]
    assert [(*c["logits_ptr"].shape, c["v0"]) for c in calls] == tiles
    assert all(c["logits_ptr"].numel() * c["logits_ptr"].element_size() <= budget for c in calls)
    assert len({c["logits_ptr"].data_ptr() for c in calls}) == 1  # one workspace, reused
    assert_close("loss", expected.loss, actual.loss, atol=1e-5, rtol=1e-5)
    active = batch["completion_mask"] != 0
    assert_close(
        "per_token_logps", expected.per_token_logps[active], actual.per_token_logps[active], atol=1e-5, rtol=1e-5
    )
    for name in expected.metrics:
        assert_close(name, expected.metrics[name], actual.metrics[name], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_under_autocast_the_head_computes_as_f_linear_does(device, backend):
    """A model body under a bf16 autocast gives bf16 hidden states while the head's weight stays fp32 (the master
    weights): the fused head then computes as ``F.linear`` under the same autocast (both operands in bf16, the
    logits rounded to bf16) and equals it followed by the unfused loss, with d weight in fp32 (it raised a dtype
    mismatch). fp32 hidden states are cast alike; ``head_precision="fp32"`` is fp32 whatever the autocast."""
    batch, hidden, weight, bias = _inputs(device)
    device_type = hidden.device.type
    for body_dtype in (torch.bfloat16, torch.float32):
        leaves = [hidden.detach().to(body_dtype).requires_grad_(), weight.clone().requires_grad_()]
        twins = [t.detach().clone().requires_grad_() for t in leaves]
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
            ours = fused_linear_grpo_loss(*leaves, **batch, bias=bias, backend=backend, beta=0.04)
            logits = torch.nn.functional.linear(twins[0], twins[1], bias)
            assert logits.dtype is torch.bfloat16
            expected = grpo_loss(logits, **batch, backend="torch", beta=0.04)
        ours.loss.backward()
        expected.loss.backward()
        assert leaves[1].grad.dtype is torch.float32
        assert_close("loss", expected.loss, ours.loss, atol=1e-6, rtol=1e-5)
        assert_close("d hidden", twins[0].grad.float(), leaves[0].grad.float(), atol=2e-2, rtol=2e-2)
        assert_close("d weight", twins[1].grad, leaves[1].grad, atol=2e-3, rtol=2e-2)
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16):  # the log-prob family's entry points too
        body = hidden.to(torch.bfloat16)
        ids = batch["completion_ids"]
        expected_lp = selective_log_softmax(torch.nn.functional.linear(body, weight, bias), ids, backend="torch")
        for ours_lp in (
            linear_selective_log_softmax(body, weight, ids, bias, backend=backend),
            linear_token_logprobs(body, weight, ids, bias, backend=backend),
        ):
            assert_close("log-probs", expected_lp, ours_lp, atol=1e-6, rtol=1e-5)
    results = []
    for autocast in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=autocast):
            out = fused_linear_grpo_loss(h, w, **batch, bias=bias, backend=backend, beta=0.04, head_precision="fp32")
        out.loss.backward()
        results.append((out.loss, h.grad, w.grad))
    for name, plain, cast in zip(("loss", "d hidden", "d weight"), *results, strict=True):
        assert_close(name, plain, cast, atol=1e-6, rtol=1e-5)


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Every tensor an op makes in new storage (not a view, not an ``out=``), by bytes: on the meta device, where a
    Qwen-sized head costs nothing."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen = {
            t.untyped_storage()._cdata
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in seen:
                seen.add(t.untyped_storage()._cdata)
                self.sizes.append(t.untyped_storage().nbytes())
        return out


def _qwen_head_on_meta():
    """Qwen's head at a GRPO step's size, on the meta device: N = 16384 tokens, H = 4096, V = 151936, bf16."""
    from grpo_kernels import GRPOOptions
    from grpo_kernels.kernels.contracts import TokenInputs

    N, H, V = 16384, 4096, 151936
    meta = dict(device="meta")
    ones = torch.ones(N, **meta)
    return (
        torch.empty(N, H, dtype=torch.bfloat16, **meta),
        torch.empty(V, H, dtype=torch.bfloat16, **meta),
        torch.zeros(N, dtype=torch.int64, **meta),
        GRPOOptions(beta=0.04).kernel_loss,
        TokenInputs(ones, ones, ones, ones, ones),
    )


def test_the_lm_heads_workspaces_are_bounded_at_qwens_size():
    """At N = 16384, H = 4096, V = 151936 in bf16 (the kernels recorded, not run; the products on the meta device):
    the 3-product mode without a gradient allocates at most 256 MiB of workspace plus O(N) (its outputs and the
    tiles' [4, 19, N] states: about 330 bytes a token), where it held 1 GiB of whole rows; the recomputing mode's
    backward the same beyond its three gradients; only the 3-product mode with a gradient, whose one-pass kernel
    needs whole rows, keeps its 1 GiB (``LINEAR_WORKSPACE_BYTES``)."""
    import aot

    from grpo_kernels.kernels.contracts import OnePassGradient

    hidden, weight, ids, kernel_loss, tokens = _qwen_head_on_meta()
    N, H = hidden.shape
    V = weight.shape[0]
    MiB = 1 << 20
    assert fused_linear_launch.LINEAR_TILED_WORKSPACE_BYTES == 256 * MiB
    assert fused_linear_launch.workspace_tiles(N, V, 2) == (N, 8192)  # 19 tiles of the vocabulary, all the tokens
    with aot.recorded_launches() as launches, _Allocations() as no_grad:
        fused_linear_launch.linear_three_products(
            hidden,
            weight,
            None,
            ids,
            kernel_loss=kernel_loss,
            tokens=tokens,
            compute_entropy=True,
            gradient=None,
            compute_weight_grad=False,
        )
    assert {item.kernel.fn.__name__ for item in launches} == {"logits_tile_state_kernel", "linear_grpo_combine_kernel"}
    assert max(no_grad.sizes) == 256 * MiB and sum(no_grad.sizes) <= 256 * MiB + 400 * N, sum(no_grad.sizes) / MiB

    with aot.recorded_launches(), _Allocations() as backward:
        fused_linear_launch.linear_backward(hidden, weight, None, ids, tokens.mask, tokens.mask, 1.0, True)
    gradients = N * H * 4 + V * H * 4  # d hidden, d weight (fp32)
    assert sum(backward.sizes) - gradients <= 256 * MiB + 400 * N, (sum(backward.sizes) - gradients) / MiB

    with aot.recorded_launches(), _Allocations() as with_grad:
        fused_linear_launch.linear_three_products(
            hidden,
            weight,
            None,
            ids,
            kernel_loss=kernel_loss,
            tokens=tokens,
            compute_entropy=True,
            gradient=OnePassGradient(tokens.mask),
            compute_weight_grad=True,
        )
    whole_rows = fused_linear_launch.linear_chunk_tokens(N, V, 2, 1) * V * 2
    assert whole_rows <= fused_linear_launch.LINEAR_WORKSPACE_BYTES < whole_rows + V * 2
    assert whole_rows in with_grad.sizes
