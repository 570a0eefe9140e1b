"""Every public argument's description, in one place: ``document_public`` (run by ``grpo_kernels/__init__``)
appends an ``Args:`` section to each public function's docstring (and its Modules' ``__init__`` and ``forward``,
an ``Attributes:`` section to its dataclasses) from ``SHARED_ARGUMENTS`` and the function's own ``OWN_ARGUMENTS``,
so that the API reference lists each argument with its meaning and no two functions describe a shared keyword
twice. The loss options' meanings are ``option_docs``' (the options table's one source). A public argument
without a description fails at import.
"""

from __future__ import annotations

import inspect
import re

from .option_docs import CALL_KEYWORD_DOCS, LOSS_OPTION_DOCS

# The inputs and keywords the entry points share (Markdown, one sentence or two each)
SHARED_ARGUMENTS = {
    "logits": "[B, T, V] (any leading dims [..., V]; [B, T + 1, V] with `drop_last_position`; a packed [total, V] "
    "with `cu_seqlens`; a vocabulary slice with `vocab_parallel_group`): `logits[:, t]` predicts token t.",
    "hidden_states": "[B, T, H] (a packed [total, H] with `cu_seqlens`): the last hidden states whose lm_head logits "
    "predict the tokens; the [N, V] logits are never held.",
    "weight": "the lm_head's effective weight [V, H] (a vocabulary shard [V / P, H] with `vocab_parallel_group`).",
    "bias": "the lm_head's bias [V], or None.",
    "completion_ids": "[B, T] int: the sampled tokens; any value at masked positions (-100 included).",
    "ids": "[B, T] (any leading dims, as the logits' without V) int: the tokens whose log-probs are taken.",
    "completion_mask": "[B, T] bool / int / float: 1 where a token counts (a fraction weights it); masked tokens are "
    "never read.",
    "advantages": "[B] per sequence or [B, T] per token (a packed call's [S] or [total]).",
    "old_logps": "[B, T] fp32 log-probs of the policy that sampled; None is on-policy (ratio 1).",
    "ref_logps": "[B, T] log-probs of the reference model; required when `beta > 0`.",
    "importance_weights": "[B], [B, 1] or [B, T]: the rollout correction's weights on the policy term, or None.",
    "normalizer": "the token count dapo / cispo / vespo divide by (a number or a 0-d tensor; default: this call's "
    "active tokens).",
    "options": "a `GRPOOptions` (instead of option keywords).",
    "option_kwargs": 'the loss options by TRL\'s names (`beta=0.04`, `loss_type="dapo"`, ...): the options table.',
    "loss_scale": "a number or a 0-d tensor multiplying the returned loss (e.g. 1 / gradient-accumulation steps), "
    "folded into the one-pass gradient.",
    "sampling_logps": "[B, T] the rollout engine's log-probs (for `off_policy_mask_threshold` and "
    "`rollout_correction`), or None.",
    "cu_seqlens": "[S + 1] int32 / int64 (flash-attention's convention): a packed batch's sequence offsets; the "
    "result is the padded layout's.",
    "vocab_parallel_group": "a torch.distributed ProcessGroup over which the vocabulary is split (Megatron's "
    "layout): the logits or weight are this rank's slice, the ids global.",
    "vocab_start_index": "with `vocab_parallel_group`: this rank's first vocabulary id (default: Megatron's equal "
    "partitions).",
    "reduce_hidden_grad": "with `vocab_parallel_group` and hidden states: True (default), this op all-reduces "
    "d hidden over the group (hidden states the same on every rank, nothing else reducing them); False, it returns "
    "this rank's share for the caller's mapping to sum (Megatron's `gather_from_sequence_parallel_region` or "
    "`copy_to_tensor_model_parallel_region`).",
    "context_parallel_group": "a torch.distributed ProcessGroup over which each sequence is split (Megatron's context "
    "parallelism): this rank's tokens of every sequence; the loss and metrics are the whole sequences' on every rank.",
    "prompt_ids": "[B] (a packed call's [S]) int: each sequence's prompt, for `aggregation=\"prompt_mean\"`.",
    "kept_set": "a `KeptSet`: the sampler's kept ids of each token (top-k / top-p replay); each log-prob is taken "
    "over its token's set.",
    "temperature": "the sampling temperature: the log-probs are those of cap(logits) / temperature.",
    "logit_scale": "the head's output scale (a model's `logit_scale`): logits x this before the cap.",
    "logit_softcap": "the head's soft-cap c (a model's `final_logit_softcapping`): c tanh(x / c); None: no cap.",
    "head_precision": '"input" (the unfused head in the operands\' dtype, its logits rounded once to it), '
    '"fp32_logits" (the same operands, the fp32 accumulator kept as the logit: an fp32-output head) or "fp32" (the '
    "head in fp32).",
    "lm_head_mode": 'the fused head\'s schedule: "recompute" (4 products) or "three_products"; None takes the '
    "measured choice.",
    "return_entropy": "also return each token's entropy (from the same pass).",
    "return_sum_pi_squared": "also return each token's sum of squared probabilities (from the same pass), last.",
    "preset": 'a trainer\'s defaults by name ("trl", "verl", "openrlhf"), the keywords overriding them.',
    "backend": '"auto" (Triton on CUDA tensors, the chunked torch path on CPU), "triton" or "torch".',
    "check_ids": "check the ids at active positions (one host sync); False skips it.",
    "in_place_backward": "write the gradient into the logits' own storage (not for a leaf).",
    "drop_last_position": "the logits are [B, T + 1, V] (a model's output with `logits_to_keep = T + 1`): the last "
    "position is never read and gets a zero gradient.",
    "one_pass": "Triton, token level: True writes the gradient in the forward (2 S), False runs two passes (3 S); "
    "None: the measured choice.",
    "rewards": "[B] the completions' rewards (correct: 1).",
    "teacher_ids": "[..., K] int: the teacher's K ids a token (its top-k), global; shaped as the completion mask "
    "plus K.",
    "teacher_logps": "the teacher's log-probs: [..., K] at `teacher_ids` (top-k), or [B, T] at the sampled tokens "
    "(reverse KL).",
}
# the option keywords are the options table's
for _names, _default, _meaning in LOSS_OPTION_DOCS + CALL_KEYWORD_DOCS:
    for _name in _names:
        SHARED_ARGUMENTS.setdefault(_name, f"{_meaning} (default {_default}).")
