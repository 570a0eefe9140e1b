"""The front end as one family: the log-prob functions' shared keywords, the hidden-state log-probs, the
prepared inputs, the options' one documentation source and the Modules' composition."""

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch
from helpers import assert_close

from grpo_kernels import (FusedLinearGRPOLoss, GRPOLoss, GRPOOptions, fused_linear_grpo_loss, linear_token_logprobs,
                          selective_log_softmax, selective_log_softmax_and_entropy, token_entropy, token_logprobs)
from grpo_kernels.inputs import CallSettings, LossTensors, prepare_inputs
from grpo_kernels.option_docs import option_names, options_table, undocumented_fields
from grpo_kernels.options import LOSS_TYPE_REGISTRY, LOSS_TYPES
from grpo_kernels.sources import LogitsSource

BACKENDS = ["torch", "triton"]
TOL = dict(atol=2e-5, rtol=2e-5)
README = Path(__file__).resolve().parents[1] / "README.md"


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
    assert_close("log-probs alone", expected_lp, linear_token_logprobs(hidden, weight, ids, b, 0.8, backend=backend),
                 **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_token_logprobs_of_a_packed_batch(device, backend):
    hidden, weight, b, ids = _lm_head(device, B=1, T=11)
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32, device=device)  # an empty sequence too
    logits = hidden[0] @ weight.T + b
    expected = token_logprobs(logits, ids[0], return_entropy=True, backend=backend, cu_seqlens=cu)
    got = linear_token_logprobs(hidden[0], weight, ids[0], b, return_entropy=True, backend=backend, cu_seqlens=cu)
    for name, e, x in zip(("log-probs", "entropy"), expected, got):
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
    out = fused_linear_grpo_loss(hidden, weight, ids, mask, torch.randn(ids.shape[0], device=device), old, bias=b,
                                 backend=backend, lm_head_mode=lm_head_mode)
    assert_close("log-probs", old * mask, out.per_token_logps * mask, **TOL)
    assert float(out.metrics["clip_ratio/region_mean"]) == 0.0


def test_linear_token_logprobs_check_their_inputs(device):
    hidden, weight, b, ids = _lm_head(device)
    with pytest.raises(ValueError, match=r"completion_ids must lie in \[0, V\)"):
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
    shared = {"backend", "drop_last_position", "cu_seqlens", "vocab_parallel_group", "vocab_start_index",
              "check_ids", "in_place_backward"}
    exceptions = {token_logprobs: {"in_place_backward"}, linear_token_logprobs: {"in_place_backward",
                                                                                "drop_last_position"},
                  token_entropy: {"check_ids", "cu_seqlens"}}
    for fn in (token_logprobs, linear_token_logprobs, selective_log_softmax, token_entropy,
               selective_log_softmax_and_entropy):
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
    with pytest.raises(ValueError, match=r"completion_ids must lie in \[0, V\)"):
        selective_log_softmax(full[:, :-1], ids + 41, backend=backend)
    packed = selective_log_softmax(full[0], torch.randint(0, 41, (5,)).to(device), backend=backend,
                                   cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32, device=device))
    assert packed.shape == (5,)


def test_prepared_inputs_are_frozen_and_packed_once(device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 13, generator=g).to(device)
    ids = torch.randint(0, 13, (7,), generator=g).to(device)
    tensors = LossTensors(ids, torch.ones(7, device=device), torch.randn(2, generator=g).to(device))
    cu = torch.tensor([0, 3, 7], device=device)
    source, inputs = prepare_inputs(LogitsSource(logits), tensors, CallSettings(GRPOOptions(), backend="torch",
                                                                                  cu_seqlens=cu))
    assert source.logits.shape == (1, 7, 13) and inputs.ids.shape == (1, 7) and inputs.caller_shape == (7,)
    assert inputs.layout.packed and inputs.mask_seq.shape == (2, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        inputs.ids = ids


def test_the_options_table_the_docstrings_and_the_options_agree():
    """One source: the README's table is options_table(), it lists every option, and both Modules' docstrings
    name every option and their own keywords."""
    assert undocumented_fields() == ()
    assert options_table() in README.read_text(), "the README's options table is option_docs.options_table()"
    for module, own in ((GRPOLoss, ("one_pass", "drop_last_position", "in_place_backward")),
                        (FusedLinearGRPOLoss, ("check_ids",))):
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
        assert entry.name == name and entry.reduction in ("row_token_mean", "batch_token_mean", "constant",
                                                          "token_count", "rows")
        # TRL divides exactly the losses not normalized by a global token count by the accumulation steps
        assert entry.divided_by_accumulation == (entry.reduction != "token_count")
        assert GRPOOptions(loss_type=name, max_completion_length=8).loss is entry
