"""The fused lm_head inside the stacks people train with: a wrapped model's forward (DDP, FSDP2) and an adapter
on the head (PEFT LoRA). Every fused result is checked against the same model's logits path."""

from __future__ import annotations

import pytest
import torch
from gloo_ranks import run_ranks

from grpo_kernels import fused_linear_grpo_loss, grpo_loss
from grpo_kernels.training.tasks import compare
from grpo_kernels.wrapped import inside_forward, output_layer, unwrapped_model, zero3_gloo_hazard

B, P, T = 4, 5, 6


def _model(seed=1, tie=True):
    tokenizer = compare.build_tokenizer()
    model = compare.build_model(tokenizer, hidden_size=32, seed=seed)
    if not tie:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    return model


def _batch(vocab: int, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (B, P + T), generator=g)
    attention_mask = torch.ones(B, P + T, dtype=torch.long)
    completion_mask = (torch.arange(T)[None] < torch.tensor([6, 2, 4, 1])[:, None]).float()
    return dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_ids=input_ids[:, P:],
        completion_mask=completion_mask,
        advantages=torch.randn(B, generator=g),
        old_logps=-3 + 0.3 * torch.randn(B, T, generator=g),
        ref_logps=-3 + 0.3 * torch.randn(B, T, generator=g),
    )


LOSS = dict(beta=0.04, loss_type="grpo")


def _logits_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, P - 1 : -1]
    return grpo_loss(
        logits,
        batch["completion_ids"],
        batch["completion_mask"],
        batch["advantages"],
        old_logps=batch["old_logps"],
        ref_logps=batch["ref_logps"],
        **LOSS,
    ).loss


def _fused_loss_in_forward(model, batch):
    """The fused loss as the model's forward, through the model's own call (what the adapters do)."""
    inner = unwrapped_model(model)

    def loss_in_forward(input_ids, attention_mask):
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, P - 1 : -1]
        weight, bias = output_layer(base.get_output_embeddings())
        out = fused_linear_grpo_loss(
            hidden,
            weight,
            batch["completion_ids"],
            batch["completion_mask"],
            batch["advantages"],
            bias=bias,
            old_logps=batch["old_logps"],
            ref_logps=batch["ref_logps"],
            **LOSS,
        )
        return out.loss, out

    loss, _ = inside_forward(model, loss_in_forward, batch["input_ids"], batch["attention_mask"], inner=inner)
    return loss


# ----- inside_forward -------------------------------------------------------------------------------------


def test_inside_forward_runs_the_wrappers_hooks_and_restores_the_forward():
    model = torch.nn.Linear(3, 3)
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append("pre"))
    model.register_forward_hook(lambda module, args, output: seen.append("post"))
    result = inside_forward(model, lambda x: ("ran", x), 7)
    assert result == ("ran", 7) and seen == ["pre", "post"]
    assert "forward" not in model.__dict__  # the class's forward again
    x = torch.randn(2, 3)
    torch.testing.assert_close(model(x), x @ model.weight.T + model.bias)

    def failing(_):
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        inside_forward(model, failing, 1)
    assert "forward" not in model.__dict__


def test_inside_forward_keeps_an_instance_forward_and_lets_fn_call_it():
    """accelerate sets an instance forward (its autocast wrapper): it is restored, and callable from fn."""
    model = torch.nn.Linear(3, 3)
    custom = lambda x: "custom"  # noqa: E731
    model.forward = custom
    assert inside_forward(model, lambda x: model(x) + "+fn", 0) == "custom+fn"
    assert model.__dict__["forward"] is custom


def test_inside_forward_goes_through_a_ddp_wrapper():
    """A 1-rank DDP wrapper (gloo): the wrapped model's own attributes are reached inside its forward."""
    run_ranks(_ddp_one_rank, 1)


def _ddp_one_rank(rank, world):
    model = _model()
    batch = _batch(model.config.vocab_size)
    expected = _logits_loss(model, batch)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    with pytest.raises(AttributeError, match="get_decoder"):
        ddp.get_decoder()  # what the TRL adapter called before
    loss = _fused_loss_in_forward(ddp, batch)
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5)
    loss.backward()
    return True


# ----- FSDP2 -----------------------------------------------------------------------------------------------


def _fsdp2_rank(rank, world, tie):
    from torch.distributed.fsdp import fully_shard

    reference, sharded = _model(tie=tie), _model(tie=tie)
    batch = _batch(reference.config.vocab_size)  # the same batch on every rank: the mean gradient is the batch's
    expected = _logits_loss(reference, batch)
    expected.backward()
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    loss = _fused_loss_in_forward(sharded, batch)
    loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters() if p.grad is not None}
    expected_grads = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    return loss.detach(), expected.detach(), grads, expected_grads