_IGNORED = {"self", "cls"}


def described(fn, own: dict) -> dict:
    """Each of ``fn``'s parameters with its description (``own`` first, then ``SHARED_ARGUMENTS``); a parameter
    with neither raises."""
    out = {}
    for name, parameter in inspect.signature(fn).parameters.items():
        if name in _IGNORED:
            continue
        text = own.get(name, SHARED_ARGUMENTS.get(name))
        if not text:
            raise KeyError(f"{fn.__qualname__}: argument {name!r} has no description (argument_docs)")
        shown = {parameter.VAR_KEYWORD: f"**{name}", parameter.VAR_POSITIONAL: f"*{name}"}.get(parameter.kind, name)
        out[shown] = text
    return out


def documented(**own: str):
    """Append an ``Args:`` section to the decorated function's docstring: every parameter's description, its own
    (``own``) or the shared one."""

    def decorate(fn):
        lines = ["", "Args:"]
        for name, text in described(fn, own).items():
            lines.append(f"    {name}: {_one_line(text)}")
        doc = inspect.cleandoc(fn.__doc__ or "")
        fn.__doc__ = doc + "\n" + "\n".join(lines) + "\n"
        return fn

    return decorate


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


# What an argument means where it means something of its own (by the public name, then the argument)
OWN_ARGUMENTS = {
    "grpo_loss": {},
    "token_logprobs": {"logits": SHARED_ARGUMENTS["logits"]},
    "linear_token_logprobs": {},
    "linear_selective_log_softmax": {},
    "linear_selective_log_softmax_and_entropy": {},
    "selective_log_softmax": {},
    "selective_log_softmax_and_entropy": {},
    "token_entropy": {"logits": "[..., V]: the entropy of softmax(cap(logits) / temperature) at each position."},
    "sft_loss": {"logits": SHARED_ARGUMENTS["logits"] + " With `weight=`, the hidden states [B, T, H]."},
    "rft_loss": {"logits": SHARED_ARGUMENTS["logits"] + " With `weight=`, the hidden states [B, T, H]."},
    "dpo_loss": {
        "logits": "[2B, T, V]: the chosen rows, then the rejected rows (with `weight=`, hidden states [2B, T, H]).",
        "ref_logps": "[2B, T]: the reference model's log-probs of the same rows.",
        "beta": "DPO's beta: the implicit reward's scale.",
    },
    "reward_model_loss": {
        "r_chosen": "[B] the reward model's scores of the chosen completions.",
        "r_rejected": "[B] its scores of the rejected ones.",
        "margin": "[B] a margin the chosen must win by (Llama 2's), or None.",
        "center_rewards_coefficient": "TRL's centering term's weight on (r_chosen + r_rejected)^2, or None.",
    },
    "grpo_loss_reference": {
        "logits": "[B, T, V] (fp64 keeps the specification exact).",
    },
    "topk_logprobs": {"teacher_ids": "[..., K] int: the ids whose log-probs are taken, K a token."},
    "topk_distillation_loss": {},
    "fused_linear_topk_distillation_loss": {},
    "reverse_kl_distillation_loss": {
        "logits": SHARED_ARGUMENTS["logits"] + " With `weight=`, the hidden states [B, T, H].",
        "teacher_logps": "[B, T]: the teacher's log-probs of the sampled tokens.",
    },
    "reverse_kl_advantages": {
        "student_logps": "[B, T]: the student's log-probs of the sampled tokens (read detached).",
        "teacher_logps": "[B, T]: the teacher's log-probs of the same tokens.",
        "estimator": "verl's kl_penalty: kl / k1 (verl's recommendation here), abs, mse / k2, low_var_kl / k3.",
    },
}
for _name in (
    "topk_distillation_loss",
    "fused_linear_topk_distillation_loss",
    "reverse_kl_distillation_loss",
    "reverse_kl_advantages",
):
    OWN_ARGUMENTS[_name] = {  # (a function's own description first)
        **{
            "convention": '"verl" (verl\'s forward_kl_topk) or "trl" (TRL\'s top-k divergence).',
            "log_prob_min_clamp": "verl: both sides' log-probs clamped below at this (None: no clamp).",
            "loss_max_clamp": "verl: each token's loss clamped to +-this (None: no clamp).",
            "loss_agg_mode": "verl's reduction: token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean, "
            "seq-mean-token-sum-norm (verl's default token-mean; TRL's convention has its own).",
            "add_tail": "TRL: the leftover mass as one more bucket on both sides (else both renormalized over K).",
            "alpha": "TRL's generalized divergence: 0 the forward KL, 1 the reverse, between them the mixture's.",
            "dp_size": "verl's global_batch_info: the data-parallel size the token mean is scaled by.",
            "batch_num_tokens": "verl's global_batch_info: the token count of the whole batch (default: this call's).",
            "global_batch_size": "verl's global_batch_info: the sequence count of the whole batch (default: this "
            "call's non-empty ones).",
            "loss_scale_factor": "verl's loss_scale_factor: seq-mean-token-sum-norm's divisor (default: the padded "
            "width, T; a packed call has none, and takes its longest sequence: pass verl's loss_scale_factor, or the "
            "response width its batch was padded to, for verl's number).",
            "compute_overlap": "verl's overlap metrics, from the student's own top-k (one more read of the logits; "
            "from hidden states, of [chunk, V] products).",
            "estimator": "verl's kl_penalty: kl / k1, abs, mse / k2, low_var_kl / k3 (k1 is refused as a supervised "
            "loss, as verl refuses it).",
        },
        **OWN_ARGUMENTS[_name],
    }
