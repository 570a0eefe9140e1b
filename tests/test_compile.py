"""torch.compile as users write compiled steps (``docs/stacks.md``): each public loss, log-prob, method-family and
distillation function and Module compiled with ``fullgraph=True`` from its first call, its options as keywords (and as
``options=``), on both backends (Triton in its interpreter here), equal to eager in values and every gradient (fp32,
1e-6); ten successive values of every float option under ``update()`` add no graph; what cannot compile is refused
by name before tracing; no warning on a compile.

The compiler is ``aot_eager``: dynamo and AOT autograd, where a graph break, a guard on an option's value or a float
specialized in the backward shows (inductor compiles the same graphs: ``tests/test_api.py``'s inductor cases)."""

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from grpo_kernels import (
    FusedLinearGRPOLoss,
    FusedLinearTopKDistillationLoss,
    GRPOLoss,
    GRPOOptions,
    KeptSet,
    TopKDistillationLoss,
    dpo_loss,
    fused_linear_grpo_loss,
    fused_linear_topk_distillation_loss,
    grpo_loss,
    linear_selective_log_softmax,
    linear_selective_log_softmax_and_entropy,
    linear_token_logprobs,
    reverse_kl_advantages,
    reverse_kl_distillation_loss,
    reward_model_loss,
    rft_loss,
    selective_log_softmax,
    selective_log_softmax_and_entropy,
    sft_loss,
    token_entropy,
    token_logprobs,
    topk_distillation_loss,
    topk_logprobs,
)

BACKENDS = ["torch", "triton"]
COMPILER = "aot_eager"
B, T, H, V, K = 4, 6, 8, 29, 3
TIGHT = dict(atol=1e-6, rtol=1e-6)


