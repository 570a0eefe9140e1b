"""SFT, RFT and DPO (``grpo_kernels.methods``) on the GRPO entry points' input path, against the specification
(``reference.py``'s ``*_loss_reference``, written a row at a time): padded and packed, from logits and from hidden
states with the lm_head, a vocabulary shard on two processes, torch.compile (fullgraph), both backends; the loss, the
metrics and every gradient. Then the reward-model loss."""

import os

import pytest
import torch
from helpers import assert_close, make_batch

from grpo_kernels import methods
from grpo_kernels.reference import (
    dpo_loss_reference,
    rft_loss_reference,
    sft_loss_reference,
    token_logprobs_and_entropy,
)

BACKENDS = ["torch", "triton"]
TOL = dict(atol=1e-6, rtol=1e-5)
METHODS = ("sft", "rft", "dpo")


def _grad(fn, logits, *args, **kwargs):
    leaf = logits.detach().clone().requires_grad_()
    out = fn(leaf, *args, **kwargs)
    out.loss.backward()
    return out, leaf.grad


def _method_batch(device, seed=3, B=4, T=5, V=211):
    """A batch of B = 2 pairs (DPO's chosen rows, then rejected rows) with a partly masked row and padding ids of
    -100 at masked positions; the RFT rewards and the DPO reference log-probs."""
    b = make_batch(B=B, T=T, V=V, device=device, seed=seed)
    b["completion_mask"][-1] = 1.0  # make_batch masks its last row fully; keep every pair scored
    b["completion_mask"][1, -2:] = 0.0
    b["completion_ids"] = torch.where(b["completion_mask"] != 0, b["completion_ids"], -100)
    b["rewards"] = torch.tensor([1.0, 0.0, 1.0, 1.0], device=device)[:B]
    b["ref_logps"] = torch.where(b["completion_mask"] != 0, b["ref_logps"], float("nan"))  # never read there
    return b


def _call(method, fn_or_reference, first, b, **kwargs):
    """The method's loss on ``first`` (logits or hidden states), its other inputs from the batch."""
    args = (first, b["completion_ids"], b["completion_mask"])
    if method == "rft":
        args += (b["rewards"],)
    elif method == "dpo":
        args += (b["ref_logps"],)
        kwargs.setdefault("beta", 0.5)
    return fn_or_reference(*args, **kwargs)


IMPLEMENTATION = {"sft": methods.sft_loss, "rft": methods.rft_loss, "dpo": methods.dpo_loss}
SPECIFICATION = {"sft": sft_loss_reference, "rft": rft_loss_reference, "dpo": dpo_loss_reference}