MODULE_ARGUMENTS = {
    "GRPOLoss": {},
    "FusedLinearGRPOLoss": {},
    "TopKDistillationLoss": {
        "settings": "`topk_distillation_loss`'s keywords, held.",
        "call": "per-call keywords (`cu_seqlens`, ...), over the held ones.",
    },
    "FusedLinearTopKDistillationLoss": {
        "settings": "`fused_linear_topk_distillation_loss`'s keywords, held.",
        "call": "per-call keywords (`cu_seqlens`, ...), over the held ones.",
    },
}


DATACLASS_FIELDS = {
    "KeptSet": {
        "ids": "CSR int [nnz] (ascending within a token) with `offsets`, or padded [..., K] (-1: no entry); global "
        "ids.",
        "offsets": "CSR int64 [N + 1] (vLLM's), or None for the padded form.",
        "outside": 'a target outside its set, or an empty set: "vocabulary" (prime-rl\'s: the whole vocabulary) '
        'or "add_target" (slime\'s: the set plus the target).',
        "entropy": 'the entropy\'s distribution: "vocabulary" (both trainers\') or "set".',
    },
    "DistillationOutput": {
        "loss": "the reduced loss (differentiable).",
        "metrics": "the convention's metrics, 0-d tensors (detached).",
        "per_token_loss": "each token's loss as the reduction reads it, 0 at masked tokens.",
    },
    "GRPOLossOutput": {
        "loss": "the reduced loss (differentiable), times `loss_scale`.",
        "metrics": "TRL's metrics (and the policy terms' and rollout correction's), 0-d tensors.",
        "per_token_logps": "[B, T] fp32 log-probs of the current policy, detached, 0 at masked tokens.",
    },
    "VerlRolloutCorrection": {
        "rollout_is": 'the importance weights\' level: "token", "sequence" or None (none).',
        "rollout_is_threshold": "the weights' truncation: a number (upper), or \"low_high\" (TIS) / IcePop's form.",
        "rollout_is_batch_normalize": "normalize the weights to mean 1 over the batch (every process's).",
        "rollout_rs": "the rejection sampling: verl's k1 / k2 / k3 statistics per token or a sequence's sum, mean or "
        "max, or None.",
        "rollout_rs_threshold": "the rejection's bounds, verl's form.",
        "bypass_mode": "the sampler's log-probs as the old ones (verl's bypass).",
        "loss_type": "\"ppo_clip\" (verl's bypass REINFORCE is the verl adapter's).",
    },
    "TRLImportanceSampling": {
        "vllm_importance_sampling_mode": "token_truncate, token_mask, sequence_truncate or sequence_mask (TRL's).",
        "vllm_importance_sampling_clip_max": "the ratio's upper bound (TRL's 3.0), or None.",
        "vllm_importance_sampling_clip_min": "the ratio's lower bound, or None.",
    },
    "OpenRLHFCorrection": {
        "is_correction_level": '"token" or "seq" (a sequence\'s mean statistic).',
        "is_correction_mode": '"mask" (zero the units outside the bounds) or "clip" (clamp the ratio).',
        "is_correction_gating": 'the statistic gated: "ratio", "binary_kl" or "tv".',
        "is_correction_threshold": "(low, high): the bounds.",
    },
}