def _inputs():
    """Hidden states, a head, the logits they make, a batch with a partial row and garbage (-100, NaN) at masked
    positions, a teacher's top-k."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, H, generator=g)
    weight = 0.5 * torch.randn(V, H, generator=g)
    mask = torch.ones(B, T)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    ids = torch.where(mask > 0, torch.randint(0, V, (B, T), generator=g), -100)
    logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    garbage = lambda t: torch.where(mask > 0, t, float("nan"))  # noqa: E731
    old = garbage(logp + 0.3 * torch.randn(B, T, generator=g))
    ref = garbage(logp + 0.2 * torch.randn(B, T, generator=g))
    teacher_logps, teacher_ids = torch.log_softmax(torch.randn(B, T, V, generator=g), -1).topk(K, -1)
    return dict(
        hidden=hidden,
        weight=weight,
        logits=hidden @ weight.T,
        ids=ids,
        mask=mask,
        advantages=torch.randn(B, generator=g),
        old=old,
        ref=ref,
        teacher_ids=teacher_ids,
        teacher_logps=teacher_logps,
        rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]),
    )


def _calls(backend: str) -> dict:
    """Each entry point as a user's step: (the step, the names of its differentiable inputs); a step returns the
    tensors compared with eager's."""
    kw = dict(backend=backend)
    lin_kw = dict(backend=backend, check_ids=False)  # (ids of -100 at masked tokens: the log-prob family reads all)
    grpo_module = GRPOLoss(beta=0.04, loss_type="dapo", **kw)
    fused_module = FusedLinearGRPOLoss(beta=0.04, delta=1.8, **kw)
    topk_module = TopKDistillationLoss(**kw)
    fused_topk_module = FusedLinearTopKDistillationLoss(**kw)

    def loss_outputs(out):
        return (out.loss, *out.metrics.values())

    def safe(x):
        return x["ids"].clamp(min=0)

    def grpo(x, **options):
        return grpo_loss(x["logits"], x["ids"], x["mask"], x["advantages"], x["old"], x["ref"], **options, **kw)

    return {
        "grpo_loss keywords": (
            lambda x: loss_outputs(grpo(x, beta=0.04, loss_type="dapo", epsilon=0.25)),
            ("logits",),
        ),
        "grpo_loss options=": (
            lambda x: loss_outputs(grpo(x, options=GRPOOptions(beta=0.04, loss_type="grpo", dual_clip=3.0))),
            ("logits",),
        ),
        "fused_linear_grpo_loss keywords": (
            lambda x: loss_outputs(
                fused_linear_grpo_loss(
                    x["hidden"],
                    x["weight"],
                    x["ids"],
                    x["mask"],
                    x["advantages"],
                    x["old"],
                    x["ref"],
                    loss_type="dr_grpo",
                    max_completion_length=T,
                    beta=0.04,
                    **kw,
                )
            ),  # fmt: skip
            ("hidden", "weight"),
        ),
        "GRPOLoss": (
            lambda x: loss_outputs(grpo_module(x["logits"], x["ids"], x["mask"], x["advantages"], x["old"], x["ref"])),
            ("logits",),
        ),
        "FusedLinearGRPOLoss": (
            lambda x: loss_outputs(
                fused_module(x["hidden"], x["weight"], x["ids"], x["mask"], x["advantages"], x["old"], x["ref"])
            ),
            ("hidden", "weight"),
        ),
        "token_logprobs": (
            lambda x: token_logprobs(
                x["logits"], safe(x), 0.9, True, return_sum_pi_squared=True, logit_softcap=9.0, **kw
            ),  # fmt: skip
            (),
        ),
        "linear_token_logprobs": (
            lambda x: linear_token_logprobs(x["hidden"], x["weight"], safe(x), None, 0.9, True, **kw),
            (),
        ),
        "selective_log_softmax": (lambda x: selective_log_softmax(x["logits"], safe(x), 0.9, **kw), ("logits",)),
        "selective_log_softmax_and_entropy": (
            lambda x: selective_log_softmax_and_entropy(x["logits"], safe(x), 0.9, logit_scale=0.5, **kw),
            ("logits",),
        ),
        "token_entropy": (lambda x: token_entropy(x["logits"], 0.9, **kw), ("logits",)),
        "linear_selective_log_softmax": (
            lambda x: linear_selective_log_softmax(x["hidden"], x["weight"], safe(x), temperature=0.9, **lin_kw),
            ("hidden", "weight"),
        ),
        "linear_selective_log_softmax_and_entropy": (
            lambda x: linear_selective_log_softmax_and_entropy(
                x["hidden"], x["weight"], safe(x), temperature=0.9, logit_softcap=9.0, **lin_kw
            ),
            ("hidden", "weight"),
        ),
        "sft_loss": (lambda x: loss_outputs(sft_loss(x["logits"], x["ids"], x["mask"], **kw)), ("logits",)),
        "sft_loss hidden states": (
            lambda x: loss_outputs(sft_loss(x["hidden"], x["ids"], x["mask"], weight=x["weight"], **kw)),
            ("hidden", "weight"),
        ),
        "rft_loss": (
            lambda x: loss_outputs(rft_loss(x["logits"], x["ids"], x["mask"], x["rewards"], **kw)),
            ("logits",),
        ),
        "dpo_loss": (
            lambda x: loss_outputs(dpo_loss(x["logits"], x["ids"], x["mask"], x["ref"], beta=0.2, **kw)),
            ("logits",),
        ),
        "reward_model_loss": (
            lambda x: reward_model_loss(x["logits"][:, 0, 0], x["logits"][:, 0, 1], center_rewards_coefficient=0.01),
            ("logits",),
        ),
        "topk_logprobs": (lambda x: topk_logprobs(x["logits"], x["teacher_ids"], 0.9, **kw), ("logits",)),
        "topk_logprobs hidden states": (
            lambda x: topk_logprobs(x["hidden"], x["teacher_ids"], 0.9, weight=x["weight"], **kw),
            ("hidden", "weight"),
        ),
        "topk_distillation_loss verl": (
            lambda x: loss_outputs(
                topk_distillation_loss(x["logits"], x["teacher_ids"], x["teacher_logps"], x["mask"], 0.9, **kw)
            ),
            ("logits",),
        ),
        "topk_distillation_loss trl unchecked": (
            lambda x: loss_outputs(
                topk_distillation_loss(
                    x["logits"],
                    x["teacher_ids"],
                    x["teacher_logps"],
                    x["mask"],
                    0.9,
                    convention="trl",
                    alpha=0.5,
                    check_ids=False,
                    **kw,
                )  # fmt: skip
            ),
            ("logits",),
        ),
        "fused_linear_topk_distillation_loss": (
            lambda x: loss_outputs(
                fused_linear_topk_distillation_loss(
                    x["hidden"],
                    x["weight"],
                    x["teacher_ids"],
                    x["teacher_logps"],
                    x["mask"],
                    loss_agg_mode="seq-mean-token-sum-norm",
                    **kw,
                )
            ),  # fmt: skip
            ("hidden", "weight"),
        ),
        "TopKDistillationLoss": (
            lambda x: loss_outputs(topk_module(x["logits"], x["teacher_ids"], x["teacher_logps"], x["mask"])),
            ("logits",),
        ),
        "FusedLinearTopKDistillationLoss": (
            lambda x: loss_outputs(
                fused_topk_module(x["hidden"], x["weight"], x["teacher_ids"], x["teacher_logps"], x["mask"])
            ),
            ("hidden", "weight"),
        ),
        "reverse_kl_distillation_loss": (
            lambda x: loss_outputs(reverse_kl_distillation_loss(x["logits"], x["ids"], x["ref"], x["mask"], 0.9, **kw)),
            ("logits",),
        ),
        "reverse_kl_advantages": (
            lambda x: reverse_kl_advantages(x["old"], x["ref"], x["mask"], estimator="k3", loss_max_clamp=5.0),
            (),
        ),
    }


