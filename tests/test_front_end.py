"""The front end as one family: the log-prob functions' shared keywords, the hidden-state log-probs, the
prepared inputs, the options' one documentation source and the Modules' composition."""

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch
from helpers import assert_close

from grpo_kernels import (
    FusedLinearGRPOLoss,
    GRPOLoss,
    GRPOOptions,
    fused_linear_grpo_loss,
    grpo_loss,
    linear_token_logprobs,
    selective_log_softmax,
    selective_log_softmax_and_entropy,
    token_entropy,
    token_logprobs,
)
from grpo_kernels.from_logits import LogitsSource
from grpo_kernels.inputs import CallSettings, LossCall, prepare_inputs
from grpo_kernels.option_docs import option_names, options_table
from grpo_kernels.options import LOSS_TYPE_REGISTRY, LOSS_TYPES
from grpo_kernels.policy_terms import FAMILY_TERMS

BACKENDS = ["torch", "triton"]
TOL = dict(atol=2e-5, rtol=2e-5)
OPTIONS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "options.md"


def _lm_head(device, B=3, T=6, H=32, V=517, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    b = torch.randn(V, generator=g) if bias else None
    ids = torch.randint(0, V, (B, T), generator=g)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(hidden), to(weight), to(b), to(ids)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_token_logprobs_equal_token_logprobs_on_the_materialized_logits(device, backend, bias):
    hidden, weight, b, ids = _lm_head(device, bias=bias)
    logits = hidden @ weight.T + (0 if b is None else b)
    expected_lp, expected_h = token_logprobs(logits, ids, 0.8, True, backend=backend)
    lp, h = linear_token_logprobs(hidden, weight, ids, b, 0.8, True, backend=backend)
    assert lp.shape == ids.shape and h.shape == ids.shape and not lp.requires_grad
    assert_close("log-probs", expected_lp, lp, **TOL)
    assert_close("entropy", expected_h, h, **TOL)
    assert_close(
        "log-probs alone", expected_lp, linear_token_logprobs(hidden, weight, ids, b, 0.8, backend=backend), **TOL
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_token_logprobs_of_a_packed_batch(device, backend):
    hidden, weight, b, ids = _lm_head(device, B=1, T=11)
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32, device=device)  # an empty sequence too
    logits = hidden[0] @ weight.T + b
    expected = token_logprobs(logits, ids[0], return_entropy=True, backend=backend, cu_seqlens=cu)
    got = linear_token_logprobs(hidden[0], weight, ids[0], b, return_entropy=True, backend=backend, cu_seqlens=cu)
    for name, e, x in zip(("log-probs", "entropy"), expected, got, strict=True):
        assert x.shape == (11,)
        assert_close(name, e, x, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lm_head_mode", ["recompute", "three_products"])
def test_linear_token_logprobs_are_the_fused_losss_own_log_probs(device, backend, lm_head_mode):
    """Old log-probs from linear_token_logprobs make a fused lm_head loss on-policy: ratio 1, no clipping."""
    hidden, weight, b, ids = _lm_head(device, seed=3)
    mask = torch.ones(ids.shape, device=device)
    mask[0, 4:] = 0
    old = linear_token_logprobs(hidden, weight, ids, b, backend=backend)
    out = fused_linear_grpo_loss(
        hidden,
        weight,
        ids,
        mask,
        torch.randn(ids.shape[0], device=device),
        old,
        bias=b,
        backend=backend,
        lm_head_mode=lm_head_mode,
    )
    assert_close("log-probs", old * mask, out.per_token_logps * mask, **TOL)
    assert float(out.metrics["clip_ratio/region_mean"]) == 0.0


def test_reduce_hidden_grad_is_refused_where_it_means_nothing(device):
    """reduce_hidden_grad=False leaves d hidden's sum over a tensor-parallel group to the caller: refused by name
    without a group, for logits, and as anything but a bool (before any collective runs)."""
    from grpo_kernels import linear_selective_log_softmax
    from grpo_kernels.distillation import topk_logprobs

    hidden, weight, b, ids = _lm_head(device)
    with pytest.raises(ValueError, match=r"reduce_hidden_grad=False .* needs vocab_parallel_group, got None"):
        linear_selective_log_softmax(hidden, weight, ids, b, reduce_hidden_grad=False)
    with pytest.raises(TypeError, match="reduce_hidden_grad must be True or False, got 'no'"):
        linear_selective_log_softmax(hidden, weight, ids, b, reduce_hidden_grad="no")
    logits = hidden @ weight.T
    with pytest.raises(ValueError, match="reduce_hidden_grad=False is about d hidden .* the input here is logits"):
        topk_logprobs(logits, ids.unsqueeze(-1), reduce_hidden_grad=False, vocab_parallel_group=object())


def test_linear_token_logprobs_check_their_inputs(device):
    hidden, weight, b, ids = _lm_head(device)
    with pytest.raises(ValueError, match=r"^ids must lie in \[0, V\) = \[0, \d+\), got a token id \d+$"):
        linear_token_logprobs(hidden, weight, torch.full_like(ids, weight.shape[0]), b)
    with pytest.raises(ValueError, match="weight must be the lm_head weight"):
        linear_token_logprobs(hidden, weight[:, :5], ids, b)
    with pytest.raises(ValueError, match=r"must be \[B, T\] = \(3, 6\)"):
        linear_token_logprobs(hidden, weight, ids[:, :2], b)
    with pytest.raises(ValueError, match=r"ids must have shape \(18,\) \(hidden_states without its last dim\)"):
        linear_token_logprobs(hidden.reshape(18, -1), weight, ids, b)


def test_the_log_prob_family_takes_the_same_keywords():
    """Every function of the family takes the shared keywords; token_entropy has no ids, so no check_ids and
    no cu_seqlens (its values are per position); token_logprobs and linear_token_logprobs have no backward,
    so no in_place_backward; hidden states have no extra position to drop."""
    shared = {
        "backend",
        "drop_last_position",
        "cu_seqlens",
        "vocab_parallel_group",
        "vocab_start_index",
        "check_ids",
        "in_place_backward",
    }
    exceptions = {
        token_logprobs: {"in_place_backward"},
        linear_token_logprobs: {"in_place_backward", "drop_last_position"},
        token_entropy: {"check_ids", "cu_seqlens"},
    }
    for fn in (
        token_logprobs,
        linear_token_logprobs,
        selective_log_softmax,
        token_entropy,
        selective_log_softmax_and_entropy,
    ):
        params = inspect.signature(fn).parameters
        assert shared - exceptions.get(fn, set()) <= set(params), fn.__name__
        ids_names = {"ids", "index", "completion_ids", "labels"} & set(params)
        assert ids_names <= {"ids"}, (fn.__name__, ids_names)  # one name for the ids


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_differentiable_family_drops_the_last_position_and_skips_the_ids_check(device, backend):
    g = torch.Generator().manual_seed(1)
    full = torch.randn(2, 5, 41, generator=g).to(device).requires_grad_()
    ids = torch.randint(0, 41, (2, 4), generator=g).to(device)
    lp, h = selective_log_softmax_and_entropy(full, ids, 0.9, backend=backend, drop_last_position=True)
    expected_lp, expected_h = selective_log_softmax_and_entropy(full[:, :-1], ids, 0.9, backend=backend)
    assert_close("log-probs", expected_lp, lp, **TOL)
    assert_close("entropy", expected_h, token_entropy(full, 0.9, backend=backend, drop_last_position=True), **TOL)
    (lp.sum() + h.sum()).backward()
    assert full.grad[:, -1].abs().max() == 0  # the dropped position gets a zero gradient
    lp_sliced = selective_log_softmax(full, ids, 0.9, backend=backend, drop_last_position=True, check_ids=False)
    assert_close("without the ids check", expected_lp, lp_sliced, **TOL)
    with pytest.raises(ValueError, match=r"^ids must lie in \[0, V\) = \[0, \d+\), got a token id \d+$"):
        selective_log_softmax(full[:, :-1], ids + 41, backend=backend)
    with pytest.raises(ValueError, match=r"^ids must lie in \[0, V\) = \[0, \d+\), got a token id -100$"):
        selective_log_softmax(full[:, :-1], ids.masked_fill(ids == ids[0, 0], -100), backend=backend)
    packed = selective_log_softmax(
        full[0],
        torch.randint(0, 41, (5,)).to(device),
        backend=backend,
        cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32, device=device),
    )
    assert packed.shape == (5,)


def test_prepared_inputs_are_frozen_and_packed_once(device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 13, generator=g).to(device)
    ids = torch.randint(0, 13, (7,), generator=g).to(device)
    cu = torch.tensor([0, 3, 7], device=device)
    call = LossCall(ids, torch.ones(7, device=device), torch.randn(2, generator=g).to(device), cu_seqlens=cu)
    inputs = prepare_inputs(LogitsSource(logits), call, CallSettings(GRPOOptions(), backend="torch"))
    assert inputs.source.tensor.shape == (1, 7, 13) and inputs.ids.shape == (1, 7) and inputs.caller_shape == (7,)
    assert inputs.layout.packed and inputs.mask_seq.shape == (2, 4)
    assert inputs.mask.dtype == torch.float32 and inputs.mask.is_contiguous()  # the kernels' one mask
    with pytest.raises(AttributeError):
        inputs.ids = ids


def test_keyword_options_are_built_once_and_still_checked():
    """grpo_loss's keyword options are kept per set of keywords (what the launchers read of them with them),
    keyed by type too: beta=True is refused even after beta=1 was kept; a changed option is new options with
    facts of their own, none kept from the old."""
    from grpo_kernels.inputs import options_from

    first = options_from(None, dict(beta=1, epsilon=0.2))
    assert options_from(None, dict(epsilon=0.2, beta=1)) is first
    kernel_loss = first.kernel_loss
    assert options_from(None, dict(beta=1, epsilon=0.2)).kernel_loss is kernel_loss  # built once
    with pytest.raises(TypeError, match="beta must be a finite number, got True"):
        options_from(None, dict(beta=True, epsilon=0.2))
    changed = first.replace(beta=0.5)
    assert changed.kernel_loss.args["loss_scalars"][4] == 0.5 and kernel_loss.args["loss_scalars"][4] == 1.0
    assert changed != first and first == GRPOOptions(beta=1, epsilon=0.2)  # equality and repr see fields only
    assert "kernel_loss" not in repr(first) and "uses_kl" not in repr(first)


def test_the_options_table_the_docstrings_and_the_options_agree():
    """One source: the options page shows options_table() (docs/hooks.py), whose groups list every option, and
    both Modules' docstrings name every option and their own keywords."""
    documented = set(option_names())
    assert [f.name for f in dataclasses.fields(GRPOOptions) if f.name not in documented] == []
    assert "<!-- options_table -->" in OPTIONS_PAGE.read_text(), "docs/options.md shows option_docs.options_table()"
    table = options_table()
    for name in option_names() + ("backend", "one_pass", "in_place_backward", "check_ids", "drop_last_position"):
        assert table.count(f"`{name}`") >= 1, name  # each in its group's table
    for module, own in (
        (GRPOLoss, ("one_pass", "drop_last_position", "in_place_backward")),
        (FusedLinearGRPOLoss, ("check_ids",)),
    ):
        doc = re.sub(r"\s+", " ", module.__doc__)
        for name in option_names() + own:
            assert name in doc, (module.__name__, name)


def test_the_fused_lm_head_module_is_a_sibling_not_a_subclass():
    assert not issubclass(FusedLinearGRPOLoss, GRPOLoss)
    loss = FusedLinearGRPOLoss(beta=0.04, lm_head_mode="recompute", check_ids=False)
    assert loss.options.beta == 0.04 and loss.lm_head_mode == "recompute" and not loss.check_ids
    assert FusedLinearGRPOLoss(in_place_backward=False).options == GRPOOptions()  # a falsy logits keyword is harmless
    with pytest.raises(ValueError, match="one_pass=True applies to GRPOLoss on logits"):
        FusedLinearGRPOLoss(one_pass=True)

    class Config:
        loss_type, beta, epsilon = "dapo", 0.02, 0.3

    fused = FusedLinearGRPOLoss.from_trl_config(Config(), lm_head_mode="three_products", backend="torch")
    assert fused.options.loss_type == "dapo" and fused.lm_head_mode == "three_products" and fused.backend == "torch"
    assert GRPOLoss.from_trl_config(Config(), one_pass=False).one_pass is False


def test_the_loss_type_registry_covers_every_loss_type():
    assert tuple(LOSS_TYPE_REGISTRY) == LOSS_TYPES
    for name, entry in LOSS_TYPE_REGISTRY.items():
        assert entry.name == name and entry.reduction in (
            "row_token_mean",
            "batch_token_mean",
            "constant",
            "token_count",
            "rows",
        )
        # TRL divides exactly the losses not normalized by a global token count by the accumulation steps
        assert entry.divided_by_accumulation == (entry.reduction != "token_count")
        in_torch = ("sequence_weight", *FAMILY_TERMS)
        assert entry.policy_term in ("ppo_clip", "capped_ratio", "soft_gate", *in_torch)
        # the kernels compute every term but vespo's sequence weight and the families' (their loss math runs in
        # torch on the kernels' log-probs)
        assert (entry.kernel_term is None) == (entry.policy_term in in_torch)
        options = GRPOOptions(loss_type=name, max_completion_length=8, dro_beta=0.1)
        assert options.loss_in_kernel == (entry.kernel_term is not None)
        assert options.loss is entry
        assert set(entry.levels) <= {"token", "sequence", "sequence_token"} and "token" in entry.levels


def _rank_dtensor_errors(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 3, 8, generator=g), torch.randn(16, 8, generator=g)
    ids, mask, adv = torch.randint(0, 16, (2, 3), generator=g), torch.ones(2, 3), torch.randn(2, generator=g)
    messages = []
    sharded_weight = distribute_tensor(weight, mesh, [Shard(0)])
    sharded_logits = distribute_tensor(hidden @ weight.T, mesh, [Shard(2)])
    for call in (
        lambda: fused_linear_grpo_loss(hidden, sharded_weight, ids, mask, adv),
        lambda: grpo_loss(sharded_logits, ids, mask, adv),
    ):
        try:
            call()
            messages.append(None)
        except TypeError as e:
            messages.append(str(e))
    return messages


def test_sharded_dtensor_inputs_are_named_in_a_clear_error():
    """An FSDP2 / tensor-parallel DTensor weight or logits never reaches the kernels or the torch ops (where it
    failed deep inside aten.mm or the launcher): the error names it and says what to pass instead."""
    from gloo_ranks import run_ranks

    ((weight_error, logits_error),) = run_ranks(_rank_dtensor_errors, 1, timeout=120)
    assert weight_error and "weight is a DTensor" in weight_error and "full_tensor()" in weight_error
    assert "vocab_parallel_group" in weight_error
    assert logits_error and "logits is a DTensor" in logits_error and "to_local()" in logits_error


@pytest.mark.parametrize(
    "options",
    [
        dict(beta=0.04, entropy_coef=0.1),
        dict(loss_type="dapo", delta=1.5),
        dict(importance_sampling_level="sequence", beta=0.04),
        dict(loss_type="sapo", kl_estimator="k2", beta=0.1),
    ],
)
def test_float64_on_the_torch_path_passes_gradcheck(options):
    """fp64 logits (and hidden states) run on the torch path in fp64, so torch.autograd.gradcheck applies;
    the Triton kernels refuse them by name. (Not for cispo and vespo: their coefficients are detached by
    definition, so their gradient is not the loss value's derivative.)"""
    g = torch.Generator().manual_seed(0)
    batch = make_batch_fp64(g)
    logits = batch.pop("logits").requires_grad_()
    assert torch.autograd.gradcheck(lambda x: grpo_loss(x, **batch, **options).loss, (logits,), eps=1e-6, atol=1e-6)
    hidden = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda h, w: fused_linear_grpo_loss(h, w, **batch, **options).loss, (hidden, weight), eps=1e-6, atol=1e-6
    )
    with pytest.raises(TypeError, match="float64 runs on backend='torch'"):
        grpo_loss(logits, **batch, backend="triton")


