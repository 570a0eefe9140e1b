"""The fused lm_head on the model families people train, each from a tiny random config of the installed
transformers: exact, or refused by name.

Every causal-LM family that ``scripts/survey_head_transforms.py`` finds transforming its head's output (a
soft-cap, a scale, both), and families that do not (Llama, Qwen2/3, Mistral, Phi-3, OLMo-2, SmolLM3, an MoE
model): the TRL adapter's default (the fused lm_head) against stock TRL's ``GRPOTrainer`` on one batch (loss and
every parameter's gradient, gradient checkpointing on and off), ``linear_token_logprobs`` against the model's
own log-probs, the thin trainer's fused lm_head against its logits path. The transforms are set far from the
released values (a cap of 1.5, scales of 0.4 to 3) and the weights drawn large (std 0.2), so that a transform
left out moves the loss far beyond the tolerance: the probe is checked to refuse each family with its
transform removed.
"""

import warnings

import pytest
import torch

from grpo_kernels import heads, linear_token_logprobs
from grpo_kernels.training.tasks import compare

TOKENIZER = compare.build_tokenizer()
COMMON = dict(vocab_size=len(TOKENIZER), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
              initializer_range=0.2, pad_token_id=TOKENIZER.pad_token_id, bos_token_id=TOKENIZER.bos_token_id,
              eos_token_id=TOKENIZER.eos_token_id)
MOE = dict(output_router_logits=False, router_aux_loss_coef=0.02)
# model_type: (config fields, the transform head_transform must read: (scale, softcap))
TRANSFORMING = {
    "gemma2": (dict(final_logit_softcapping=1.5), (1.0, 1.5)),
    "gemma3_text": (dict(final_logit_softcapping=1.5), (1.0, 1.5)),
    "gemma4_text": (dict(final_logit_softcapping=1.5), (1.0, 1.5)),
    "vaultgemma": (dict(final_logit_softcapping=1.5), (1.0, 1.5)),
    "nanochat": (dict(final_logit_softcapping=1.5), (1.0, 1.5)),
    "recurrent_gemma": (dict(logits_soft_cap=1.5), (1.0, 1.5)),
    "cohere": (dict(logit_scale=3.0), (3.0, None)),
    "cohere2": (dict(logit_scale=3.0), (3.0, None)),
    "granite": (dict(logits_scaling=0.4), (2.5, None)),
    # no router loss: stock TRL 1.16's fused head reads config.num_experts, which GraniteMoE names num_local_experts
    "granitemoe": (dict(logits_scaling=0.4, num_local_experts=2, num_experts_per_tok=1, router_aux_loss_coef=0.0),
                   (2.5, None)),
    "falcon_h1": (dict(lm_head_multiplier=3.0), (3.0, None)),
    "hyperclovax": (dict(logits_scaling=3.0), (3.0, None)),  # HyperCLOVA X multiplies where Granite divides
}
PLAIN = {
    "llama": {}, "qwen2": {}, "qwen3": {}, "mistral": {}, "phi3": {}, "olmo2": {}, "smollm3": {}, "gemma": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **MOE),
}
FAMILIES = {**{name: fields for name, (fields, _) in TRANSFORMING.items()}, **PLAIN}


def tiny_model(model_type: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **COMMON, **FAMILIES[model_type])
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reference-kernel fallbacks, sliding-window notices
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", TRANSFORMING)
def test_the_head_transform_is_read_from_the_config(model_type):
    transform = heads.head_transform(tiny_model(model_type))
    scale, softcap = TRANSFORMING[model_type][1]
    assert transform.scale == pytest.approx(scale) and transform.softcap == softcap
    assert heads.fused_head(tiny_model(model_type)) == transform  # the probe agrees


@pytest.mark.parametrize("model_type", TRANSFORMING)
def test_the_probe_refuses_a_transform_left_out(model_type):
    """The probe's own check, with the transform read wrong: a family nobody listed is refused the same way."""
    model = tiny_model(model_type)
    reason = heads.probe_difference(model, heads.HeadTransform())
    assert reason is not None and "differ by" in reason


