"""Shared test helpers: input builders and a closeness check that prints its errors."""

import pytest
import torch

from grpo_kernels.options import LOSS_TYPE_REGISTRY, LOSS_TYPES, PPO_CLIP_LOSS_TYPES  # noqa: F401 (re-exported)

# The tests parametrize over the registry: a new loss type is tested everywhere by its entry alone.
# Those whose per-token terms run in the loss kernels (vespo's sequence weight runs in torch on their log-probs):
KERNEL_LOSS_TYPES = tuple(name for name, t in LOSS_TYPE_REGISTRY.items() if t.kernel_term is not None)
# TRL 1.16's loss types (tests/test_integration_tables.py holds this to TRL's GRPOConfig): what the tests of TRL's
# semantics draw from; the other trainers' families have tests/test_policy_terms.py and the adapters' tests
TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")

try:
    import triton
    from packaging.version import Version

    # read at import: tests/test_versions.py sets triton.__version__ to check the refusal itself
    _INTERPRETER_RUNS_SPLIT_ROW = torch.cuda.is_available() or Version(triton.__version__).release >= (3, 4)
except ImportError:
    _INTERPRETER_RUNS_SPLIT_ROW = True


def assert_close(name, expected, actual, *, atol, rtol):
    """torch.testing.assert_close with the max abs / rel error in the message."""
    expected, actual = expected.detach().float().cpu(), actual.detach().float().cpu()
    diff = (expected - actual).abs()
    rel = diff / expected.abs().clamp(min=1e-12)
    torch.testing.assert_close(
        actual,
        expected,
        atol=atol,
        rtol=rtol,
        msg=lambda m: f"{name}: max abs err {diff.max():.3e}, max rel err {rel.max():.3e}\n{m}",
    )