def _run(step, inputs: dict, differentiable) -> tuple:
    """The step's outputs and the gradients of their sum w.r.t. the differentiable inputs (fresh leaves)."""
    leaves = {name: inputs[name].clone().requires_grad_() for name in differentiable}
    outputs = step({**inputs, **leaves})
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    if differentiable:
        sum(o.float().sum() for o in outputs if o.requires_grad).backward()
    return tuple(o.detach() for o in outputs), tuple(leaves[name].grad for name in differentiable)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_entry_point_compiles_from_its_first_call_and_equals_eager(backend):
    """Compiled first (no eager call with the same keywords before it: an eager call used to fill the options'
    cache and hide a graph break), fullgraph, with no warning: the outputs and every gradient equal eager's."""
    inputs = _inputs()
    for name, (step, differentiable) in _calls(backend).items():
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # dynamo's own warnings (a traced lru_cache, ...) fail
            compiled = _run(torch.compile(step, fullgraph=True, backend=COMPILER), inputs, differentiable)
        eager = _run(step, inputs, differentiable)
        for kind, got_all, want_all in zip(("output", "gradient"), compiled, eager, strict=True):
            for i, (got, want) in enumerate(zip(got_all, want_all, strict=True)):
                torch.testing.assert_close(got, want, **TIGHT, equal_nan=True, msg=lambda m, n=name, k=kind,
                                           i=i: f"{n}: {k} {i}: {m}")  # fmt: skip


# ---- options changed between steps: runtime values, never guards -------------------------------------------------