# The trainer adapters' public functions and classes: their arguments are the trainers' own (their names)
ADAPTER_ARGUMENTS = {
    "kl_loss": {
        "log_prob": "[B, T] the current policy's log-probs (verl's).",
        "ref_log_prob": "[B, T] the reference policy's.",
        "response_mask": "[B, T] verl's response mask.",
        "kl_penalty": "verl's estimator: low_var_kl / k3, kl / k1, mse / k2, each with an optional '+' "
        "(straight-through).",
        "loss_agg_mode": "verl's loss_agg_mode.",
        "global_batch_info": "verl's global_batch_info (dp_size, batch_num_tokens, global_batch_size), or None.",
    },
    "compute_forward_kl_topk": {
        "student_logits": "[bsz, seqlen / sp, V] the student's logits, already divided by the temperature.",
        "teacher_topk_log_probs": "the teacher's top-k log-probs, a nested tensor (verl's \"thd\").",
        "teacher_topk_ids": "the teacher's top-k ids, a nested tensor.",
        "config": "verl's DistillationConfig (its distillation_loss's log_prob_min_clamp).",
        "data_format": 'verl\'s "thd" or "bshd" (the outputs are per token either way).',
    },
    "PolicyLoss": {
        "clip_eps_low": "OpenRLHF's clip below: ratio >= 1 - this.",
        "clip_eps_high": "OpenRLHF's clip above: ratio <= 1 + this.",
        "dual_clip": "OpenRLHF's dual-clip constant c (for A < 0 the loss is at most -A c), or None.",
        "token_level_loss": "OpenRLHF's token-level aggregation (True) or its sequence mean (False).",
        "policy_loss_type": 'OpenRLHF\'s "ppo" or "gspo".',
        "is_correction_level": 'OpenRLHF\'s rollout correction level: "token", "seq" or "off" (none).',
        "is_correction_mode": '"mask" or "clip".',
        "is_correction_gating": '"ratio", "binary_kl" or "tv".',
        "is_correction_threshold": "(low, high) bounds of the gate.",
        "log_probs": "[B, T] the current policy's log-probs.",
        "old_log_probs": "[B, T] the sampling policy's (OpenRLHF's old ones).",
        "advantages": "[B, T] OpenRLHF's advantages.",
        "action_mask": "[B, T] OpenRLHF's action mask, or None (every token).",
        "rollout_log_probs": "[B, T] the rollout engine's log-probs (the correction's), or None.",
        "dp_size": "the data-parallel size (OpenRLHF's token-count aggregation).",
        "batch_num_tokens": "the whole batch's token count (OpenRLHF's), or None (this call's).",
        "global_batch_size": "the whole batch's sequence count, or None.",
    },
    "compute_approx_kl": {
        "log_probs": "[B, T] the current policy's log-probs.",
        "log_probs_base": "[B, T] the reference's.",
        "log_probs_old": "[B, T] the old policy's (the unbiased gradient's ratio), or None.",
        "kl_estimator": "OpenRLHF's k1, k2 or k3.",
        "unbiased_gradient": "OpenRLHF's importance-weighted KL gradient (needs log_probs_old).",
    },
    "vocab_parallel_cross_entropy": {
        "vocab_parallel_logits": "[*target.shape, V / TP] this rank's columns of the logits (Megatron's order).",
        "target": "[s, b] the token ids (Megatron's layout; any shape the logits' leading dims match), in [0, V).",
        "label_smoothing": "0.0 only (Megatron's smooths over each rank's own columns: refused).",
    },
    "vocab_parallel_logprobs_and_entropy": {
        "vocab_parallel_logits": "[*target.shape, V / TP] this rank's columns of the logits (Megatron's order).",
        "target": "[s, b] the token ids, in [0, V).",
        "temperature": "the logits are divided by it (the sampler's temperature).",
    },
    "output_layer_logprobs": {
        "output_layer": "Megatron's ColumnParallelLinear output layer (this rank's V / TP rows of the head).",
        "hidden_states": "[s, b, H] as the output layer takes them ([s / TP, b, H] with sequence parallelism).",
        "target": "[s, b] the token ids, in [0, V).",
        "temperature": "the logits are divided by it (the sampler's temperature).",
        "weight": "a weight to use instead of the layer's own (tied embeddings), or None.",
        "compute_entropy": "also return each token's entropy: (log-probs, entropy).",
    },
    "ray_runtime_env": {"runtime_env": "a Ray runtime_env to extend (None: a new one)."},
    "GRPOKernelsTrainer": {
        "args": "TRL's GRPOTrainer's positional arguments (model, reward_funcs, its GRPOConfig, ...).",
        "fused_lm_head": "the loss from hidden states and the head (None: where the model's head transform is exact).",
        "kwargs": "TRL's GRPOTrainer's keyword arguments (args: the GRPOConfig, train_dataset, ...).",
    },
}


