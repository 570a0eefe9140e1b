"""The API around the kernels: token_logprobs, in-place backward, bad input, compile, recompiles."""

import inspect
import os
import re

import pytest
import torch
from helpers import assert_close, make_batch

from grpo_kernels import (
    FusedLinearGRPOLoss,
    GRPOLoss,
    GRPOOptions,
    grpo_loss,
    grpo_loss_reference,
    reference,
    token_logprobs,
)
from grpo_kernels.kernels import logits as K

BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_match_reference(device, backend, strided, dtype):
    batch = make_batch(device=device, strided=strided, dtype=dtype, seed=1, V=2500)
    logits, ids = batch["logits"], batch["completion_ids"]
    expected_lp, expected_entropy = reference.token_logprobs_and_entropy(logits, ids, 0.8)
    lp, entropy = token_logprobs(logits, ids, temperature=0.8, return_entropy=True, backend=backend)
    assert lp.dtype == torch.float32 and not lp.requires_grad
    assert_close("logps", expected_lp, lp, atol=1e-5, rtol=1e-5)
    assert_close("entropy", expected_entropy, entropy, atol=1e-5, rtol=1e-5)
    assert_close("logps only", expected_lp, token_logprobs(logits, ids, 0.8, backend=backend), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_with_masked_out_vocabulary(device, backend):
    """-inf logits (a masked vocabulary, even a whole block of it) give finite log-probs and entropy."""
    batch = make_batch(device=device, seed=2, V=3000)
    logits = batch["logits"].clone()
    logits[..., :2100] = float("-inf")  # more than one full block
    ids = torch.randint(2100, 3000, batch["completion_ids"].shape, device=device)
    expected_lp, expected_entropy = reference.token_logprobs_and_entropy(logits, ids)
    lp, entropy = token_logprobs(logits, ids, return_entropy=True, backend=backend)
    assert torch.isfinite(lp).all() and torch.isfinite(entropy).all()
    assert_close("logps", expected_lp, lp, atol=1e-5, rtol=1e-5)
    assert_close("entropy", expected_entropy, entropy, atol=1e-5, rtol=1e-5)


class LmHead(torch.nn.Module):
    def __init__(self, H, V):
        super().__init__()
        self.proj = torch.nn.Linear(H, V, bias=False)

    def forward(self, x):
        return self.proj(x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_in_place_backward_gives_the_same_parameter_gradients(device, backend, level):
    torch.manual_seed(0)
    B, T, H, V = 3, 4, 8, 1003
    head = LmHead(H, V).to(device)
    hidden = torch.randn(B, T, H, device=device)
    batch = make_batch(B=B, T=T, V=V, device=device, seed=3)
    del batch["logits"]
    grads = []
    for in_place in (False, True):
        head.zero_grad()
        logits = head(hidden)
        out = grpo_loss(
            logits, **batch, beta=0.04, importance_sampling_level=level, backend=backend, in_place_backward=in_place
        )
        out.loss.backward()
        grads.append(head.proj.weight.grad.clone())
        if in_place:  # the logits' storage now holds dlogits
            assert logits._version > 0
    assert_close("weight grad", grads[0], grads[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_backward_cannot_silently_corrupt_another_user_of_the_logits(device, backend):
    """A second autograd user of the logits that reads them after our backward gets an error."""
    head = LmHead(8, 1003).to(device)
    batch = make_batch(B=2, T=3, V=1003, device=device, seed=4)
    del batch["logits"]
    logits = head(torch.randn(2, 3, 8, device=device))
    other = (logits * logits).mean()  # saves logits for its backward, created before our loss
    out = grpo_loss(logits, **batch, backend=backend, in_place_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.loss + other).backward()


def test_in_place_backward_refuses_a_leaf(device):
    batch = make_batch(device=device)
    logits = batch.pop("logits").clone().requires_grad_()
    with pytest.raises(ValueError, match="in_place_backward=True would overwrite logits, a leaf"):
        grpo_loss(logits, **batch, in_place_backward=True)


def _bad(batch, **changes):
    return {**batch, **changes}


BAD_INPUTS = {
    "logits 2-d": (
        lambda b: _bad(b, logits=b["logits"][0]),
        ValueError,
        r"logits must be \[B, T, V\] \(3 dims\), got shape \(5, 1003\)",
    ),
    "logits int": (
        lambda b: _bad(b, logits=b["logits"].long()),
        TypeError,
        r"logits must be float32, bfloat16, float16 or float64 \(the torch path\), got torch.int64",
    ),
    "ids shape": (
        lambda b: _bad(b, completion_ids=b["completion_ids"][:, :3]),
        ValueError,
        r"completion_ids must be \[B, T\] = \(3, 5\) to match logits \[B, T, V\], got \(3, 3\)",
    ),
    "ids float": (
        lambda b: _bad(b, completion_ids=b["completion_ids"].float()),
        TypeError,
        "completion_ids must be an integer tensor, got torch.float32",
    ),
    "ids too large": (
        lambda b: _bad(b, completion_ids=b["completion_ids"].clone().fill_(1003)),
        ValueError,
        r"completion_ids must lie in \[0, V\) = \[0, 1003\) at active positions, got a token id 1003",
    ),
    "ids negative": (
        lambda b: _bad(b, completion_ids=b["completion_ids"].clone().fill_(-100)),
        ValueError,
        "got a token id -100",
    ),
    "mask shape": (
        lambda b: _bad(b, completion_mask=b["completion_mask"][:, :2]),
        ValueError,
        r"completion_mask must have shape \(3, 5\), got \(3, 2\)",
    ),
    "mask missing": (lambda b: _bad(b, completion_mask=None), ValueError, "completion_mask is required"),
    "advantages shape": (
        lambda b: _bad(b, advantages=torch.zeros(4)),
        ValueError,
        r"advantages must have shape \(3, 5\) or \(3,\) or \(3, 1\), got \(4,\)",
    ),
    "advantages int": (
        lambda b: _bad(b, advantages=torch.zeros(3, dtype=torch.long)),
        TypeError,
        "advantages must be a floating-point tensor, got torch.int64",
    ),
    "old_logps shape": (
        lambda b: _bad(b, old_logps=torch.zeros(3)),
        ValueError,
        r"old_logps must have shape \(3, 5\), got \(3,\)",
    ),
    "importance_weights shape": (
        lambda b: _bad(b, importance_weights=torch.ones(2, 5)),
        ValueError,
        r"importance_weights must have shape \(3, 5\) or \(3,\) or \(3, 1\), got \(2, 5\)",
    ),
    "beta without ref": (
        lambda b: _bad(b, ref_logps=None, beta=0.04),
        ValueError,
        r"beta=0.04 > 0 needs ref_logps \[B, T\]",
    ),
    "normalizer for grpo": (
        lambda b: _bad(b, normalizer=10.0),
        ValueError,
        r"normalizer is the token count of loss_type in \['dapo', 'cispo', 'vespo', 'dppo_tv', 'dppo_kl', 'gpg', 'dro', "
        r"'clip_cov', 'kl_cov'\]; loss_type='grpo' does not use it",
    ),
    "normalizer zero": (
        lambda b: _bad(b, normalizer=0, loss_type="dapo"),
        ValueError,
        "normalizer must be a positive, finite token count, got 0",
    ),
    "normalizer tensor zero": (
        lambda b: _bad(b, normalizer=torch.tensor(0.0), loss_type="dapo"),
        ValueError,
        r"normalizer must be a positive, finite token count, got 0.0 \(TRL clamps",
    ),
    "normalizer tensor negative": (
        lambda b: _bad(b, normalizer=torch.tensor(-4.0), loss_type="cispo"),
        ValueError,
        "normalizer must be a positive, finite token count, got -4.0",
    ),
    "normalizer inf": (
        lambda b: _bad(b, normalizer=float("inf"), loss_type="dapo"),
        ValueError,
        "normalizer must be a positive, finite token count, got inf",
    ),
    "normalizer tensor nan": (
        lambda b: _bad(b, normalizer=torch.tensor(float("nan")), loss_type="dapo"),
        ValueError,
        "normalizer must be a positive, finite token count, got nan",
    ),
    "normalizer string": (
        lambda b: _bad(b, normalizer="10", loss_type="dapo"),
        ValueError,
        "normalizer must be a positive number",
    ),
    "unknown loss_type": (
        lambda b: _bad(b, loss_type="ppo"),
        ValueError,
        r"loss_type must be one of \['grpo', 'bnpo', 'dr_grpo', 'dapo', 'luspo', 'cispo', 'sapo', 'vespo', 'dppo_tv', "
        r"'dppo_kl', 'gpg', 'gmpo', 'dro', 'clip_cov', 'kl_cov'\], got 'ppo'",
    ),
    "unknown level": (
        lambda b: _bad(b, importance_sampling_level="seq"),
        ValueError,
        "importance_sampling_level must be one of",
    ),
    "unknown kl": (lambda b: _bad(b, kl_estimator="k4"), ValueError, "kl_estimator must be one of"),
    "dr_grpo without length": (
        lambda b: _bad(b, loss_type="dr_grpo"),
        ValueError,
        "loss_type='dr_grpo' needs max_completion_length",
    ),
    "negative beta": (lambda b: _bad(b, beta=-0.1), ValueError, "beta must be >= 0, got -0.1"),
    "zero temperature": (lambda b: _bad(b, temperature=0.0), ValueError, "temperature must be > 0, got 0.0"),
    "dual clip below one": (lambda b: _bad(b, dual_clip=0.5), ValueError, "dual_clip must be > 1"),
    "dual clip with sapo": (
        lambda b: _bad(b, dual_clip=3.0, loss_type="sapo"),
        ValueError,
        "dual_clip applies to the PPO-clip loss types",
    ),
    "bias kl without kl": (
        lambda b: _bad(b, use_bias_correction_kl=True),
        ValueError,
        "use_bias_correction_kl=True multiplies the KL term, but beta=0",
    ),
    "unknown backend": (
        lambda b: _bad(b, backend="cuda"),
        ValueError,
        r"backend must be one of \['auto', 'triton', 'torch'\], got 'cuda'",
    ),
    # what a new user gets wrong first, each error naming the fix
    "logits one position more": (
        lambda b: _bad(b, logits=torch.cat([b["logits"], b["logits"][:, :1]], 1)),
        ValueError,
        r"logits \[B, T \+ 1, \.\.\.\] = \(3, 6\) hold one position more than completion_ids \[B, T\] = \(3, 5\): a model's whole output, whose last position predicts nothing; pass drop_last_position=True",
    ),
    "mask negative": (
        lambda b: _bad(b, completion_mask=b["completion_mask"] * 2 - 1),
        ValueError,
        r"completion_mask must be finite and >= 0 \(1 counts a token, 0 masks it, another value weights it\), got values from -1 to 1: a -1 or another padding marker must become 0",
    ),
    "mask inf": (
        lambda b: _bad(b, completion_mask=b["completion_mask"].masked_fill(b["completion_mask"] == 1, float("inf"))),
        ValueError,
        r"completion_mask must be finite and >= 0.*got values from 0 to inf",
    ),
    # a weight above 1 is a weight (TRL's per_token_loss * mask), as the randomized tests draw it: not refused
    "mask nan": (
        lambda b: _bad(b, completion_mask=torch.full_like(b["completion_mask"], float("nan"))),
        ValueError,
        r"completion_mask must be finite and >= 0.*got a NaN",
    ),
    "vocabulary strided": (
        lambda b: _bad(b, logits=torch.cat([b["logits"], b["logits"]], -1)[..., ::2]),
        ValueError,
        r"logits need a unit last stride, got strides \(10030, 2006, 2\) \(backend='torch'\); views that slice B or T are fine, a transposed or strided vocabulary is not \(call .contiguous\(\)\)",
    ),
    "another trainer's option name": (
        lambda b: _bad(b, clip_eps=0.2),
        TypeError,
        r"unknown option 'clip_eps'; did you mean 'epsilon' \(another trainer's name for it\)\?",
    ),
    "a call keyword among the options": (
        lambda b: _bad(b, head_precision="fp32"),
        TypeError,
        r"'head_precision' is not a loss option \(a GRPOOptions field\) but a keyword of the call",
    ),
    "misspelt option": (
        lambda b: _bad(b, epsilom=0.2),
        TypeError,
        r"unknown option 'epsilom'; did you mean 'epsilon'\?",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_a_clear_error(case):
    change, error, message = BAD_INPUTS[case]
    kwargs = change(make_batch())
    with pytest.raises(error, match=message):
        grpo_loss(**kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_takes_the_same_inputs(backend):
    """What one backend refuses, the other refuses with the same message (code that passes on a laptop's CPU runs on
    the GPU): a vocabulary-strided view, a mask outside [0, 1], one position more than the ids; the log-prob
    functions name drop_last_position as well. Views that slice B or T pass on both."""
    batch = make_batch()
    for case in ("vocabulary strided", "mask negative", "logits one position more"):
        change, error, message = BAD_INPUTS[case]
        with pytest.raises(error, match=message.replace("'torch'", repr(backend))):
            grpo_loss(**change(batch), backend=backend)
    sliced = torch.cat([batch["logits"], batch["logits"]], 1)[:, 1::2]  # strides over T: fine everywhere
    assert torch.isfinite(grpo_loss(**{**batch, "logits": sliced}, backend=backend).loss)
    longer = torch.cat([batch["logits"], batch["logits"][:, :1]], 1)
    with pytest.raises(ValueError, match=r"completion_ids must be \[B, T\] = \(3, 6\).*got \(3, 5\)|one position more"):
        token_logprobs(longer, batch["completion_ids"], backend=backend)
    with pytest.raises(ValueError, match="drop_last_position=True"):
        token_logprobs(longer, batch["completion_ids"], backend=backend)


def test_device_mismatch_is_named():
    batch = make_batch()
    batch["advantages"] = batch["advantages"].to("meta")
    with pytest.raises(ValueError, match="advantages is on meta but logits is on cpu"):
        grpo_loss(**batch)


def test_triton_backend_on_cpu_without_interpreter_is_explained(monkeypatch):
    from grpo_kernels import validation

    monkeypatch.setattr(validation, "interpreter_enabled", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        grpo_loss(**make_batch(), backend="triton")


def test_options_object_and_keywords_are_exclusive():
    with pytest.raises(ValueError, match="either as options= or as keywords"):
        GRPOLoss(options=GRPOOptions(), beta=0.1)


def test_per_step_values_are_runtime_arguments():
    """Changing T, beta, epsilons, temperature, ... between steps must not recompile a kernel.

    Triton specializes integer arguments on their value (== 1, divisible by 16); the ones
    that change between steps are excluded, and every float is a plain run-time argument.
    Only feature flags and block sizes are constexprs.
    """
    source = inspect.getsource(K)
    for name in ("grpo_forward_kernel", "logprob_backward_kernel"):
        header = re.search(rf"def {name}\((.*?)\):", source, re.S).group(1)
        params = [p.strip() for p in header.replace("\n", " ").split(",") if p.strip()]
        constexprs = {p.split(":")[0].strip() for p in params if "constexpr" in p}
        for name in ("T", "V", "N", "stride_b", "stride_t", "inv_temperature", "grad_stride_b", "grad_stride_t"):
            assert name not in constexprs
        # feature flags, block sizes and the launch schedule (fixed by the configuration, not the step)
        assert constexprs <= {
            "LOSS_KIND",
            "HAS_OLD",
            "HAS_KL",
            "KL_KIND",
            "LOSS_FLAGS",
            "HAS_IW",
            "HAS_MASK",
            "COMPUTE_ENTROPY",
            "WRITE_GRAD",
            "ROW_ALIGN",
            "BLOCK_V",
            "PERSISTENT",
            "HAS_ENTROPY_GRAD",
            "LOOP_STAGES",
            "L2_HINTS",
        }
    assert set(K.RUNTIME_INTS) == {"T", "V", "N", "stride_b", "stride_t", "grad_stride_b", "grad_stride_t"}
    for name in ("grpo_forward_kernel", "logprob_backward_kernel"):
        assert re.search(rf"@triton\.jit\(do_not_specialize=RUNTIME_INTS\)\ndef {name}", source), name


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "sapo", "grpo prompt_mean"])
def test_grpo_loss_under_torch_compile(loss_type):
    """A training step calling GRPOLoss compiles as one graph (fullgraph=True, default options, inductor) on
    the CPU and matches the specification: the ids' range check runs as a device-side assertion inside the
    graph and the torch path's chunk loops are custom ops (grpo_kernels/ops.py), so nothing breaks the graph
    (nor does the prompt mean's grouping of the rows: a sort, no host sync)."""
    torch._dynamo.reset()
    loss_type, *aggregation = loss_type.split()
    batch = make_batch(seed=14, B=4, prompts=2 if aggregation else None)
    options = dict(loss_type=loss_type, beta=0.04, max_completion_length=8 if loss_type == "dr_grpo" else None)
    options |= dict(aggregation=aggregation[0]) if aggregation else {}
    loss_fn = GRPOLoss(**options)

    def step(logits):
        out = loss_fn(
            logits,
            batch["completion_ids"],
            batch["completion_mask"],
            batch["advantages"],
            batch["old_logps"],
            batch["ref_logps"],
            prompt_ids=batch.get("prompt_ids"),
        )
        return out.loss * 2.0

    compiled = torch.compile(step, fullgraph=True)
    logits = batch["logits"].clone().requires_grad_()
    loss = compiled(logits)
    loss.backward()
    expected_logits = batch["logits"].clone().requires_grad_()
    expected = (
        grpo_loss_reference(expected_logits, **{k: v for k, v in batch.items() if k != "logits"}, **options).loss * 2.0
    )
    expected.backward()
    assert_close("loss", expected, loss, atol=1e-6, rtol=1e-5)
    assert_close("dlogits", expected_logits.grad, logits.grad, atol=1e-5, rtol=1e-5)


def _graph_counting_backend(counts):
    def backend(gm, example_inputs):
        counts.append(gm)
        return gm.forward

    return backend


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dynamic, most_graphs", [(None, 2), (True, 1)])
def test_a_torch_compiled_step_does_not_recompile_per_completion_length(backend, fused, dynamic, most_graphs):
    """Four completion lengths, fullgraph=True with the default options (the ids checked): at most two graphs
    (dynamo's automatic dynamic shapes: the first length, then one dynamic graph), one with dynamic=True; the
    loss and the gradients as eager's. The logits path (drop_last_position) and the fused lm_head, dapo with a
    tensor normalizer (its check is in the graph too); both backends (Triton in its interpreter here: inside a
    graph its log-prob kernels are custom ops and the loss math graph code, where eager fuses the loss into the
    kernels, so the weight's gradient, a sum over tokens, agrees to fp32 rounding of another order of sums)."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors run the Triton path only in its interpreter (TRITON_INTERPRET=1)")
    torch._dynamo.reset()
    H, V, B = 16, 50, 3
    loss_fn = (
        FusedLinearGRPOLoss(beta=0.04, loss_type="dapo", backend=backend)
        if fused
        else GRPOLoss(beta=0.04, loss_type="dapo", drop_last_position=True, backend=backend)
    )

    def step(x, w, ids, mask, adv, ref):
        extra = (x, w) if fused else (x,)
        return loss_fn(*extra, ids, mask, adv, ref_logps=ref, normalizer=mask.sum()).loss

    graphs = []
    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic, backend=_graph_counting_backend(graphs))
    for T in (5, 7, 9, 12):
        g = torch.Generator().manual_seed(T)
        x = torch.randn(B, T, H, generator=g) if fused else torch.randn(B, T + 1, V, generator=g)
        w = torch.randn(V, H, generator=g)
        ids, mask = torch.randint(0, V, (B, T), generator=g), (torch.rand(B, T, generator=g) > 0.3).float()
        adv, ref = torch.randn(B, generator=g), -torch.rand(B, T, generator=g)
        results = []
        for fn in (step, compiled):
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            loss = fn(xx, ww, ids, mask, adv, ref)
            loss.backward()
            results.append((loss.detach(), xx.grad, ww.grad))
        (loss, gx, gw), (c_loss, c_gx, c_gw) = results
        assert_close(f"loss T={T}", loss, c_loss, atol=1e-6, rtol=1e-5)
        grad_tol = dict(atol=1e-6, rtol=1e-5) if backend == "torch" else dict(atol=2e-5, rtol=1e-4)
        assert_close(f"d input T={T}", gx, c_gx, **grad_tol)
        if fused:
            assert_close(f"d weight T={T}", gw, c_gw, **grad_tol)
    assert 1 <= len(graphs) <= most_graphs


@pytest.mark.parametrize("one_pass, op", [(None, "triton_one_pass_loss"), (False, "triton_two_pass_loss")])
def test_a_compiled_loss_runs_eagers_schedule_as_one_op(device, one_pass, op):
    """Inside a torch.compile graph (fullgraph, inductor) the Triton path's fused loss runs the schedule eager runs,
    as one custom op: the one-pass op, whose backward scales the gradient it wrote in place (inductor reinplaces it:
    no copy of the [B, T, V] gradient), or the two-pass op; the loss, metrics and dlogits are eager's to the bit."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors run the Triton path only in its interpreter (TRITON_INTERPRET=1)")
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    B, T, V = 3, 5, 40
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T + 1, V, generator=g).to(device)
    ids, adv = torch.randint(0, V, (B, T), generator=g).to(device), torch.randn(B, generator=g).to(device)
    mask, ref = (torch.rand(B, T, generator=g) > 0.2).float().to(device), (-torch.rand(B, T, generator=g)).to(device)
    loss_fn = GRPOLoss(beta=0.04, drop_last_position=True, backend="triton", one_pass=one_pass, entropy_coef=0.01)

    def step(x):
        out = loss_fn(x, ids, mask, adv, ref_logps=ref, loss_scale=0.5)
        return out.loss, out.metrics

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        x = logits.clone().requires_grad_()

        def run(fn=fn, x=x):
            loss, metrics = fn(x)
            (loss * 2.0).backward()
            return loss, metrics

        (loss, metrics), code = run_and_get_code(run) if fn is not step else (run(), None)
        results.append((loss.detach(), {k: v.detach() for k, v in metrics.items()}, x.grad, code))
    (loss, metrics, grad, _), (c_loss, c_metrics, c_grad, code) = results
    assert torch.equal(c_loss, loss) and torch.equal(c_grad, grad)
    assert metrics.keys() == c_metrics.keys() and all(torch.equal(c_metrics[k], metrics[k]) for k in metrics)
    forward, backward = code
    assert f"grpo_kernels.{op}.default(" in forward and "triton_logprobs" not in forward
    if op == "triton_one_pass_loss":
        assert "grpo_kernels.triton_scale_.default(" in backward
        assert ".clone(" not in backward and "copy_(" not in backward


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA case of the test above (the device suite runs it)")
def test_a_compiled_step_on_the_gpu_is_one_graph_on_the_triton_path():
    """On a GPU (the device suite), fullgraph=True with inductor: the Triton path's custom ops in one graph,
    the loss and dlogits as eager's, no recompile across four completion lengths with dynamic=True."""
    torch._dynamo.reset()
    graphs = []

    def counting_inductor(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    loss_fn = GRPOLoss(beta=0.04, drop_last_position=True, backend="triton")
    step = lambda x, ids, mask, adv, ref: loss_fn(x, ids, mask, adv, ref_logps=ref).loss  # noqa: E731
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counting_inductor)
    for T in (64, 96, 128, 200):
        g = torch.Generator().manual_seed(T)
        x = torch.randn(4, T + 1, 1003, generator=g).cuda().to(torch.bfloat16)
        ids, mask = torch.randint(0, 1003, (4, T), generator=g).cuda(), torch.ones(4, T, device="cuda")
        adv, ref = torch.randn(4, generator=g).cuda(), -torch.rand(4, T, generator=g).cuda()
        results = []
        for fn in (step, compiled):
            leaf = x.clone().requires_grad_()
            loss = fn(leaf, ids, mask, adv, ref)
            loss.backward()
            results.append((loss.detach().float(), leaf.grad.float()))
        assert_close(f"loss T={T}", results[0][0], results[1][0], atol=1e-5, rtol=1e-4)
        assert_close(f"dlogits T={T}", results[0][1], results[1][1], atol=1e-4, rtol=2e-2)  # bf16 gradients
    assert len(graphs) == 1


def test_a_torch_compiled_step_asserts_the_ids_range_on_the_device():
    """Inside a graph there is no host sync: an id outside [0, V) at an active position fails the step through a
    device-side assertion (an inactive one is allowed, as in eager)."""
    torch._dynamo.reset()
    batch = make_batch(seed=2)
    loss_fn = GRPOLoss()
    compiled = torch.compile(
        lambda logits, ids, mask: loss_fn(logits, ids, mask, batch["advantages"]).loss,
        fullgraph=True,
        backend="aot_eager",
    )
    ids, mask = batch["completion_ids"].clone(), batch["completion_mask"].clone()
    V = batch["logits"].shape[-1]
    mask[0, -1] = 0
    ids[0, -1] = V + 5  # masked: allowed
    compiled(batch["logits"], ids, mask)
    ids[1, 0] = V  # active: refused
    with pytest.raises(RuntimeError, match=r"completion_ids must lie in \[0, V\)"):
        compiled(batch["logits"], ids, mask)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lead", [(7,), (2, 5)])
def test_selective_log_softmax_values_and_gradient(device, backend, lead):
    from grpo_kernels import selective_log_softmax

    g = torch.Generator().manual_seed(3)
    logits = (2 * torch.randn(*lead, 1003, generator=g)).to(device).requires_grad_()
    index = torch.randint(0, 1003, lead, generator=g).to(device)
    weights = torch.randn(*lead, generator=g).to(device)
    lp = selective_log_softmax(logits, index, 0.8, backend=backend)
    (lp * weights).sum().backward()
    expected_logits = logits.detach().clone().requires_grad_()
    expected = torch.log_softmax(expected_logits / 0.8, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    (expected * weights).sum().backward()
    assert lp.shape == lead
    assert_close("logps", expected, lp, atol=1e-5, rtol=1e-5)
    assert_close("dlogits", expected_logits.grad, logits.grad, atol=1e-5, rtol=1e-5)


def test_presets_and_trl_config():
    GRPOConfig = pytest.importorskip("trl", reason="the trl extra is not installed").GRPOConfig

    from grpo_kernels.advantages import group_advantages

    verl = GRPOLoss(preset="verl", beta=0.001).options
    assert (verl.dual_clip, verl.log_ratio_clamp, verl.kl_estimator, verl.kl_clamp, verl.beta) == (
        3.0,
        20.0,
        "k3",
        10.0,
        0.001,
    )
    assert GRPOLoss(preset="openrlhf").options.kl_estimator == "k1"
    with pytest.raises(ValueError, match="preset must be one of"):
        GRPOLoss(preset="deepspeed")
    config = GRPOConfig(
        output_dir="/tmp/unused",
        loss_type="dr_grpo",
        beta=0.04,
        epsilon=0.1,
        epsilon_high=0.3,
        temperature=0.7,
        max_completion_length=64,
        importance_sampling_level="sequence",
        use_bias_correction_kl=True,
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    opts = GRPOLoss.from_trl_config(config, backend="torch").options
    assert opts == GRPOOptions(
        loss_type="dr_grpo",
        beta=0.04,
        epsilon=0.1,
        epsilon_high=0.3,
        temperature=0.7,
        max_completion_length=64,
        importance_sampling_level="sequence",
        use_bias_correction_kl=True,
    )
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    trl_adv = group_advantages(rewards, 2, preset="trl").advantages
    groups = rewards.view(2, 2)
    expected = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
    torch.testing.assert_close(trl_adv, expected)


def test_the_launchers_take_the_temperature_from_one_source():
    """With options, the launchers read the temperature (and the head's scale and soft-cap) from them; a different one beside them is refused."""
    from grpo_kernels.kernels import logits_launch
    from grpo_kernels.kernels.contracts import TokenInputs

    logits, ids = torch.randn(1, 2, 50), torch.randint(0, 50, (1, 2))
    opts = GRPOOptions(temperature=0.7)
    assert logits_launch.resolved_head(opts.kernel_loss, None, None) == (0.7, None) and logits_launch.resolved_head(
        None, None, None
    ) == (1.0, None)
    capped = GRPOOptions(temperature=0.7, logit_scale=2.0, logit_softcap=30.0)
    assert logits_launch.resolved_head(capped.kernel_loss, None, None) == (0.35, 15.0)
    with pytest.raises(ValueError, match="softcap=5.0 beside options"):
        logits_launch.resolved_head(capped.kernel_loss, None, 5.0)
    with pytest.raises(ValueError, match="temperature=0.9 disagrees with the options' temperature=0.7"):
        logits_launch.forward(
            logits, ids, kernel_loss=opts.kernel_loss, temperature=0.9, tokens=TokenInputs(advantages=torch.zeros(2))
        )


def test_the_specification_is_imported_by_no_loss_path():
    """reference.py is the oracle: if a loss path imported it, the spec and the product would be one code
    and the tests would compare the code with itself. Only the package's public re-export may name it."""
    import ast
    import pathlib

    import grpo_kernels

    package = pathlib.Path(grpo_kernels.__file__).parent
    importers = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "__init__.py" and path.parent == package:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [f"{node.module}.{a.name}" if node.module else a.name for a in node.names]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n.split(".")[-1] == "reference" or ".reference." in f".{n}." for n in names):
                importers.append(str(path.relative_to(package)))
    assert importers == [], f"production modules import the specification: {importers}"