def _compare(method, expected, expected_grad, out, grad, tol=TOL):
    assert_close("loss", expected.loss, out.loss, **tol)
    assert expected.metrics.keys() == out.metrics.keys()
    for name in expected.metrics:
        assert_close(name, expected.metrics[name], out.metrics[name], **tol)
    assert_close("dlogits", expected_grad, grad, **tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("strided", [False, True])
def test_each_method_matches_its_specification(device, backend, method, strided):
    b = _method_batch(device)
    if strided:  # a model's [B, T + 1, V] output, read in place
        b["logits"] = torch.cat([b["logits"], b["logits"][:, -1:]], 1)[:, :-1]
    spec = lambda x, *a, **k: _call(method, SPECIFICATION[method], x, b, temperature=0.8, **k)  # noqa: E731
    impl = lambda x, *a, **k: _call(method, IMPLEMENTATION[method], x, b, temperature=0.8, backend=backend)  # noqa: E731
    (expected, expected_grad), (out, grad) = _grad(spec, b["logits"]), _grad(impl, b["logits"])
    _compare(method, expected, expected_grad, out, grad)
    lp, _ = token_logprobs_and_entropy(b["logits"], b["completion_ids"].clamp(min=0), 0.8)
    assert_close("per-token log-probs", lp * b["completion_mask"], out.per_token_logps, **TOL)
    if method == "rft":
        assert torch.count_nonzero(grad[1]) == 0  # GC = 0: an incorrect completion teaches nothing


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
def test_packed_equals_padded_and_drop_last_position_the_sliced_view(device, backend, method):
    """A packed batch (cu_seqlens, its S sequences the rows) gives the padded batch's loss, metrics and gradient;
    a model's [B, T + 1, V] output with drop_last_position the sliced view's."""
    b = _method_batch(device, seed=5)
    mask = b["completion_mask"]
    lengths = mask.sum(-1).long()  # each row's active tokens first: the sequences the padded rows hold
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0).cpu()]).to(device)
    active = mask != 0
    packed = dict(
        completion_ids=b["completion_ids"][active],
        completion_mask=mask[active],
        rewards=b["rewards"],
        ref_logps=b["ref_logps"][active],
    )
    padded = lambda x: _call(method, IMPLEMENTATION[method], x, b, backend=backend)  # noqa: E731
    (expected, expected_grad) = _grad(padded, b["logits"])
    logits_packed = b["logits"][active].detach().clone().requires_grad_()
    out = _call(method, IMPLEMENTATION[method], logits_packed, packed, backend=backend, cu_seqlens=cu)
    out.loss.backward()
    _compare(method, expected, expected_grad[active], out, logits_packed.grad)
    assert out.per_token_logps.shape == (int(lengths.sum()),)

    whole = torch.cat([b["logits"], torch.randn_like(b["logits"][:, :1])], 1)  # the model's last position
    dropped = lambda x: _call(method, IMPLEMENTATION[method], x, b, backend=backend, drop_last_position=True)  # noqa: E731
    out, grad = _grad(dropped, whole)
    _compare(method, expected, expected_grad, out, grad[:, :-1])
    assert torch.count_nonzero(grad[:, -1]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
def test_from_hidden_states_with_the_lm_head(device, backend, method):
    """With ``weight`` (and ``bias``) the first argument is the hidden states: the loss and the gradients of the
    hidden states, the weight and the bias are the specification's on the materialized logits h W^T + b."""
    b = _method_batch(device, seed=7)
    g = torch.Generator().manual_seed(7)
    B, T = b["completion_ids"].shape
    H, V = 24, b["logits"].shape[-1]
    hidden = torch.randn(B, T, H, generator=g).to(device).requires_grad_()
    weight = (0.2 * torch.randn(V, H, generator=g)).to(device).requires_grad_()
    bias = (0.1 * torch.randn(V, generator=g)).to(device).requires_grad_()
    expected = _call(method, SPECIFICATION[method], hidden @ weight.T + bias, b, temperature=0.9)
    expected_grads = torch.autograd.grad(expected.loss, (hidden, weight, bias))
    out = _call(method, IMPLEMENTATION[method], hidden, b, temperature=0.9, backend=backend, weight=weight, bias=bias)
    grads = torch.autograd.grad(out.loss, (hidden, weight, bias))
    assert_close("loss", expected.loss, out.loss, **TOL)
    for name, e, a in zip(("d hidden", "d weight", "d bias"), expected_grads, grads, strict=True):
        assert_close(name, e, a, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="drop_last_position=True applies to logits"):
        _call(method, IMPLEMENTATION[method], hidden, b, weight=weight, drop_last_position=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_under_torch_compile_fullgraph(device, backend):
    """Each method in a fullgraph torch.compile step (inductor) equals eager: the loss and dlogits."""
    if backend == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors run the Triton path only in its interpreter (TRITON_INTERPRET=1)")
    torch._dynamo.reset()
    b = _method_batch(device, seed=11)
    for method in METHODS:

        def step(x, method=method):
            out = _call(method, IMPLEMENTATION[method], x, b, backend=backend)
            return out.loss * 1.5

        results = []
        for fn in (step, torch.compile(step, fullgraph=True)):
            x = b["logits"].detach().clone().requires_grad_()
            loss = fn(x)
            loss.backward()
            results.append((loss.detach(), x.grad))
        assert_close(f"{method} loss", results[0][0], results[1][0], **TOL)
        assert_close(f"{method} dlogits", results[0][1], results[1][1], **TOL)


def _vocab_parallel_methods(rank, world, device_name, backend, logits, hidden, weight, batch):
    """Each method on this rank's vocabulary slice, of the logits and of the lm_head weight: the loss and this rank's
    slice of the gradient (the hidden states' whole)."""
    V = logits.shape[-1]
    lo, hi = rank * V // world, (rank + 1) * V // world
    group = torch.distributed.group.WORLD
    found = {}
    for method in METHODS:
        shard = logits[..., lo:hi].clone().requires_grad_()
        out = _call(method, IMPLEMENTATION[method], shard, batch, backend=backend, vocab_parallel_group=group)
        out.loss.backward()
        h, w = hidden.clone().requires_grad_(), weight[lo:hi].clone().requires_grad_()
        linear = _call(method, IMPLEMENTATION[method], h, batch, backend=backend, weight=w, vocab_parallel_group=group)
        linear.loss.backward()
        found[method] = (out.loss.item(), shard.grad, linear.loss.item(), h.grad, w.grad)
    return found


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_vocabulary_split_over_two_processes_equals_one(backend):
    """Two gloo processes each holding half the vocabulary (logits [B, T, V / 2], or the weight's rows): the loss of
    one process on the whole, on each rank; each rank's gradient its slice of the whole one (the hidden states'
    whole)."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors run the Triton path only in its interpreter (TRITON_INTERPRET=1)")
    from gloo_ranks import run_ranks

    b = _method_batch("cpu", seed=13, V=64)
    g = torch.Generator().manual_seed(13)
    hidden, weight = torch.randn(4, 5, 16, generator=g), 0.3 * torch.randn(64, 16, generator=g)
    batch = {k: v for k, v in b.items() if k != "logits"}
    ranks = run_ranks(_vocab_parallel_methods, 2, "cpu", backend, b["logits"], hidden, weight, batch)
    for method in METHODS:
        out, grad = _grad(lambda x, m=method: _call(m, IMPLEMENTATION[m], x, batch, backend=backend), b["logits"])
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        linear = _call(method, IMPLEMENTATION[method], h, batch, backend=backend, weight=w)
        linear.loss.backward()
        for rank, found in enumerate(ranks):
            loss, shard_grad, linear_loss, h_grad, w_grad = found[method]
            lo, hi = rank * 32, (rank + 1) * 32
            assert loss == pytest.approx(out.loss.item(), rel=1e-6, abs=1e-7)
            assert_close(f"{method} dlogits slice", grad[..., lo:hi], shard_grad, **TOL)
            assert linear_loss == pytest.approx(linear.loss.item(), rel=1e-6, abs=1e-7)
            assert_close(f"{method} d hidden", h.grad, h_grad, atol=1e-5, rtol=1e-5)
            assert_close(f"{method} d weight slice", w.grad[lo:hi], w_grad, atol=1e-5, rtol=1e-5)


def test_bad_input_is_named(device):
    b = _method_batch(device)
    args = (b["logits"], b["completion_ids"], b["completion_mask"])
    with pytest.raises(ValueError, match="rewards must be \\[B\\] of 0 / 1"):
        methods.rft_loss(*args, torch.tensor([1.0, 0.5, 0.0, 1.0], device=device))
    with pytest.raises(ValueError, match="one a sequence \\(S = 4\\)"):
        methods.rft_loss(*args, torch.ones(3, device=device))
    odd = make_batch(B=3, device=device)
    with pytest.raises(ValueError, match=r"dpo_loss needs logits \[2B, T, V\]"):
        methods.dpo_loss(odd["logits"], odd["completion_ids"], odd["completion_mask"], odd["ref_logps"])
    with pytest.raises(ValueError, match="beta must be a positive number"):
        methods.dpo_loss(*args, b["ref_logps"], beta=0)
    with pytest.raises(ValueError, match="completion_ids must lie in \\[0, V\\)"):
        methods.sft_loss(b["logits"], b["completion_ids"].clamp(min=0) + 1000, b["completion_mask"])
    with pytest.raises(ValueError, match="the first argument must be logits \\[B, T, V\\]"):
        methods.sft_loss(b["logits"][0], b["completion_ids"][0], b["completion_mask"][0])


def test_reward_model_loss_is_bradley_terry_and_stable():
    g = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(16, generator=g), torch.randn(16, generator=g)
    expected = -torch.log(torch.sigmoid(chosen - rejected)).mean()
    assert_close("plain formula", expected, methods.reward_model_loss(chosen, rejected), atol=1e-6, rtol=1e-6)
    margin = torch.full((16,), 0.5)
    expected_margin = -torch.log(torch.sigmoid(chosen - rejected - margin)).mean()
    assert_close("margin", expected_margin, methods.reward_model_loss(chosen, rejected, margin), atol=1e-6, rtol=1e-6)
    big = torch.tensor([1e4])
    assert methods.reward_model_loss(big, -big).item() == 0.0
    assert methods.reward_model_loss(-big, big).item() == pytest.approx(2e4)
    r = torch.tensor([5e3], requires_grad=True)
    methods.reward_model_loss(-r, r).backward()
    assert torch.isfinite(r.grad).all() and r.grad.item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="same shape"):
        methods.reward_model_loss(torch.zeros(2), torch.zeros(3))


def _tiny_reward_model(tokenizer):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    return LlamaForSequenceClassification(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            num_labels=1,
            pad_token_id=tokenizer.pad_token_id,
        )
    )


@pytest.mark.parametrize("with_margin", [False, True])
def test_the_centering_term_is_trls_reward_trainers(tmp_path, with_margin):
    """center_rewards_coefficient is TRL's RewardConfig option: the loss is TRL RewardTrainer.compute_loss's."""
    pytest.importorskip("trl", reason="the trl extra is not installed")
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    from grpo_kernels.training.tasks import compare

    tokenizer = compare.build_tokenizer()
    trainer = RewardTrainer(
        model=_tiny_reward_model(tokenizer),
        processing_class=tokenizer,
        args=RewardConfig(output_dir=str(tmp_path), center_rewards_coefficient=0.01, report_to=[], use_cpu=True),
        train_dataset=Dataset.from_list([{"chosen": "9.9", "rejected": "9.11"}]),
    )
    g = torch.Generator().manual_seed(0)
    chosen, rejected = 3.0 + torch.randn(8, generator=g), 2.0 + torch.randn(8, generator=g)
    margin = torch.rand(8, generator=g) if with_margin else None

    class Scores(torch.nn.Module):  # stands for the model: TRL chunks the logits into chosen, rejected
        def forward(self, **_):
            return type("Out", (), {"logits": torch.cat([chosen, rejected])[:, None]})()

    inputs = {
        "input_ids": torch.ones(16, 2, dtype=torch.long),
        "attention_mask": torch.ones(16, 2, dtype=torch.long),
        **({"margin": margin} if with_margin else {}),
    }
    expected = trainer.compute_loss(Scores(), inputs)
    got = methods.reward_model_loss(chosen, rejected, margin, center_rewards_coefficient=0.01)
    assert_close("TRL's reward loss", expected, got, atol=1e-6, rtol=1e-6)
    assert got > methods.reward_model_loss(chosen, rejected, margin)  # the term is there
    with pytest.raises(ValueError, match="center_rewards_coefficient must be >= 0 or None, got -0.1"):
        methods.reward_model_loss(chosen, rejected, center_rewards_coefficient=-0.1)


def test_the_reward_models_training_centers_its_scores(monkeypatch):
    """train_reward_model passes its center_rewards_coefficient (default 0.01) to the loss."""
    from grpo_kernels.training import reward_model
    from grpo_kernels.training.tasks import compare

    seen = []
    loss = methods.reward_model_loss

    def spy(chosen, rejected, margin=None, center_rewards_coefficient=None):
        seen.append(center_rewards_coefficient)
        return loss(chosen, rejected, margin, center_rewards_coefficient)

    monkeypatch.setattr(reward_model, "reward_model_loss", spy)
    tokenizer = compare.build_tokenizer()
    model = _tiny_reward_model(tokenizer)
    pairs = [{"prompt": "Which is bigger? 9.11 or 9.9 \nAnswer: ", "chosen": "9.9", "rejected": "9.11"}]
    reward_model.train_reward_model(model, tokenizer, pairs, steps=1, batch_size=2)
    reward_model.train_reward_model(model, tokenizer, pairs, steps=1, batch_size=2, center_rewards_coefficient=None)
    assert seen == [0.01, None]


def test_reward_model_learns_preferences_and_scores_completions():
    import importlib.util
    import pathlib

    from grpo_kernels.training.reward_model import RewardModelReward, train_reward_model
    from grpo_kernels.training.tasks import compare

    spec = importlib.util.spec_from_file_location(
        "reward_model_grpo", pathlib.Path(__file__).parents[1] / "examples" / "reward_model_grpo.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tokenizer = compare.build_tokenizer()
    model = example.build_reward_model(tokenizer, seed=0)
    pairs = example.pairs(compare.make_rows(2000, held_out=False, seed=0))
    losses = train_reward_model(model, tokenizer, pairs, steps=40, batch_size=32)
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10  # the Bradley-Terry loss goes down
    scores = RewardModelReward(model, tokenizer)(["Which is bigger? 9.11 or 9.9 \nAnswer: "] * 2, ["9.9", "9.11"])
    assert len(scores) == 2 and all(0.0 < s < 1.0 for s in scores)