def make_batch_fp64(g):
    ids = torch.randint(0, 7, (2, 3), generator=g)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    lp = -torch.rand(2, 3, generator=g, dtype=torch.float64) - 1.5
    return dict(
        logits=torch.randn(2, 3, 7, generator=g, dtype=torch.float64),
        completion_ids=ids,
        completion_mask=mask,
        advantages=torch.randn(2, generator=g, dtype=torch.float64),
        old_logps=lp,
        ref_logps=lp + 0.1,
    )


@pytest.mark.parametrize("options", [dict(beta=0.04, entropy_coef=0.1), dict(importance_sampling_level="sequence")])
def test_torch_func_grad_on_the_torch_path(options):
    """The log-prob Functions use setup_context, so torch.func.grad of a loss on the torch path (where the loss
    math runs in torch on them) gives autograd's gradients, logits and fused lm_head; masked ids may be -100."""
    g = torch.Generator().manual_seed(1)
    batch = make_batch_fp64(g)
    logits = batch.pop("logits").float()
    batch = {k: (v.float() if v.dtype == torch.float64 else v) for k, v in batch.items()}
    ids = batch["completion_ids"].clone()
    ids[batch["completion_mask"] == 0] = -100
    batch["completion_ids"] = ids
    loss = lambda x: grpo_loss(x, **batch, **options).loss  # noqa: E731
    grad = torch.func.grad(loss)(logits)
    leaf = logits.clone().requires_grad_()
    loss(leaf).backward()
    torch.testing.assert_close(grad, leaf.grad, atol=1e-7, rtol=1e-6)
    hidden, weight = torch.randn(2, 3, 5, generator=g), torch.randn(7, 5, generator=g)
    head = lambda h, w: fused_linear_grpo_loss(h, w, **batch, **options).loss  # noqa: E731
    grads = torch.func.grad(head, argnums=(0, 1))(hidden, weight)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    head(h, w).backward()
    for expected, actual in zip((h.grad, w.grad), grads, strict=True):
        torch.testing.assert_close(actual, expected, atol=1e-7, rtol=1e-6)