def test_a_model_whose_forward_transforms_its_logits_unlisted_is_refused_by_name():
    """A Llama whose forward adds a bias no config field names: the fused lm_head refuses it, naming the class
    and the way out; the TRL adapter then takes the logits path (with a warning), or raises if asked for it."""
    from transformers import LlamaForCausalLM

    class ShiftedLlamaForCausalLM(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits + torch.linspace(0, 1, out.logits.shape[-1])
            return out

    model = ShiftedLlamaForCausalLM(tiny_model("llama").config)
    with pytest.raises(heads.FusedHeadError, match=r"ShiftedLlamaForCausalLM.*fused_lm_head=False"):
        heads.fused_head(model)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_linear_token_logprobs_are_the_models_own(model_type):
    """Old and reference log-probs from hidden states (a fused lm_head user's) equal the model's forward's."""
    model = tiny_model(model_type).eval()
    transform = heads.fused_head(model)
    ids = torch.randint(3, len(TOKENIZER), (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1].float() / 0.9, -1)
        expected = expected.gather(-1, ids[:, 1:, None])[..., 0]
        hidden = heads.last_hidden_states(model, ids).last_hidden_state[:, :-1]
        weight, bias = heads.head_weights(model, transform)
        got = linear_token_logprobs(hidden, weight, ids[:, 1:], bias, 0.9, backend="torch", **transform.options)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# ---- the TRL adapter against stock TRL, family by family --------------------------------------------------------

@pytest.fixture(scope="module")
def dataset():
    Dataset = pytest.importorskip("datasets").Dataset

    rows = compare.make_rows(8, held_out=False, seed=0)
    return Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])


def _model_dir(tmp_path_factory, model_type):
    path = tmp_path_factory.mktemp(model_type)
    tiny_model(model_type).save_pretrained(path)
    TOKENIZER.save_pretrained(path)
    return str(path)


# families whose head stock TRL 1.16's fused head reads wrong: RecurrentGemma's cap is logits_soft_cap, TRL reads
# final_logit_softcapping only. Their oracle is the adapter's logits path (the model's own logits, which equals
# stock TRL on every other family); stock TRL is checked to differ, so that this list cannot go stale unseen.
STOCK_TRL_MISREADS = {"recurrent_gemma"}


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_trl_adapter_default_matches_stock_trl(tmp_path_factory, tmp_path, dataset, model_type,
                                               gradient_checkpointing):
    pytest.importorskip("trl", reason="the trl extra is not installed (pip install 'grpo-kernels[trl]')")
    from test_trl_integration import _batch, _trainer, assert_same_as_trl
    from trl import GRPOTrainer

    from grpo_kernels.integration.trl import GRPOKernelsTrainer, trl_head_difference

    model_dir = _model_dir(tmp_path_factory, model_type)
    config = dict(beta=0.04, temperature=0.9, gradient_checkpointing=gradient_checkpointing)
    stock = _trainer(GRPOTrainer, model_dir, dataset, tmp_path, **config)
    ours = _trainer(GRPOKernelsTrainer, model_dir, dataset, tmp_path, **config)
    assert ours.fused_lm_head, model_type  # not the logits path, which the adapter falls back to on a refusal
    assert (ours.head_transform.scale, ours.head_transform.softcap) == TRANSFORMING.get(model_type, (0, (1.0, None)))[1]
    batch = _batch(stock, off_policy=True, beta=0.04)
    if model_type in STOCK_TRL_MISREADS:
        logits_path = _trainer(GRPOKernelsTrainer, model_dir, dataset, tmp_path, fused_lm_head=False, **config)
        assert_same_as_trl(logits_path, ours, batch)
        with pytest.raises(AssertionError):
            assert_same_as_trl(stock, ours, batch)
        # TRL's own head, which computes the old and reference log-probs, answers from the model's logits here
        for model in (ours.model, ours.ref_model):
            assert trl_head_difference(model, 0.9) is None
        assert trl_head_difference(stock.model, 0.9) is not None
    else:
        assert_same_as_trl(stock, ours, batch)
