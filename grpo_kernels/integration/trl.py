"""TRL drop-in: ``GRPOKernelsTrainer``, TRL's ``GRPOTrainer`` with the loss computed by ``GRPOLoss``.

Switching is a one-word change::

    from grpo_kernels.integration.trl import GRPOKernelsTrainer as GRPOTrainer

Same constructor, same ``GRPOConfig``. Everything but the loss (generation, rewards,
advantages, reference log-probs, logging, vLLM) is TRL's own. The loss reproduces TRL
1.16's ``_compute_loss`` number for number: the per-token terms of every shared
loss_type, both importance-sampling levels, the KL term with its bias correction, the
vLLM importance-sampling correction, TRL's reductions with its division by the
gradient-accumulation steps, the ``num_items_in_batch`` normalizer of dapo / cispo, and
TRL's metric keys. TRL options this loss does not implement raise at construction.
"""

from __future__ import annotations

import dataclasses
import types
import warnings

import torch
from packaging.version import Version

try:
    import trl
    from trl import GRPOTrainer
except ImportError as err:  # the trl extra is optional
    raise ImportError("grpo_kernels.integration.trl needs TRL: pip install 'grpo-kernels[trl]'") from err

from ..argument_docs import ADAPTER_ARGUMENTS, document_public
from ..entropy_control import AdaptiveEntropy
from ..heads import (
    FusedHeadError,
    evaluating,
    fused_head,
    head_weights,
    last_hidden_states,
    logit_rounding,
    probe_ids,
    router_aux_loss,
)
from ..loss import FusedLinearGRPOLoss, GRPOLoss, selective_log_softmax_and_entropy
from ..objective import per_token_terms
from ..options import LOSS_TYPE_REGISTRY, LOSS_TYPES, GRPOOptions
from ..wrapped import gathered_with, inside_forward, whole_parameters, zero3_gloo_hazard

# The oldest TRL the adapter matches number for number: TRL 1.8 and 1.9 reduce luspo (and cispo with the entropy
# bonus and the policy masks) otherwise than 1.10 on; 1.0 - 1.7 lack trainer attributes the adapter reads
# (_entropy_bonus_enabled came in 1.8).
OLDEST_TRL = (1, 10)


def check_trl_version(version: str) -> None:
    """ImportError naming ``version`` when TRL is older than ``OLDEST_TRL``."""
    if Version(version).release < OLDEST_TRL:
        raise ImportError(
            f"grpo_kernels.integration.trl matches TRL >= {'.'.join(map(str, OLDEST_TRL))}, got "
            f"trl {version}: pip install 'trl>={'.'.join(map(str, OLDEST_TRL))}'"
        )


check_trl_version(trl.__version__)

# the batch's inputs besides the ids and the mask that TRL 1.16 passes to a model's forward (vision-language
# models, token types): both paths pass them on, the fused one to the backbone, which merges the images
MODEL_INPUT_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "image_sizes",
    "image_position_ids",
    "spatial_shapes",
    "token_type_ids",
    "mm_token_type_ids",
)


def unsupported_options(trainer) -> list:
    """TRL settings this loss does not implement, as readable strings (empty when all is supported)."""
    args = trainer.args
    problems = []
    if trainer.loss_type not in LOSS_TYPES:
        problems.append(f"loss_type={trainer.loss_type!r} (supported: {list(LOSS_TYPES)})")
    if getattr(args, "use_adaptive_entropy", False) and getattr(trainer, "top_entropy_quantile", 1.0) < 1.0:
        problems.append(
            "use_adaptive_entropy with top_entropy_quantile < 1 (the controller would need the "
            "entropy over the high-entropy tokens, which the loss does not report)"
        )
    if getattr(args, "context_parallel_size", 1) not in (None, 1):
        problems.append("context parallelism")
    return problems