def test_a_log_prob_pass_computes_no_entropy_unless_asked(monkeypatch):
    """The old and reference log-probs of every GRPO step (``token_logprobs``, ``selective_log_softmax``,
    ``linear_token_logprobs``, verl's patched ``logprobs_from_logits``) launch the forward kernel without the
    entropy (its output pointer None: the entropy's sums compiled out) and with the log-prob pass's own tuned
    configurations (kind "logprobs"); asking for the entropy turns both on. The kernels are recorded, not run."""
    import aot

    from grpo_kernels import validation
    from grpo_kernels.kernels import logits_launch

    assert validation.interpreter_enabled()  # asked (and cached) before the recorder stands in for the kernels
    kinds = []
    original = logits_launch.logits_launch_config
    monkeypatch.setattr(
        logits_launch,
        "logits_launch_config",
        lambda logits, override=None, kind="logits": (kinds.append(kind), original(logits, override, kind))[1],
    )
    hidden, weight, b, ids = _lm_head("cpu")
    logits = hidden @ weight.T + b

    def entropy_out(call):
        kinds.clear()
        with aot.recorded_launches() as launches:
            call()
        (item,) = [x for x in launches if x.kernel.fn.__name__ in ("grpo_forward_kernel", "linear_grpo_forward_kernel")]
        args = dict(zip(item.kernel.arg_names, item.args, strict=False), **item.kwargs)
        return args["entropy_out"] is not None, set(kinds)

    assert entropy_out(lambda: token_logprobs(logits, ids, backend="triton")) == (False, {"logprobs"})
    assert entropy_out(lambda: token_logprobs(logits, ids, return_entropy=True, backend="triton")) == (
        True,
        {"logprobs"},
    )
    assert entropy_out(lambda: selective_log_softmax(logits, ids, backend="triton")) == (False, {"logprobs"})
    assert entropy_out(lambda: linear_token_logprobs(hidden, weight, ids, b, backend="triton"))[0] is False
    assert (
        entropy_out(lambda: linear_token_logprobs(hidden, weight, ids, b, return_entropy=True, backend="triton"))[0]
        is True
    )
    # a loss launch keeps the loss's own configurations
    assert entropy_out(
        lambda: grpo_loss(
            logits, ids, torch.ones_like(ids, dtype=torch.float32), torch.ones(ids.shape[0]), backend="triton"
        )
    )[1] == {"logits"}

    pytest.importorskip("verl")
    from grpo_kernels import pipeline
    from grpo_kernels.integration import verl as verl_adapter

    asked, replacements = [], {}
    compute = pipeline.logprobs
    monkeypatch.setattr(
        pipeline,
        "logprobs",
        lambda source, ids, temperature, compute_entropy, settings: (
            asked.append(compute_entropy),
            compute(source, ids, temperature, compute_entropy, settings),
        )[1],
    )
    # what patch_logprobs would install, kept here rather than installed in every loaded module
    monkeypatch.setattr(verl_adapter, "replace_everywhere", lambda source, found: replacements.update(found))
    verl_adapter.patch_logprobs()
    replacements["logprobs_from_logits"](logits, ids)
    assert asked == [False]


def test_the_call_keywords_are_the_loss_calls_own():
    """``options.CALL_KEYWORDS`` (what an unknown option may have meant, ``GRPOOptions(backend=...)`` refused as a call
    keyword) is every keyword the loss functions and Modules take besides their tensors and the options: held to
    their signatures, so that it cannot drift (it lacked kept_set)."""
    from grpo_kernels import FusedLinearGRPOLoss, GRPOLoss, fused_linear_grpo_loss, grpo_loss
    from grpo_kernels.options import CALL_KEYWORDS

    tensors = {"logits", "hidden_states", "weight", "completion_ids", "completion_mask", "advantages", "old_logps",
               "ref_logps", "self", "option_kwargs"}  # fmt: skip
    fields = {f.name for f in dataclasses.fields(GRPOOptions)}
    taken = {
        name
        for call in (
            grpo_loss,
            fused_linear_grpo_loss,
            GRPOLoss.__init__,
            FusedLinearGRPOLoss.__init__,
            GRPOLoss.forward,
            FusedLinearGRPOLoss.forward,
        )  # fmt: skip
        for name in inspect.signature(call).parameters
    }
    assert set(CALL_KEYWORDS) == taken - tensors - fields