# each float option (and its loss type): ten successive values under ``update()`` (a schedule)
FLOAT_OPTIONS = {
    "temperature": ({}, lambda i: dict(temperature=1.0 - 0.03 * i)),
    "epsilon": ({}, lambda i: dict(epsilon=0.2 + 0.01 * i)),
    "epsilon_high": ({}, lambda i: dict(epsilon_high=0.25 + 0.01 * i)),
    "beta": ({}, lambda i: dict(beta=0.04 + 0.01 * i)),
    "delta": (dict(delta=1.5), lambda i: dict(delta=1.5 + 0.1 * i)),
    "dual_clip": (dict(dual_clip=3.0), lambda i: dict(dual_clip=3.0 + 0.1 * i)),
    "log_ratio_clamp": (dict(log_ratio_clamp=20.0), lambda i: dict(log_ratio_clamp=0.2 + 0.1 * i)),
    "kl_clamp": (dict(kl_clamp=10.0), lambda i: dict(kl_clamp=0.01 + 0.01 * i)),
    "entropy_coef": ({}, lambda i: dict(entropy_coef=0.001 + 0.01 * i)),
    "sapo temperatures": (
        dict(loss_type="sapo"),
        lambda i: dict(sapo_temperature_pos=1.0 + 0.1 * i, sapo_temperature_neg=1.05 + 0.1 * i),
    ),
    "vespo": (
        dict(loss_type="vespo"),
        lambda i: dict(
            vespo_k_pos=2 + 0.1 * i, vespo_lambda_pos=3 + 0.1 * i, vespo_k_neg=3 + 0.1 * i, vespo_lambda_neg=2 + 0.1 * i
        ),  # fmt: skip
    ),
    "cispo": (dict(loss_type="cispo", epsilon_high=3.0), lambda i: dict(epsilon_high=1.2 + 0.1 * i)),
    "cispo_ratio_min": (dict(loss_type="cispo", cispo_ratio_min=0.5), lambda i: dict(cispo_ratio_min=0.5 + 0.05 * i)),
    "dppo": (dict(loss_type="dppo_tv", delta=2.0), lambda i: dict(epsilon=0.05 + 0.01 * i, delta=2.0 + 0.1 * i)),
    "gmpo": (dict(loss_type="gmpo"), lambda i: dict(epsilon=0.1 + 0.01 * i)),
    "dro_beta": (dict(loss_type="dro", dro_beta=0.1), lambda i: dict(dro_beta=0.1 + 0.01 * i)),
    "off_policy_mask_threshold": (
        dict(off_policy_mask_threshold=0.5),
        lambda i: dict(off_policy_mask_threshold=0.01 + 0.02 * i),
    ),
    "logit_scale": ({}, lambda i: dict(logit_scale=1.0 + 0.1 * i)),
    "logit_softcap": (dict(logit_softcap=30.0), lambda i: dict(logit_softcap=2.0 + 0.5 * i)),
}
# Triton's graph hands its options to its fused ops, one kind of value each; dynamic=True (floats symbolic from the
# first call) on a few: the interpreter and symbolic shapes are slow, and neither changes how an option is read
SCHEDULES = [  # (backend, dynamic, options, whether FusedLinearGRPOLoss too for temperature and beta)
    ("torch", None, tuple(FLOAT_OPTIONS), True),
    ("torch", True, ("epsilon",), False),
    ("triton", None, ("temperature", "entropy_coef"), False),
    ("triton", True, ("beta",), False),
]


