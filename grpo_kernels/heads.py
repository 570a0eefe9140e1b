"""What a model's output layer does, read from the model and checked against its own forward.

A fused lm_head computes the loss from the last hidden states and the head's weight, never holding the logits;
so it must apply, itself, whatever the model's ``forward`` does between the head and the logits it returns.
transformers' causal-LM classes do several things there (``scripts/survey_head_transforms.py`` lists them
from the source; docs/model-families.md has the table):

- a soft-cap, cap * tanh(x / cap): Gemma 2, 3, 3n, 4 (``final_logit_softcapping``, 30 on Gemma 2), VaultGemma,
  NanoChat, Beam, PaliGemma, Mistral Large 4, Muse, Inkling 2, RecurrentGemma (``logits_soft_cap``), xLSTM
  (``output_logit_soft_cap``);
- a scale before it: Cohere 1 / 2 (``logit_scale``, 0.0625), Falcon-H1 (``lm_head_multiplier``), Muse
  (``output_multiplier``), Granite (all of them) and MiniCPM3 (1 / ``logits_scaling``), HyperCLOVA X
  (``logits_scaling``), Inkling (1 / ``logits_mup_width_multiplier``, on the hidden states: the same, the head
  having no bias there);
- a slice of a padded vocabulary: Inkling (``unpadded_vocab_size``);
- and things no weight, scale or cap expresses (Chameleon's masked image tokens, ModernBERT's decoder's
  prediction head between the hidden states and the output layer).

``head_transform(model)`` reads the first three from the model's config. ``fused_head(model)`` then runs the
model's own forward on a few tokens and compares its log-probs with the transform applied to the head's output
on the backbone's hidden states (the fused path's own inputs): a family nobody listed, a transform transformers
adds next month, a config field read wrong, all differ there, and are refused by name (``FusedHeadError``), never
trained silently on another objective. The TRL adapter and the thin trainer run it once, when they set up the
fused lm_head.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
from typing import NamedTuple

import torch

from .wrapped import output_layer


class HeadTransform(NamedTuple):
    """What a model's forward does to its head's raw output x: logits = cap(scale x) (cap(y) = softcap tanh(y /
    softcap), no cap when ``softcap`` is None), over the head's first ``vocab_size`` rows (None: all of them).
    ``read_from``: the config fields it came from (for messages)."""

    scale: float = 1.0
    softcap: float | None = None
    vocab_size: int | None = None
    read_from: tuple[str, ...] = ()

    @property
    def options(self) -> dict[str, object]:
        """The loss options of this transform (``logit_scale``, ``logit_softcap``), for ``FusedLinearGRPOLoss``,
        ``linear_token_logprobs`` and the logits-path calls on raw head outputs."""
        return {"logit_scale": self.scale, "logit_softcap": self.softcap}

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        """The logits the model returns, fp32, from its head's raw output (``head_weights``' product)."""
        x = raw.float() * self.scale
        return x if self.softcap is None else self.softcap * torch.tanh(x / self.softcap)


class FusedHeadError(ValueError):
    """A model whose logits the fused lm_head cannot reproduce (use the logits path: ``fused_lm_head=False``)."""


# config fields, by what the forward does with them (scripts/survey_head_transforms.py finds where)
_SOFTCAPS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
_MULTIPLIERS = ("logit_scale", "output_multiplier", "lm_head_multiplier")
_DIVISOR_ON_HIDDEN = ("logits_mup_width_multiplier",)
_LOGITS_SCALING_MULTIPLIES = ("hyperclovax", "hyperclovax_vision_v2")  # logits_scaling: the others divide


def _number(config, name: str) -> float | None:
    value = getattr(config, name, None)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def head_transform(model: torch.nn.Module) -> HeadTransform:
    """The output transform a model's forward applies to its head's output, from its config (its text config for
    a vision-language model): the soft-cap, the scale, the vocabulary it keeps. Not checked here: see
    ``fused_head``."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    read, scale, softcap = [], 1.0, None
    for name in _MULTIPLIERS:
        value = _number(config, name)
        if value is not None:
            scale *= value
            read.append(f"{name}={value:g}")
    for name in _DIVISOR_ON_HIDDEN:
        value = _number(config, name)
        if value is not None:
            scale /= value
            read.append(f"{name}={value:g}")
    value = _number(config, "logits_scaling")
    if value is not None:
        multiplies = getattr(config, "model_type", None) in _LOGITS_SCALING_MULTIPLIES
        scale = scale * value if multiplies else scale / value
        read.append(f"logits_scaling={value:g} ({'times' if multiplies else 'divided by'})")
    for name in _SOFTCAPS:
        value = _number(config, name)
        if value is not None:
            softcap = value
            read.append(f"{name}={value:g}")
            break
    vocab = getattr(config, "unpadded_vocab_size", None)
    if vocab is not None:
        read.append(f"unpadded_vocab_size={vocab}")
    return HeadTransform(scale, softcap, vocab, tuple(read))


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose ``last_hidden_state`` the model's head reads: transformers' base model (a
    vision-language model's multimodal model, which merges the image features into the sequence), else the
    decoder. ``model``: the transformers model, or a PEFT model around it (its ``get_base_model()``)."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    base = getattr(model, "base_model", None)
    if isinstance(base, torch.nn.Module) and base is not model:
        return base
    return model.get_decoder()


def head_weights(model: torch.nn.Module, transform: HeadTransform) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of the model's output layer as its forward applies them (``wrapped.output_layer``: a LoRA
    adapter folded in), the rows the model keeps (``transform.vocab_size``)."""
    weight, bias = output_layer(model.get_output_embeddings())
    if transform.vocab_size is not None and transform.vocab_size < weight.shape[0]:
        weight = weight[: transform.vocab_size]
        bias = None if bias is None else bias[: transform.vocab_size]
    return weight, bias


def last_hidden_states(
    model: torch.nn.Module, input_ids, attention_mask=None, *, output_router_logits=False, **extra_inputs
):
    """The backbone's output (``backbone``) on a batch, with the model's other inputs (a vision-language model's
    ``pixel_values``, ``image_grid_thw``, ...: merged into the sequence as the model's own forward merges them).
    An input the backbone's forward does not name is refused by name: it would be dropped, and the hidden
    states would be another model's."""
    module = backbone(model)
    given = {name: value for name, value in extra_inputs.items() if value is not None}
    named = inspect.signature(module.forward).parameters
    unknown = sorted(name for name in given if name not in named)
    if unknown:
        raise FusedHeadError(
            f"{type(model).__name__}'s backbone ({type(module).__name__}) takes no {unknown}: the "
            "fused lm_head cannot merge them into its hidden states; use fused_lm_head=False"
        )
    if output_router_logits:
        given["output_router_logits"] = True
    return module(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **given)


def router_aux_loss(model: torch.nn.Module, backbone_outputs, attention_mask) -> torch.Tensor:
    """An MoE model's router load-balancing loss from its backbone's router logits, by the model's own function
    and attributes, as its forward computes it (``load_balancing_loss_func(router_logits, num_experts,
    num_experts_per_tok, attention_mask)``)."""
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    logits = getattr(backbone_outputs, "router_logits", None)
    if fn is None or experts is None or top_k is None or logits is None:
        raise FusedHeadError(
            f"{type(model).__name__}: the fused lm_head cannot compute this model's router "
            "auxiliary loss (no load_balancing_loss_func, num_experts or router logits where "
            "transformers' MoE models keep them); use fused_lm_head=False"
        )
    return fn(logits, experts, top_k, attention_mask)


def probe_ids(model, tokens: int) -> torch.Tensor:
    """A few ids in the text vocabulary, none of the config's special multimodal ids (an image token without an
    image fails a vision-language model's forward)."""
    config = model.config
    configs = [config] + [getattr(config, name) for name in ("text_config",) if getattr(config, name, None)]
    vocab = min(getattr(c, "vocab_size", None) or math.inf for c in configs)
    vocab = int(min(vocab, model.get_output_embeddings().weight.shape[0]))
    special = {
        v
        for c in configs
        for k, v in vars(c).items()
        if isinstance(v, int)
        and not isinstance(v, bool)
        and k.endswith(("_token_id", "_token_index"))
        and "pad" not in k
        and "bos" not in k
        and "eos" not in k
    }
    allowed = [i for i in range(min(vocab, 4096)) if i not in special]
    g = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(allowed), (2, tokens), generator=g)
    return torch.tensor(allowed)[picks]


