"""The fused lm_head on the model families people train, each from a tiny random config of the installed
transformers: exact, or refused by name.

Every causal-LM family that ``scripts/survey_head_transforms.py`` finds transforming its head's output (a
soft-cap, a scale, both), and families that do not (Llama, Qwen2/3, Mistral, Phi-3, OLMo-2, SmolLM3, an MoE
model): the TRL adapter's default (the fused lm_head) against stock TRL's ``GRPOTrainer`` on one batch (loss and
every parameter's gradient, gradient checkpointing on and off), ``linear_token_logprobs`` against the model's
own log-probs, the thin trainer's fused lm_head against its logits path. The transforms are set far from the
released values (a cap of 1.5, scales of 0.4 to 3) and the weights drawn large (std 0.2), so that a transform
left out moves the loss far beyond the tolerance: the probe is checked to refuse each family with its
transform removed. A vision-language model (a tiny Qwen2.5-VL, one 2 x 2-patch image a prompt) checks that the
fused lm_head reads the hidden states with the images merged, as the model's own forward does.
"""

import warnings

import pytest
import torch

from grpo_kernels import heads, linear_selective_log_softmax_and_entropy, linear_token_logprobs
from grpo_kernels.training.tasks import compare

TOKENIZER = compare.build_tokenizer()
COMMON = dict(
    vocab_size=len(TOKENIZER),
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    initializer_range=0.2,
    pad_token_id=TOKENIZER.pad_token_id,
    bos_token_id=TOKENIZER.bos_token_id,
    eos_token_id=TOKENIZER.eos_token_id,
)
MOE = dict(output_router_logits=False, router_aux_loss_coef=0.02)
# model_type: (config fields, the transform head_transform must read: (scale, softcap))
TRANSFORMING = {
    "gemma2": (dict(final_logit_softcapping=1.5), (1.0, 1.5)),
    "gemma3_text": (dict(final_logit_softcapping=1.5), (1.0, 1.5)),
    # (its per-layer input embedding over the tiny vocabulary: the default's has 262144 rows)
    "gemma4_text": (dict(final_logit_softcapping=1.5, vocab_size_per_layer_input=len(TOKENIZER)), (1.0, 1.5)),
    "vaultgemma": (dict(final_logit_softcapping=1.5), (1.0, 1.5)),
    "nanochat": (dict(final_logit_softcapping=1.5), (1.0, 1.5)),
    "recurrent_gemma": (dict(logits_soft_cap=1.5), (1.0, 1.5)),
    "cohere": (dict(logit_scale=3.0), (3.0, None)),
    "cohere2": (dict(logit_scale=3.0), (3.0, None)),
    "granite": (dict(logits_scaling=0.4), (2.5, None)),
    # no router loss: stock TRL 1.16's fused head reads config.num_experts, which GraniteMoE names num_local_experts
    "granitemoe": (
        dict(logits_scaling=0.4, num_local_experts=2, num_experts_per_tok=1, router_aux_loss_coef=0.0),
        (2.5, None),
    ),
    # its Mamba mixer at the tiny model's size (the config's defaults are a 1024-wide, 256-state mixer whatever the
    # hidden size: half a minute a test on the CPU); the head's multiplier is what is under test
    "falcon_h1": (
        dict(lm_head_multiplier=3.0, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_state=8, mamba_chunk_size=8),
        (3.0, None),
    ),
    "hyperclovax": (dict(logits_scaling=3.0), (3.0, None)),  # HyperCLOVA X multiplies where Granite divides
    "beam": (dict(final_logit_softcapping=1.5), (1.0, 1.5)),
    "gemma4_unified_text": (dict(final_logit_softcapping=1.5), (1.0, 1.5)),
    # a padded vocabulary: the logits keep the first unpadded_vocab_size rows of the head
    "inkling2_text": (
        dict(final_logit_softcapping=1.5, vocab_size=len(TOKENIZER) + 3, unpadded_vocab_size=len(TOKENIZER)),
        (1.0, 1.5),
    ),
    "xlstm": (dict(output_logit_soft_cap=1.5), (1.0, 1.5)),
    "cohere2_moe": (dict(logit_scale=3.0), (3.0, None)),
    "granite_swa": (dict(logits_scaling=0.4), (2.5, None)),
    "granitemoe_swa": (
        dict(logits_scaling=0.4, num_local_experts=2, num_experts_per_tok=1, router_aux_loss_coef=0.0),
        (2.5, None),
    ),
    "granitemoeshared": (
        dict(logits_scaling=0.4, num_local_experts=2, num_experts_per_tok=1, router_aux_loss_coef=0.0),
        (2.5, None),
    ),
    "inkling_text": (  # divides the hidden states; the experts and sliding-window heads at the tiny size
        dict(
            logits_mup_width_multiplier=2.5,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            swa_head_dim=8,
        ),
        (0.4, None),
    ),
}
PLAIN = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {},
    "phi3": {},
    "olmo2": {},
    "smollm3": {},
    "gemma": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **MOE),
}
FAMILIES = {**{name: fields for name, (fields, _) in TRANSFORMING.items()}, **PLAIN}