@pytest.mark.parametrize(
    "backend, dynamic, names, fused_too", SCHEDULES, ids=[f"{b}-dynamic={d}" for b, d, *_ in SCHEDULES]
)
def test_ten_values_of_every_float_option_add_no_graph(backend, dynamic, names, fused_too):
    """A temperature or clip schedule: ``loss_fn.update(...)`` with ten successive values of each float option, the
    compiled step called after each, is one graph (the options' floats are a tensor input of the graph, never a
    guard; ``dynamic=None``, dynamo's default, as with ``dynamic=True``), its loss and gradient equal to eager's
    with the same options at the first and the last value. (Each value was a new graph, and the ninth failed with
    FailOnRecompileLimitHit.)"""
    x = _inputs()
    for name in names:
        base, change = FLOAT_OPTIONS[name]
        both = fused_too and name in ("temperature", "beta")
        for module in ("GRPOLoss", "FusedLinearGRPOLoss") if both else ("GRPOLoss",):
            torch._dynamo.reset()
            counters.clear()
            options = dict(beta=0.04, **base)
            loss_fn = (GRPOLoss if module == "GRPOLoss" else FusedLinearGRPOLoss)(backend=backend, **options)
            head = (x["hidden"], x["weight"]) if module == "FusedLinearGRPOLoss" else (x["logits"],)

            def step(*inputs, loss_fn=loss_fn):
                out = loss_fn(*inputs, x["ids"], x["mask"], x["advantages"], x["old"], x["ref"])
                return (out.loss, *out.metrics.values())

            compiled = torch.compile(step, fullgraph=True, backend=COMPILER, dynamic=dynamic)
            for i in range(10):
                loss_fn.update(**change(i))
                leaves = [t.clone().requires_grad_() for t in head]
                got = compiled(*leaves)
                got[0].backward()
                if i not in (0, 9):
                    continue
                twins = [t.clone().requires_grad_() for t in head]
                want = step(*twins)
                want[0].backward()
                for a, b in zip((*got, *(t.grad for t in leaves)), (*want, *(t.grad for t in twins)), strict=True):
                    message = lambda m, n=name, i=i: f"{n} {i}: {m}"  # noqa: E731
                    torch.testing.assert_close(a, b, **TIGHT, equal_nan=True, msg=message)
            assert counters["stats"]["unique_graphs"] == 1, (name, module, counters["stats"]["unique_graphs"])


# ---- what a graph cannot hold, refused by name -------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_what_cannot_compile_is_refused_by_name(backend):
    """A packed batch (its layout sized by the longest sequence), Clip-Cov / KL-Cov (tokens chosen on the host),
    ``top_entropy_quantile < 1`` (a quantile over the active tokens) and the kept set: each refused by name inside a
    fullgraph compile, before a data-dependent guard or a host read could fail with dynamo's own message
    (``docs/stacks.md`` lists them)."""
    x = _inputs()
    packed_mask, packed_ids = x["mask"].reshape(-1), x["ids"].reshape(-1).clamp(min=0)
    cu_seqlens = torch.arange(0, B * T + 1, T, dtype=torch.int32)
    kept_set = KeptSet.from_padded(x["ids"].clamp(min=0).unsqueeze(-1))
    cases = {
        r"cu_seqlens \(a packed batch\) inside a torch.compile graph": lambda: (
            GRPOLoss(backend=backend)(
                x["logits"].reshape(B * T, V), packed_ids, packed_mask, x["advantages"], cu_seqlens=cu_seqlens
            ).loss
        ),
        r"cu_seqlens \(a packed batch\) inside a torch.compile graph.*": lambda: token_logprobs(
            x["logits"].reshape(B * T, V), packed_ids, cu_seqlens=cu_seqlens, backend=backend
        ),
        r"loss_type='clip_cov' inside a torch.compile graph": lambda: (
            grpo_loss(
                x["logits"], x["ids"], x["mask"], x["advantages"], x["old"], loss_type="clip_cov", backend=backend
            ).loss
        ),
        r"loss_type='kl_cov' inside a torch.compile graph": lambda: (
            grpo_loss(
                x["logits"], x["ids"], x["mask"], x["advantages"], x["old"], loss_type="kl_cov", backend=backend
            ).loss
        ),
        r"top_entropy_quantile=0.5 inside a torch.compile graph": lambda: (
            grpo_loss(x["logits"], x["ids"], x["mask"], x["advantages"], top_entropy_quantile=0.5, backend=backend).loss
        ),
        r"kept_set inside a torch.compile graph": lambda: (
            grpo_loss(
                x["logits"],
                x["ids"],
                x["mask"],
                x["advantages"],
                backend=backend,
                kept_set=kept_set,
            ).loss
        ),  # fmt: skip
    }
    for message, call in cases.items():
        torch._dynamo.reset()
        with pytest.raises(Exception, match=message):
            torch.compile(call, fullgraph=True, backend=COMPILER)()