@contextlib.contextmanager
def evaluating(model: torch.nn.Module):
    """The model in eval mode (no dropout) for the block, every module's own mode restored after it."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def logit_rounding(logits: torch.Tensor, dtype: torch.dtype) -> float:
    """How far two log-probs of the same ``logits`` (held in ``dtype``) may differ by rounding alone: 16 ulps of
    the largest logit (at least of 1), what two heads that compute the same thing in another order differ by."""
    return 16 * torch.finfo(dtype).eps * max(1.0, float(logits.abs().max()))


def probe_difference(
    model: torch.nn.Module, transform: HeadTransform, *, tokens: int = 8, router_aux_loss_too: bool = False
) -> str | None:
    """Why the fused lm_head's logits of ``model`` would differ from its own forward's (None if they agree
    within rounding): the model's forward and the fused path's inputs (``last_hidden_states``, ``head_weights``,
    ``transform``) on a few tokens, compared as log-probs (what the loss reads); with ``router_aux_loss_too``, the
    MoE router loss as well. One small forward each, without gradient."""
    param = next(model.parameters())
    ids = probe_ids(model, tokens).to(param.device)
    mask = torch.ones_like(ids)
    with torch.no_grad(), evaluating(model):
        extra = {"output_router_logits": True} if router_aux_loss_too else {}
        own = model(input_ids=ids, attention_mask=mask, use_cache=False, **extra)
        outputs = last_hidden_states(model, ids, mask, output_router_logits=router_aux_loss_too)
        weight, bias = head_weights(model, transform)
        hidden = outputs.last_hidden_state.to(weight.dtype)
        fused = transform.apply(torch.nn.functional.linear(hidden, weight, bias))
        logits = own.logits.float()
        if logits.shape != fused.shape:
            return (
                f"its forward returns logits of shape {tuple(logits.shape)}, its head on its backbone's hidden "
                f"states gives {tuple(fused.shape)}"
            )
        tolerance = logit_rounding(logits, own.logits.dtype)
        difference = float((logits.log_softmax(-1) - fused.log_softmax(-1)).abs().max())
        if not difference <= tolerance:  # NaN differs too
            return (
                f"its forward's log-probs and the fused lm_head's (head transform: {_described(transform)}) "
                f"differ by {difference:.3g} on a probe, beyond the rounding of its logits ({tolerance:.2g})"
            )
        if router_aux_loss_too:
            expected, got = own.aux_loss, router_aux_loss(model, outputs, mask)
            if expected is None or not torch.allclose(got.float(), expected.float(), rtol=1e-4, atol=1e-6):
                return f"its router auxiliary loss ({expected}) is not the fused path's ({got})"
    return None


def _described(transform: HeadTransform) -> str:
    return ", ".join(transform.read_from) if transform.read_from else "none"


def fused_head(model: torch.nn.Module, *, router_aux_loss_too: bool = False) -> HeadTransform:
    """The model's head transform (``head_transform``), checked against the model's own forward
    (``probe_difference``); ``FusedHeadError`` naming the model's class where they disagree."""
    transform = head_transform(model)
    try:
        reason = probe_difference(model, transform, router_aux_loss_too=router_aux_loss_too)
    except FusedHeadError:
        raise
    except Exception as err:  # noqa: BLE001  (the model's forward failed on the probe: say which and why)
        reason = f"its forward failed on the probe ({type(err).__name__}: {err})"
    if reason is not None:
        raise FusedHeadError(
            f"the fused lm_head cannot reproduce {type(model).__name__}'s logits: {reason}. Use "
            "the logits path (fused_lm_head=False), which reads the model's own logits"
        )
    return transform