def trl_head_difference(model: torch.nn.Module, temperature: float) -> str | None:
    """Why the fused head TRL patched onto ``model`` (``model(..., labels=, fused_lm_head=True)``) gives other
    log-probs than the model's own forward (None where they agree within rounding): TRL 1.16 reads a soft-cap
    from ``final_logit_softcapping`` only (RecurrentGemma names it ``logits_soft_cap``, xLSTM
    ``output_logit_soft_cap``) and applies no transform it does not list. One small forward each, no gradient."""
    ids = probe_ids(model, 8).to(next(model.parameters()).device)
    mask = torch.ones_like(ids)
    with torch.no_grad(), evaluating(model):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        scaled = logits.float() / temperature
        own = torch.log_softmax(scaled, -1).gather(-1, ids[:, 1:, None])[..., 0]
        theirs = model(input_ids=ids, attention_mask=mask, labels=ids, fused_lm_head=True).log_probs.float()
    difference = float((own - theirs[:, -own.shape[1] :]).abs().max())
    if difference <= logit_rounding(scaled, logits.dtype):
        return None
    return f"TRL's fused head differs from {type(model).__name__}'s own log-probs by {difference:.3g}"


def exact_trl_head(model: torch.nn.Module, temperature: float) -> bool:
    """Where TRL's fused head on ``model`` misreads it (``trl_head_difference``), make ``fused_lm_head=True``
    answer from the model's own logits (exact; the [B, L, V] logits are then held), with a warning. True if it
    did. TRL's head patch must be on the model (stock TRL 1.16's ``GRPOTrainer.__init__`` puts it there)."""
    if "forward" not in model.__dict__:  # no TRL head patched on: nothing to check
        return False
    reason = trl_head_difference(model, temperature)
    if reason is None:
        return False
    from trl.trainer.utils import FusedCausalLMOutput

    trl_forward = model.forward

    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            return trl_forward(
                *args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch, **kwargs
            )
        kwargs["use_cache"] = False
        out = trl_forward(*args, **kwargs)  # the model's own forward: its logits, transformed as it does
        logits, labels = (out.logits[:, :-1], labels[:, 1:]) if shift_labels is None else (out.logits, shift_labels)
        mask = labels != -100
        log_probs, entropy = selective_log_softmax_and_entropy(
            logits, labels.clamp(min=0), temperature, check_ids=False
        )
        log_probs, entropy = log_probs.masked_fill(~mask, 0), entropy.masked_fill(~mask, 0)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(
            loss=-log_probs.sum() / count,
            log_probs=log_probs,
            entropy=entropy,
            label_mask=mask,
            aux_loss=getattr(out, "aux_loss", None),
        )

    model.forward = types.MethodType(forward, model)
    warnings.warn(
        f"{reason}: GRPOKernelsTrainer computes the old and reference log-probs from the model's logits", stacklevel=3
    )
    return True