def make_batch(
    B=3,
    T=5,
    V=1003,
    *,
    dtype=torch.float32,
    device="cpu",
    seed=0,
    per_token_adv=False,
    off_policy=True,
    clip_spread=0.4,
    strided=False,
    temperature=1.0,
    prompts=None,
):
    """Inputs with a partly masked row, a fully masked row and ratios on both sides of the clip range; with
    ``prompts``, each row's prompt (``prompt_ids``: rows 0, 2, ... the first prompt, interleaved)."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(B, T + 1, V, generator=g) * 2.0
    logits = full[:, :-1] if strided else full[:, :T].contiguous()
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    if B > 1:
        mask[0, T // 2 + 1 :] = 0  # a partly masked row
    if B > 2:
        mask[-1] = 0  # a fully masked row
    true_lp = torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    old = true_lp + clip_spread * torch.randn(B, T, generator=g) if off_policy else None
    ref = true_lp + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn((B, T) if per_token_adv else (B,), generator=g)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    logits = logits.to(device=device, dtype=dtype) if not strided else full.to(device=device, dtype=dtype)[:, :-1]
    batch = dict(
        logits=logits,
        completion_ids=to(ids),
        completion_mask=to(mask),
        advantages=to(adv),
        old_logps=to(old),
        ref_logps=to(ref),
    )
    if prompts is not None:
        batch["prompt_ids"] = to(torch.arange(B) % prompts)
    return batch


# Option combinations every fast path is checked on (keys in BATCH_KEYS shape the batch).
OPTION_CASES = {
    "delta": dict(delta=1.3),
    "dual_clip": dict(dual_clip=3.0),
    "delta_and_dual_clip_per_token_adv": dict(delta=1.25, dual_clip=2.0, per_token_adv=True),
    "asymmetric_clip": dict(epsilon=0.1, epsilon_high=0.28),
    "kl_k1": dict(beta=0.1, kl_estimator="k1"),
    "kl_k2": dict(beta=0.1, kl_estimator="k2"),
    "kl_k3_clamped_verl": dict(beta=0.1, log_ratio_clamp=0.5, kl_clamp=0.02),
    "kl_k3_straight_through_clamped": dict(beta=0.1, kl_estimator="k3+", log_ratio_clamp=0.5, kl_clamp=0.02),
    "kl_k1_straight_through": dict(beta=0.1, kl_estimator="k1+"),
    "kl_k2_clamped": dict(beta=0.1, kl_estimator="k2", kl_clamp=0.01),
    "bias_corrected_kl": dict(beta=0.1, use_bias_correction_kl=True),
    "bias_corrected_kl_sequence": dict(beta=0.1, use_bias_correction_kl=True, importance_sampling_level="sequence"),
    "log_ratio_clamp": dict(log_ratio_clamp=0.3, clip_spread=1.0),
    "temperature": dict(temperature=0.7, beta=0.04),
    "sapo_temperatures": dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0),
    "cispo_per_token_adv": dict(loss_type="cispo", epsilon_high=1.05, per_token_adv=True, beta=0.04),
    # per-token advantages make the sequence level's clip flags per token: their metrics are token means (TRL)
    "sequence_level_per_token_adv": dict(importance_sampling_level="sequence", per_token_adv=True, beta=0.04),
    "cispo_sequence_per_token_adv": dict(
        loss_type="cispo", epsilon_high=1.05, importance_sampling_level="sequence", per_token_adv=True
    ),
    "no_entropy": dict(compute_entropy=False, beta=0.04),
    "strided_logits_view": dict(strided=True, beta=0.04),
    "strided_sequence_level": dict(strided=True, importance_sampling_level="sequence"),
    "one_token": dict(T=1, beta=0.04),
    "vocab_over_several_blocks": dict(V=4999, beta=0.04, temperature=1.3),
    "single_row": dict(B=1, T=7, loss_type="bnpo"),
    "gspo_token": dict(importance_sampling_level="sequence_token", beta=0.04, per_token_adv=True),
    "gspo_token_dapo": dict(importance_sampling_level="sequence_token", loss_type="dapo", log_ratio_clamp=0.2),
    "prompt_mean": dict(aggregation="prompt_mean", prompts=2, B=4, beta=0.04),
}
BATCH_KEYS = ("B", "T", "V", "per_token_adv", "clip_spread", "strided", "temperature", "prompts")


def check_lm_head_against_reference(hidden, weight, inputs, *, backend, lm_head_mode, options, fp64=False, tol=None):
    """fused_linear_grpo_loss against the reference on materialized logits (in fp64 with ``fp64``): the loss,
    d hidden, d weight and every metric (``tol``: assert_close's, fp32's by default)."""
    from grpo_kernels import fused_linear_grpo_loss, grpo_loss_reference

    tol = dict(atol=2e-6, rtol=1e-5) if tol is None else tol

    up = (lambda t: t.double()) if fp64 else (lambda t: t)
    h, w = up(hidden.clone()).requires_grad_(), up(weight.clone()).requires_grad_()
    ref_inputs = {k: (up(v) if v.is_floating_point() and k != "completion_mask" else v) for k, v in inputs.items()}
    expected = grpo_loss_reference(h @ w.T, **ref_inputs, **options)
    expected.loss.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fused_linear_grpo_loss(h2, w2, **inputs, backend=backend, lm_head_mode=lm_head_mode, **options)
    out.loss.backward()
    assert_close("loss", expected.loss, out.loss, **tol)
    assert_close("d hidden", h.grad, h2.grad, atol=1e-5, rtol=1e-5)
    assert_close("d weight", w.grad, w2.grad, atol=1e-5, rtol=1e-5)
    for name, value in expected.metrics.items():
        assert_close(name, value, out.metrics[name], **tol)


def split_row(chunks: int = 4, block_v=256):
    """Within the block the one-pass loss runs on the split-row kernel, each row over at most ``chunks`` programs
    (in the interpreter: its two launches, publish then merge), with blocks of ``block_v`` logits (None: the
    launcher's). The tests' small vocabularies need small blocks to have several: at V = 1003, 4 chunks of a
    256-logit block each, held in registers; at V = 4999, 4 chunks of 5 blocks, read again from L2."""
    from grpo_kernels.kernels import split_row_launch

    if not _INTERPRETER_RUNS_SPLIT_ROW:  # refused with a message there, which tests/test_versions.py checks
        pytest.skip("the split-row schedule's interpreter run needs triton >= 3.4 (here: the supported floor, 3.3)")
    return split_row_launch.split_row_schedule(chunks, block_v)


def megatron_output_layer(world: int, weight_shard, bias_shard=None, sequence_parallel: bool = False):
    """Megatron's own output layer on this rank (a ``ColumnParallelLinear`` of tensor-parallel size ``world``, its
    logits not gathered) holding ``weight_shard`` [V / TP, H] (and ``bias_shard``): the reference the Megatron tests
    hold our heads to. Megatron's parallel state must be initialized."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer import TransformerConfig

    part, hidden_size = weight_shard.shape
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden_size,
        num_attention_heads=world,
        tensor_model_parallel_size=world,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
    )
    head = tensor_parallel.ColumnParallelLinear(
        hidden_size,
        part * world,
        config=config,
        init_method=torch.nn.init.zeros_,
        bias=bias_shard is not None,
        gather_output=False,
    )
    with torch.no_grad():
        head.weight.copy_(weight_shard)
        if bias_shard is not None:
            head.bias.copy_(bias_shard)
    return head