@pytest.mark.parametrize("tie", [True, False])
def test_fused_lm_head_under_fsdp2_matches_an_unsharded_run(tie):
    """fully_shard on every decoder layer and the root, 2 gloo ranks: the fused loss run inside the root's
    forward sees the all-gathered embedding and head, and gives the unsharded logits path's loss and
    gradients (tied and untied heads)."""
    for loss, expected, grads, expected_grads in run_ranks(_fsdp2_rank, 2, tie):
        torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5)
        assert grads.keys() == expected_grads.keys() and grads
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], atol=1e-6, rtol=1e-4, msg=name)


def _fsdp2_bare_call_rank(rank, world):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    batch = _batch(model.config.vocab_size)
    hidden = torch.randn(B, T, 32)
    try:
        fused_linear_grpo_loss(
            hidden, model.lm_head.weight, batch["completion_ids"], batch["completion_mask"], batch["advantages"]
        )
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def test_a_sharded_head_weight_outside_the_forward_is_named():
    """Outside the root's forward the head's weight is a DTensor shard: refused by name, with what to do."""
    (message, _) = run_ranks(_fsdp2_bare_call_rank, 2)
    assert message is not None and "DTensor" in message and "weight" in message


# ----- PEFT on the head --------------------------------------------------------------------------------------


def _lora_model(target_modules, dropout=0.0, use_dora=False, tie=False):
    peft = pytest.importorskip("peft", reason="the peft extra is not installed (pip install 'grpo-kernels[peft]')")
    model = _model(tie=tie)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, lora_dropout=dropout, use_dora=use_dora)
    wrapped = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(3)
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:  # LoRA starts B at zero, where any head would match: give it a value
            with torch.no_grad():
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return wrapped


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("targets", [["lm_head"], ["lm_head", "q_proj", "v_proj"]])
def test_a_lora_adapter_on_the_head_is_folded_in(targets):
    model = _lora_model(targets)
    model.train()
    batch = _batch(model.config.vocab_size)
    expected = _logits_loss(model, batch)
    expected.backward()
    expected_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    loss = _fused_loss_in_forward(model, batch)
    loss.backward()
    grads = _grads(model)
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5)
    assert any("lm_head.lora_A" in name for name in grads) and any("lm_head.lora_B" in name for name in grads)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    # the base weight alone (what head.weight reads) gives another loss: the adapter matters here
    head = model.get_base_model().lm_head
    assert not torch.allclose(output_layer(head)[0], head.weight)


def test_modules_to_save_on_the_head_reads_the_trained_copy():
    """PEFT's modules_to_save=["lm_head"] (a trained copy of the head, LoRA elsewhere): the fused loss reads the
    active copy, as the forward does; disabled adapters read the original head."""
    peft = pytest.importorskip("peft", reason="the peft extra is not installed (pip install 'grpo-kernels[peft]')")
    model = peft.get_peft_model(
        _model(tie=False), peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    )
    head = model.get_base_model().lm_head
    copy = head.modules_to_save["default"]
    with torch.no_grad():
        copy.weight.add_(0.5)  # the trained copy differs from the original
    batch = _batch(model.config.vocab_size)
    expected = _logits_loss(model, batch)
    expected.backward()
    expected_grad = copy.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    loss = _fused_loss_in_forward(model, batch)
    loss.backward()
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(copy.weight.grad, expected_grad, atol=1e-6, rtol=1e-4)
    assert output_layer(head)[0] is copy.weight
    with model.disable_adapter():
        assert output_layer(head)[0] is head.original_module.weight


def test_a_merged_or_disabled_head_adapter_reads_the_base_weight():
    model = _lora_model(["lm_head"])
    head = model.get_base_model().lm_head
    with model.disable_adapter():
        assert output_layer(head)[0] is head.base_layer.weight
    model.merge_adapter()
    assert output_layer(head)[0] is head.base_layer.weight  # merged: the base weight is the effective one


def test_head_adapters_a_weight_cannot_express_are_refused():
    model = _lora_model(["lm_head"], dropout=0.1)
    model.train()
    with pytest.raises(ValueError, match="lora_dropout=0.1"):
        output_layer(model.get_base_model().lm_head)
    model.eval()  # dropout is the identity in eval: folded in
    output_layer(model.get_base_model().lm_head)
    dora = _lora_model(["lm_head"], use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        output_layer(dora.get_base_model().lm_head)


def test_zero3_over_gloo_without_sequential_gathers_is_named():
    """ZeRO-3 over gloo with DeepSpeed's default (stage3_allgather_sequential off) is the configuration whose gathers
    of several parameters read some early (tests/test_deepspeed.py counts them); every other one says nothing."""
    zero3 = {"zero_optimization": {"stage": 3}}
    message = zero3_gloo_hazard(zero3, "gloo")
    assert "stage3_allgather_sequential" in message
    assert zero3_gloo_hazard({"zero_optimization": {"stage": 3, "stage3_allgather_sequential": True}}, "gloo") is None
    assert zero3_gloo_hazard(zero3, "nccl") is None
    assert zero3_gloo_hazard({"zero_optimization": {"stage": 2}}, "gloo") is None
    assert zero3_gloo_hazard(None, "gloo") is None