class GRPOKernelsTrainer(GRPOTrainer):
    """TRL's GRPOTrainer whose loss is grpo-kernels' fused ``GRPOLoss``."""

    def __init__(self, *args, fused_lm_head: bool | None = None, **kwargs):
        """TRL's arguments, plus ``fused_lm_head``: compute the loss from the last hidden states and the
        lm_head weight (``FusedLinearGRPOLoss``), never materializing the [B, T + 1, V] logits, as stock TRL's
        own fused head does. None (the default): wherever the model's head allows it (``heads.fused_head``:
        its output transform read from its config and checked on a probe of its own forward), else the logits
        path with a warning saying why. True: the fused lm_head or ``FusedHeadError``. False: the logits path
        (``model(...).logits``)."""
        self.fused_lm_head = fused_lm_head is not False  # read by unsupported_options, which runs in TRL's __init__
        self._clip_options = None  # the loss's options without its KL and bonus: the clip flags' (built once)
        super().__init__(*args, **kwargs)
        problems = unsupported_options(self)
        if problems:
            raise ValueError(
                "GRPOKernelsTrainer does not support " + "; ".join(problems) + ". Use TRL's GRPOTrainer for these."
            )
        # the probes run the model's forward outside DeepSpeed's engine: under ZeRO-3, on its gathered parameters
        policy = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        hazard = (
            plugin is not None
            and torch.distributed.is_initialized()
            and zero3_gloo_hazard(plugin.deepspeed_config, torch.distributed.get_backend())
        )
        if hazard:
            warnings.warn(hazard, stacklevel=2)
        with whole_parameters(policy):
            self.head_transform = (
                self._fused_head_transform(required=fused_lm_head is True) if self.fused_lm_head else None
            )
            # TRL's own fused head computes the old and reference log-probs: where it misreads a model's head, the
            # model's own logits answer instead
            exact_trl_head(policy, float(self.temperature))
        if self.ref_model is not None:
            with whole_parameters(self.ref_model):
                exact_trl_head(self.ref_model, float(self.temperature))
        self._head_gathered = False  # under ZeRO-3, the head's parameters gathered in the policy's forward
        self.fused_lm_head = self.head_transform is not None  # resolved: what the probe allowed
        # the one TRL -> options mapping (GRPOOptions.from_trl_config), with the values the trainer resolved
        options = GRPOOptions.from_trl_config(
            self.args,
            loss_type=self.loss_type,
            beta=float(self.beta),
            epsilon=float(self.epsilon_low),
            epsilon_high=float(self.epsilon_high),
            temperature=float(self.temperature),
            importance_sampling_level=self.importance_sampling_level,
        )
        # From logits, the loss gets the model's [B, T + 1, V] output whole (drop_last_position): its
        # gradient is written at that shape, not copied into it by autograd's slice backward.
        # cast_lm_head_to_fp32: TRL computes the head in fp32 (hidden states and weight cast): head_precision "fp32"
        head_precision = "fp32" if getattr(self.args, "cast_lm_head_to_fp32", False) else "input"
        self.grpo_loss = (
            FusedLinearGRPOLoss(options=options.replace(**self.head_transform.options), head_precision=head_precision)
            if self.fused_lm_head
            else GRPOLoss(options=options, drop_last_position=True)
        )
        self._entropy_controller = (
            AdaptiveEntropy(
                coef=self.entropy_coef,
                target=self.args.entropy_target,
                coef_min=self.args.entropy_coef_min,
                coef_max=self.args.entropy_coef_max,
                delta=self.args.entropy_coef_delta,
            )
            if getattr(self.args, "use_adaptive_entropy", False)
            else None
        )

    def _fused_head_transform(self, required: bool):
        """The policy's head transform for the fused lm_head (``heads.fused_head``, which probes the model's own
        forward once), or None where it cannot be reproduced: ``FusedHeadError`` if ``required``, else a warning
        and the logits path."""
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        try:
            return fused_head(model, router_aux_loss_too=bool(self.aux_loss_enabled))
        except FusedHeadError as err:
            if required:
                raise
            warnings.warn(f"GRPOKernelsTrainer computes the loss from the logits: {err}", stacklevel=3)
            return None

    @staticmethod
    def _sequence(inputs):
        """Prompt + completion ids and attention mask, as TRL's own forward builds them, and the batch's other
        model inputs (``MODEL_INPUT_KEYS``)."""
        sequence = {
            "input_ids": torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            "attention_mask": torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
        }
        sequence.update({key: inputs[key] for key in MODEL_INPUT_KEYS if inputs.get(key) is not None})
        return sequence

    def _completion_logits(self, model, inputs):
        """(logits [B, T + 1, V], the MoE auxiliary loss or None): the T positions that predict the
        completion tokens, then the last one (which the loss drops without a copy). The model computes
        only these (``logits_to_keep``); an MoE model returns its load-balancing loss when TRL adds it."""
        T = inputs["completion_ids"].size(1)
        model_inputs = {**self._sequence(inputs), "logits_to_keep": T + 1}
        if self.aux_loss_enabled:
            model_inputs["output_router_logits"] = True
        with self.accelerator.autocast():
            outputs = model(**model_inputs)
        logits = outputs.logits
        logits = logits if logits.shape[1] == T + 1 else logits[:, -(T + 1) :]  # a model that ignored logits_to_keep
        return logits, outputs.aux_loss if self.aux_loss_enabled else None

    def _fused_head_loss(self, model, inputs, mask, loss_inputs):
        """(The fused lm_head loss's output, the MoE auxiliary loss or None), computed as the model's own forward,
        called through whatever wraps it (DDP, FSDP2, DeepSpeed: ``grpo_kernels.wrapped.inside_forward``), so
        that their hooks apply as in an ordinary forward. The hidden states are the backbone's
        (``heads.last_hidden_states``: a vision-language model's images merged in), the head's weight its
        effective one (a LoRA adapter on it folded in), its output transform in the loss's options."""
        inner = self.accelerator.unwrap_model(model)
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        T = inputs["completion_ids"].size(1)
        if not self._head_gathered:  # ZeRO-3: the loss reads the head's weight, never calling the head
            gathered_with(inner, base.get_output_embeddings().parameters())
            self._head_gathered = True

        def loss_in_forward(sequence):
            with self.accelerator.autocast():
                outputs = last_hidden_states(base, **sequence, output_router_logits=bool(self.aux_loss_enabled))
            hidden = outputs.last_hidden_state[:, -(T + 1) : -1]  # the positions that predict the completion
            weight, bias = head_weights(base, self.head_transform)
            out = self.grpo_loss(
                hidden, weight, inputs["completion_ids"], mask, inputs["advantages"], bias=bias, **loss_inputs
            )
            aux_loss = router_aux_loss(base, outputs, sequence["attention_mask"]) if self.aux_loss_enabled else None
            return out.loss, out, aux_loss  # the losses at the top level: the wrappers' backward hooks attach there

        loss, out, aux_loss = inside_forward(model, loss_in_forward, self._sequence(inputs), inner=inner)
        return dataclasses.replace(out, loss=loss), aux_loss

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        importance_weights = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            importance_weights = inputs["importance_sampling_ratio"]
        normalizer = None
        if LOSS_TYPE_REGISTRY[self.loss_type].takes_normalizer:
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        # TRL divides these losses by the accumulation steps: declared up front, the one-pass kernel
        # writes the gradient already scaled and the backward moves no extra byte.
        divided = LOSS_TYPE_REGISTRY[self.loss_type].divided_by_accumulation and mode == "train"
        if self._entropy_bonus_enabled:
            applied = self.entropy_coef
            if self._entropy_controller is not None:  # TRL's attributes hold the state its checkpoints save
                control = self._entropy_controller
                control.coef, control.last_world_entropy = self.entropy_coef, self._last_world_entropy
                applied = control.applied_coef()
            # TRL divides the entropy bonus by the accumulation steps in training whatever the loss type;
            # loss_scale does that for the types it divides, the coefficient for the others
            accumulation = self.current_gradient_accumulation_steps if mode == "train" and not divided else 1
            self.grpo_loss.update(entropy_coef=applied / accumulation)
        loss_inputs = dict(
            old_logps=inputs.get("old_per_token_logps"),
            ref_logps=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
            importance_weights=importance_weights,
            normalizer=normalizer,
            loss_scale=1.0 / self.current_gradient_accumulation_steps if divided else 1.0,
        )
        loss_inputs["sampling_logps"] = inputs.get("sampling_per_token_logps")  # the off-policy mask's sampler
        aux_loss = None
        if self.fused_lm_head:
            out, aux_loss = self._fused_head_loss(model, inputs, mask, loss_inputs)
        else:
            logits, aux_loss = self._completion_logits(model, inputs)
            out = self.grpo_loss(logits, completion_ids, mask, inputs["advantages"], **loss_inputs)
        self._log_metrics(out.metrics, mask, mode, inputs["advantages"].dim() == 1)
        if LOSS_TYPE_REGISTRY[self.loss_type].policy_term == "ppo_clip":
            self._log_clip_extremes(out.per_token_logps, inputs, mask, mode)
        if self._entropy_bonus_enabled:  # TRL's policy loss before the bonus, a plain mean over processes
            scale = loss_inputs["loss_scale"]
            policy_loss = out.metrics.get("policy_loss", out.loss.detach() / scale)  # (no bonus applied: the loss)
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        self._control_entropy(out.metrics, mask, mode)
        loss = out.loss
        if aux_loss is not None:  # MoE load balancing, scaled for accumulation as TRL scales it
            loss = loss + self.router_aux_loss_coef * aux_loss / (
                self.current_gradient_accumulation_steps if mode == "train" else 1.0
            )
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        return loss

    def _control_entropy(self, metrics, mask, mode: str) -> None:
        """TRL's adaptive rule at its points: each training micro-batch adds its entropy to the window,
        the optimizer-step boundary moves the coefficient (``grpo_kernels.entropy_control``)."""
        if not self._entropy_bonus_enabled:
            return
        if self._entropy_controller is not None and mode == "train":
            tokens = mask.sum().float()
            self._entropy_controller.observe(metrics["entropy"] * tokens.clamp(min=1.0), tokens)
            if self.accelerator.sync_gradients:
                self._entropy_controller.end_window(lambda t: self.accelerator.reduce(t, reduction="sum"))
                self.entropy_coef = self._entropy_controller.coef
                self._last_world_entropy = self._entropy_controller.last_world_entropy
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

    def _log_clip_extremes(self, logps, inputs, mask, mode: str) -> None:
        """TRL's ``clip_ratio/low_min`` and ``clip_ratio/high_max``: the smallest and largest share of clipped
        tokens in a sequence, over every process's sequences (a sequence without tokens is NaN and left out),
        from the clip flags of the call's detached log-probs (O(B * T))."""
        if self._clip_options is None:
            self._clip_options = self.grpo_loss.options.replace(
                beta=0.0,
                use_bias_correction_kl=False,
                compute_entropy=False,
                entropy_coef=0.0,
                top_entropy_quantile=1.0,
                off_policy_mask_threshold=None,
            )
        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        fmask = mask.to(logps.dtype)
        terms = per_token_terms(
            logps, fmask, advantages, inputs.get("old_per_token_logps"), None, None, self._clip_options
        )

        def per_sequence(flags):
            if flags.shape[1] == 1:  # sequence level: one flag a row
                return flags.float().squeeze(1)
            return (flags.float() * fmask).sum(-1) / fmask.sum(-1)

        for name, flags, extreme in (
            ("clip_ratio/low_min", terms.is_low_clipped, torch.min),
            ("clip_ratio/high_max", terms.is_high_clipped, torch.max),
        ):
            gathered = self.accelerator.gather(per_sequence(flags))
            scored = gathered[~torch.isnan(gathered)]
            value = extreme(scored).item() if scored.numel() else float("nan")
            self._metrics[mode][name].append(value)

    def _log_metrics(self, metrics, mask, mode: str, inputs_advantages_per_row: bool = True) -> None:
        """TRL's global means: each local mean weighted by its count (tokens, or rows for a per-row
        value: the clip ratios at sequence level, VESPO's phi with per-row advantages), summed over
        processes."""
        tokens = mask.sum().float()
        rows = torch.tensor(float(mask.shape[0]), device=mask.device)
        for name, value in metrics.items():
            if name == "policy_loss":  # not a token mean: logged by _compute_loss as TRL does
                continue
            # as objective.loss_metrics: clip flags are one per row at sequence level with per-row advantages
            per_row = inputs_advantages_per_row and (
                name.startswith(("clip_ratio", "cispo"))
                and self.importance_sampling_level == "sequence"
                or name.startswith("vespo/")
            )
            count = rows if per_row else tokens
            totals = self.accelerator.reduce(torch.stack([value * count.clamp(min=1.0), count]), reduction="sum")
            self._metrics[mode][name].append((totals[0] / totals[1].clamp(min=1.0)).item())


# the arguments' descriptions appended to the docstrings (the API reference's; argument_docs.py)
document_public(globals(), ["GRPOKernelsTrainer"], ADAPTER_ARGUMENTS)