def tiny_model(model_type: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**COMMON, **FAMILIES[model_type]})
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


def test_a_family_whose_head_no_scale_or_cap_expresses_is_refused_by_name():
    """ModernBERT's decoder runs a prediction head (dense, activation, norm) between the hidden states and its
    output layer: no weight, scale or cap of the fused lm_head reproduces it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("modernbert-decoder", **COMMON)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(heads.FusedHeadError, match=r"ModernBertDecoderForCausalLM.*fused_lm_head=False"):
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


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_fused_head_op_is_the_models_own_head_with_its_gradients(model_type):
    """The fused head as a differentiable op (``linear_selective_log_softmax_and_entropy``) on a family's hidden states
    and effective head weight: the log-probs and entropy of the model's own logits, and their gradients in the
    hidden states and the weight (through the head's transform: soft-cap, scales) equal autograd of the model's
    own head (the last layers' output through its lm_head)."""
    model = tiny_model(model_type).eval()
    transform = heads.fused_head(model)
    ids = torch.randint(3, len(TOKENIZER), (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = heads.last_hidden_states(model, ids).last_hidden_state
    weights = torch.randn(2, 6, generator=torch.Generator().manual_seed(2))  # a loss's weights on both outputs

    def head_grads(fn):
        h = hidden.detach().clone().requires_grad_()
        model.zero_grad()
        logp, entropy = fn(h)
        ((logp + 0.3 * entropy) * weights).sum().backward()
        weight = model.get_output_embeddings().weight
        return logp.detach(), entropy.detach(), h.grad, weight.grad.clone()

    def models_own(h):  # the model's own forward, its backbone's output replaced by h (same values): its head on h
        def substitute(module, args, kwargs, output):
            output.last_hidden_state = h
            return output

        hook = heads.backbone(model).register_forward_hook(substitute, with_kwargs=True)
        try:
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float() / 0.9
        finally:
            hook.remove()
        log_p = torch.log_softmax(logits, -1)
        return log_p.gather(-1, ids[:, 1:, None])[..., 0], -(log_p.exp() * log_p).sum(-1)

    def ours(h):
        weight, bias = heads.head_weights(model, transform)
        return linear_selective_log_softmax_and_entropy(h[:, :-1], weight, ids[:, 1:], bias, 0.9, **transform.options)

    for expected, got, name in zip(
        head_grads(models_own), head_grads(ours), ("logp", "entropy", "dh", "dw"), strict=True
    ):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5, msg=lambda m, name=name: f"{name}: {m}")


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


# families whose head stock TRL 1.16's fused head reads wrong: RecurrentGemma's cap is logits_soft_cap and xLSTM's
# output_logit_soft_cap (TRL reads final_logit_softcapping only), Inkling divides its hidden states by
# logits_mup_width_multiplier (TRL applies no scale it does not list). Their oracle is the adapter's logits path
# (the model's own logits, which equals stock TRL on every other family); stock TRL is checked to differ, so that
# this list cannot go stale unseen.
STOCK_TRL_MISREADS = {"recurrent_gemma", "xlstm", "inkling_text"}


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_trl_adapter_default_matches_stock_trl(tmp_path_factory, tmp_path, dataset, model_type, gradient_checkpointing):
    pytest.importorskip("trl", reason="the trl extra is not installed (pip install 'grpo-kernels[trl]')")
    from test_trl_integration import _batch, _trainer, assert_same_as_trl
    from trl import GRPOTrainer

    from grpo_kernels.integration.trl import GRPOKernelsTrainer, trl_head_difference

    model_dir = _model_dir(tmp_path_factory, model_type)
    config = dict(beta=0.04, temperature=0.9, gradient_checkpointing=gradient_checkpointing)
    stock = _trainer(GRPOTrainer, model_dir, dataset, tmp_path, **config)
    ours = _trainer(GRPOKernelsTrainer, model_dir, dataset, tmp_path, **config)
    assert ours.fused_lm_head, model_type  # not the logits path, which the adapter falls back to on a refusal
    expected = TRANSFORMING.get(model_type, (None, (1.0, None)))[1]
    assert (ours.head_transform.scale, ours.head_transform.softcap) == expected
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


# ---- a vision-language model: the images merged into the hidden states the fused lm_head reads ------------------

IMAGE_TOKEN = len(TOKENIZER)  # ids past the tokenizer's: the prompts never hold them by chance
GRID = [1, 2, 2]  # one image: 2 x 2 patches, merged 2 x 2 into one image token


def tiny_vlm(seed: int = 0):
    """A Qwen2.5-VL with a 1-layer vision tower: one image token per 2 x 2 patch image."""
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

    text = {k: v for k, v in COMMON.items() if k not in ("head_dim", "pad_token_id", "bos_token_id", "eos_token_id")}
    text.update(vocab_size=IMAGE_TOKEN + 4, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=COMMON["hidden_size"],
        patch_size=2,
        spatial_merge_size=2,
        temporal_patch_size=1,
        in_channels=3,
        fullatt_block_indexes=[0],
        window_size=4,
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        video_token_id=IMAGE_TOKEN + 1,
        vision_start_token_id=IMAGE_TOKEN + 2,
        vision_end_token_id=IMAGE_TOKEN + 3,
        pad_token_id=TOKENIZER.pad_token_id,
        bos_token_id=TOKENIZER.bos_token_id,
        eos_token_id=TOKENIZER.eos_token_id,
    )
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForImageTextToText.from_config(config)


def with_images(input_ids: torch.Tensor, seed: int):
    """(ids with an image token at position 1 of each row, the model's image inputs: one image a row)."""
    ids = input_ids.clone()
    ids[:, 1] = IMAGE_TOKEN
    rows = ids.shape[0]
    patches = torch.randn(rows * 4, 3 * 2 * 2, generator=torch.Generator().manual_seed(seed))
    return ids, {"pixel_values": patches, "image_grid_thw": torch.tensor([GRID] * rows)}


def test_a_vlms_fused_log_probs_are_its_own_with_the_image_merged():
    model = tiny_vlm().eval()
    transform = heads.fused_head(model)
    ids, images = with_images(torch.randint(3, len(TOKENIZER), (2, 7), generator=torch.Generator().manual_seed(1)), 2)
    _, other_images = with_images(ids, 3)

    def fused(images):
        hidden = heads.last_hidden_states(model, ids, **images).last_hidden_state[:, :-1]
        weight, bias = heads.head_weights(model, transform)
        return linear_token_logprobs(hidden, weight, ids[:, 1:], bias, 0.9, backend="torch", **transform.options)

    with torch.no_grad():
        expected = torch.log_softmax(model(input_ids=ids, **images).logits[:, :-1].float() / 0.9, -1)
        expected = expected.gather(-1, ids[:, 1:, None])[..., 0]
        got, other = fused(images), fused(other_images)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (other - got)[:, 1:].abs().max() > 1e-3  # the image is read: another image, other log-probs


def test_an_input_the_backbone_does_not_take_is_refused_by_name():
    """A text model given image inputs: dropped, they would leave the hidden states another model's."""
    model = tiny_model("llama")
    ids, images = with_images(torch.randint(3, len(TOKENIZER), (2, 7)), 0)
    with pytest.raises(heads.FusedHeadError, match=r"LlamaForCausalLM.*takes no \['image_grid_thw', 'pixel_values'\]"):
        heads.last_hidden_states(model, ids.clamp(max=len(TOKENIZER) - 1), **images)


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_trl_adapter_default_matches_stock_trl_on_a_vlm_batch(tmp_path, dataset, gradient_checkpointing):
    """Prompts with an image each, as TRL 1.16 batches them (``pixel_values`` over the batch's patches,
    ``image_grid_thw``, ``num_images``): the adapter's fused lm_head against stock TRL, whose loss runs the model's
    own forward."""
    pytest.importorskip("trl", reason="the trl extra is not installed (pip install 'grpo-kernels[trl]')")
    from test_trl_integration import _batch, _loss_and_grads, _trainer, assert_same_as_trl
    from trl import GRPOTrainer

    from grpo_kernels.integration.trl import GRPOKernelsTrainer

    model_dir = tmp_path / "qwen2_5_vl"
    tiny_vlm().save_pretrained(model_dir)
    TOKENIZER.save_pretrained(model_dir)
    config = dict(beta=0.04, temperature=0.9, gradient_checkpointing=gradient_checkpointing)
    stock = _trainer(GRPOTrainer, str(model_dir), dataset, tmp_path, **config)
    ours = _trainer(GRPOKernelsTrainer, str(model_dir), dataset, tmp_path, **config)
    assert ours.fused_lm_head
    batch = _batch(stock, off_policy=True, beta=0.04)
    batch["prompt_ids"], images = with_images(batch["prompt_ids"], 4)
    batch.update(images, num_images=[1] * len(batch["prompt_ids"]))
    assert_same_as_trl(stock, ours, batch)
    _, other_images = with_images(batch["prompt_ids"], 5)
    loss, _, _ = _loss_and_grads(ours, batch, 1)
    other_loss, _, _ = _loss_and_grads(ours, {**batch, **other_images}, 1)
    assert abs(float(other_loss - loss)) > 1e-4  # the images are read: other images, another loss