def document_public(namespace: dict, names, own: dict | None = None) -> None:
    """Append the argument sections to the public names' docstrings (``names`` in ``namespace``): a function's
    ``Args:``, a class's ``__init__`` and ``forward`` ones, a dataclass's ``Attributes:`` (its fields). ``own``: the
    names' own argument tables (default: the package's, ``OWN_ARGUMENTS`` and ``MODULE_ARGUMENTS``)."""
    import dataclasses

    for name in names:
        obj = namespace[name]
        table = own.get(name) if own is not None else None
        if inspect.isfunction(obj) or inspect.isfunction(getattr(obj, "__wrapped__", None)):
            _append_args(obj, table if table is not None else OWN_ARGUMENTS.get(name, {}))
        elif table is not None or name in MODULE_ARGUMENTS:
            for method in ("__init__", "forward"):
                if method in vars(obj):
                    _append_args(getattr(obj, method), table if table is not None else MODULE_ARGUMENTS[name])
        elif dataclasses.is_dataclass(obj):
            fields = DATACLASS_FIELDS.get(name, {})
            lines = ["", "Attributes:"]
            for field in dataclasses.fields(obj):
                text = fields.get(field.name, SHARED_ARGUMENTS.get(field.name))
                if not text:
                    raise KeyError(f"{name}: field {field.name!r} has no description (argument_docs)")
                lines.append(f"    {field.name}: {_one_line(text)}")
            obj.__doc__ = inspect.cleandoc(obj.__doc__ or "") + "\n" + "\n".join(lines) + "\n"


def _append_args(fn, own: dict) -> None:
    if "\nArgs:\n" in (fn.__doc__ or ""):
        return  # (imported twice: once)
    documented(**own)(fn)
