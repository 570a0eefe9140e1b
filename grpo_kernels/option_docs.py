"""The options' documentation, in one place: the options page's tables (docs/options.md, grouped by
``OPTION_GROUPS``; docs/hooks.py writes them into the site), the Modules' docstrings and the API reference's
argument descriptions (argument_docs.py) all come from here, and a test holds it to ``GRPOOptions``' fields.

Each entry: (names, default as shown, meaning in Markdown).
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable

# The loss options: GRPOOptions' fields (TRL's GRPOConfig names)
LOSS_OPTION_DOCS = (
    (
        ("loss_type",),
        '`"grpo"`',
        (
            "`grpo`, `bnpo`, `dr_grpo`, `dapo`, `luspo`, `cispo`, `sapo`, `vespo`: TRL's per-token terms and "
            "reductions (TRL's default is `dapo`). `vespo` is -phi(w) A log pi with phi(w) = e^lambda w^k "
            "e^(-lambda w) of the row's importance ratio (detached; the rollout ratio folds into w), reduced like"
            " dapo; its loss math runs in torch on the kernels' log-probs (3 S), its metric is "
            "`vespo/phi_seq_mean`. The other trainers' families, their loss math in torch on the kernels' "
            "log-probs likewise, each as verl 0.9 computes it: `dppo_tv`, `dppo_kl` (DPPO: -A sg(min(r, delta)) "
            "log pi on the tokens whose probability moved within the binary TV or KL threshold, `epsilon` for A <= "
            "0, `epsilon_high` for A > 0; metric `dppo/masked_mean`), `gpg` (-A log pi), `gmpo` (GMPO: the row's "
            "-A exp(mean of the log-ratios clipped to [-`epsilon`, `epsilon_high`] on the advantage's side), mean "
            "over rows), `dro` (-(A log pi - `dro_beta` (log pi - old)^2 / 2)), `clip_cov` and `kl_cov` (PPO's "
            "ratio with the tokens of high advantage x log-prob covariance left out or penalized; metrics "
            "`clip_cov/selected_mean`, `kl_cov/selected_mean`); reduced like dapo, `gmpo` like grpo"
        ),
    ),
    (
        ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
        "0.0002, 1.0, 5.0",
        (
            "Clip-Cov: that share of the active tokens (at least one), drawn at random (torch's default generator) "
            "among those PPO does not clip whose covariance (A - mean A)(log pi - mean log pi) is in (lb, ub), "
            "get no policy term (verl's names and defaults)"
        ),
    ),
    (
        ("kl_cov_ratio", "kl_cov_coef"),
        "0.0002, 1.0",
        (
            "KL-Cov: that share of the active tokens (at least one) with the largest covariance get "
            "`kl_cov_coef` x \\|log-ratio\\| added to -A r (verl's `kl_cov_ratio` and `ppo_kl_coef`)"
        ),
    ),
    (
        ("covariance_selection",),
        '`"batch"`',
        (
            "where Clip-Cov and KL-Cov pick their tokens: `batch`, over every process's tokens (torch.distributed's "
            "default group: the means, the count and the choice are the whole batch's); `micro_batch`, over the "
            "call's own, as verl does"
        ),
    ),
    (("dro_beta",), "None", "DRO's quadratic log-ratio penalty (required for `dro`)"),
    (
        ("cispo_ratio_min",),
        "None",
        (
            "`cispo`'s lower bound on its ratio before the stop-gradient (verl's CISPO: 1 - `clip_ratio_low`, "
            "with `epsilon_high` = 1 + `clip_ratio_high`); None, TRL's, bounds it above only. Set, the loss math "
            "runs in torch on the kernels' log-probs"
        ),
    ),
    (
        ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
        "2.0, 3.0, 3.0, 2.0",
        "VESPO's k and lambda for A >= 0 and A < 0 (TRL's names and defaults)",
    ),
    (("beta",), "0.0", "KL coefficient; 0 turns the KL term off (no reference log-probs needed)"),
    (("epsilon",), "0.2", "lower clip: ratio >= 1 - epsilon"),
    (("epsilon_high",), "= `epsilon`", "upper clip; for `cispo` the absolute cap on the ratio, as in TRL"),
    (("delta",), "None", "TRL's cap on the unclipped ratio (two-sided clipping); DPPO's cap on its ratio"),
    (("dual_clip",), "None", "verl / OpenRLHF constant c: for A < 0 the loss is at most -A * c (they use 3)"),
    (
        ("importance_sampling_level",),
        '`"token"`',
        '`"sequence"` is GSPO: one ratio per row, from the masked mean log-ratio',
    ),
    (("temperature",), "1.0", "log-probs of `logits / temperature` (the sampling temperature)"),
    (
        ("logit_scale", "logit_softcap"),
        "1.0, None",
        (
            "the model's head output transform, for logits or hidden states straight from the head: "
            "cap(logit_scale x) / temperature, cap(y) = logit_softcap tanh(y / logit_softcap) (no cap when None). "
            "Gemma 2 soft-caps at 30, Cohere scales by 0.0625, Granite by 1 / `logits_scaling`, ...: "
            "`grpo_kernels.heads.head_transform(model)` reads a model's (the TRL adapter and the thin trainer do). "
            "Not for logits a model's own forward already transformed (`model(...).logits`)"
        ),
    ),
    (("max_completion_length",), "None", "`dr_grpo`'s constant normalizer (required there)"),
    (
        ("aggregation",),
        '`"loss_type"`',
        (
            "how the per-token loss (KL term included) is reduced: `loss_type`, the loss type's own; `prompt_mean`, "
            "SkyRL's `loss_reduction`: each prompt's token mean, then the mean over the call's prompts (the call's "
            "`prompt_ids`; a token weighs 1 / (prompts x its prompt's active tokens)), for every loss type and "
            "backend (SkyRL's KL loss is a sequence mean apart, and its Clip-Cov / KL-Cov choose tokens by the "
            "scaled advantages: docs/loss-semantics.md)"
        ),
    ),
    (("use_bias_correction_kl",), "False", "KL term multiplied by the importance ratio (TRL)"),
    (
        ("sapo_temperature_pos", "sapo_temperature_neg"),
        "1.0, 1.05",
        "SAPO's soft-gate temperatures for A > 0 and A <= 0",
    ),
    (
        ("kl_estimator",),
        '`"k3"`',
        (
            "`k3` = exp(r) - r - 1 with r = ref - logp (unbiased, >= 0); `k1` = logp - ref; `k2` = (logp - ref)^2 / "
            "2; `k3+`, `k1+`: verl's straight-through `low_var_kl+` / `k1+`, the estimate's value with k2's gradient "
            "(logp - ref, unclamped)"
        ),
    ),
    (
        ("log_ratio_clamp",),
        "None",
        "clamp the log importance ratio (and k3's exponent) to [-c, c] before exp (verl, OpenRLHF: 20)",
    ),
    (("kl_clamp",), "None", "clamp the per-token KL to [-c, c] (verl, OpenRLHF: 10)"),
    (("compute_entropy",), "True", "the `entropy` metric, from the same pass"),
    (
        ("top_entropy_quantile",),
        "1.0",
        (
            "TRL's high-entropy mask: below 1, only active tokens whose entropy is at least the (1 - q) quantile "
            "of every process's active tokens (torch.distributed's default group) keep their policy term, and the"
            " entropy bonus acts on them only"
        ),
    ),
    (
        ("off_policy_mask_threshold",),
        "None",
        (
            "DeepSeek-V3.2's off-policy sequence mask, as TRL: a row keeps its policy term if its advantage is >="
            " 0 or its mean KL(sampler \\|\\| current) over active tokens is at most this; the sampler's log-probs "
            "are the call's `sampling_logps`, else `old_logps` (a NaN among them is no evidence)"
        ),
    ),
    (
        ("rollout_correction",),
        "None",
        (
            "the train / rollout mismatch correction, computed in the call from `sampling_logps` (the rollout "
            "engine's log-probs) against `old_logps` (else this call's own, detached): one of verl 0.9's "
            "`RolloutCorrectionConfig` presets by name (`decoupled_token_is`, `decoupled_seq_is`, "
            "`decoupled_token_icepop`, `decoupled_seq_is_rs`, `decoupled_geo_rs`, `decoupled_geo_rs_seq_tis`, "
            "`decoupled_geo_rs_token_tis`, `decoupled_k3_rs`, `decoupled_k3_rs_seq_tis`, `decoupled_k3_rs_token_tis`,"
            " `bypass_ppo_clip`, `bypass_ppo_clip_geo_rs`, `bypass_ppo_clip_k3_rs`, `disabled`) or config "
            "(`VerlRolloutCorrection`: TIS / IcePop weights per token or sequence, batch-normalized across "
            "processes, rejection by k1 / k2 / k3 per token or a sequence's sum, mean or max; metrics "
            "`rollout_corr/...`, verl's names); TRL's `vllm_importance_sampling_mode` (`token_truncate`, `token_mask`"
            ", `sequence_truncate`, `sequence_mask`; `TRLImportanceSampling` for its clip bounds; metrics "
            "`sampling/...`); OpenRLHF's `is_correction_*` (`OpenRLHFCorrection`; metrics `is_filter_ratio`, "
            "`vllm_kl`). The weights multiply the policy term; verl's rejections leave the loss's mask (its token "
            "counts too), TRL's and OpenRLHF's get weight 0. verl's bypass REINFORCE presets are refused: the verl "
            "adapter's `grpo_kernels_bypass_mode` runs them"
        ),
    ),
    (
        ("entropy_coef",),
        "0.0",
        (
            "TRL's entropy bonus: the loss less `entropy_coef` x the mean entropy over the active tokens, "
            "whatever the loss type's reduction; its gradient (dH/dz = -p (log p + H)) is fused into the one-pass"
            " kernel, the two-pass backward kernel, the lm_head's dlogits kernel and the torch paths, one more "
            "FMA a logit"
        ),
    ),
    (
        ("entropy_reduction",),
        '"token_mean"',
        (
            "how the entropy bonus is divided: `token_mean` (TRL) the mean over its tokens; `loss` as the loss is, by "
            "the token-count loss types' `normalizer` (else the active tokens): OpenRLHF's entropy loss, "
            "`aggregate_loss(entropy, mask, batch_num_tokens, dp_size)` (the `openrlhf` preset)"
        ),
    ),
)

# The Modules' and functions' call keywords that are not loss options (how the loss is computed)
CALL_KEYWORD_DOCS = (
    (
        ("backend",),
        '`"auto"`',
        (
            "`auto`: Triton on CUDA tensors, chunked torch on CPU; `triton` (on CPU needs `TRITON_INTERPRET=1` "
            "before triton is imported); `torch`"
        ),
    ),
    (("in_place_backward",), "False", "write dlogits into the logits' storage (see below)"),
    (
        ("one_pass",),
        "None",
        (
            "Triton, token level: True writes dlogits in the forward (2 S bytes), False runs the two-pass pair (3"
            " S); None takes the device sweep's measured winner for this GPU and vocabulary "
            "(`grpo_kernels/kernels/tuned.json`), else True"
        ),
    ),
    (("check_ids",), "True", "validate the token ids at active positions and a tensor normalizer (one host sync)"),
    (
        ("drop_last_position",),
        "False",
        (
            "the logits are [B, T + 1, V] (`logits_to_keep = T + 1`): the last position is dropped without a copy"
            " and its gradient is zero; saves the zero-fill and copy autograd makes for a sliced view (3 S bytes)"
        ),
    ),
)
# which of them each Module takes (the rest of its signature: options=, preset=, vocab_parallel_group=, ...)
LOGITS_KEYWORDS = ("backend", "in_place_backward", "one_pass", "check_ids", "drop_last_position")
HIDDEN_STATES_KEYWORDS = ("backend", "check_ids")


# The options page's groups, in its order: each entry (by its first name) in one group
OPTION_GROUPS = (
    (
        "Loss types and families",
        (
            "loss_type", "max_completion_length", "clip_cov_ratio", "kl_cov_ratio", "covariance_selection", "dro_beta",
            "cispo_ratio_min", "sapo_temperature_pos", "vespo_k_pos",
        ),
    ),
    ("Clipping and ratios", ("epsilon", "epsilon_high", "delta", "dual_clip", "importance_sampling_level",
                             "log_ratio_clamp")),
    ("KL", ("beta", "kl_estimator", "kl_clamp", "use_bias_correction_kl")),
    ("Entropy", ("compute_entropy", "entropy_coef", "entropy_reduction", "top_entropy_quantile")),
    ("Masks and rollout correction", ("off_policy_mask_threshold", "rollout_correction")),
    ("Aggregation", ("aggregation",)),
    ("Head transforms", ("temperature", "logit_scale")),
    ("Backend and schedule (call keywords)", ("backend", "one_pass", "in_place_backward", "check_ids",
                                              "drop_last_position")),
)  # fmt: skip


def option_names(entries: Iterable[tuple] = LOSS_OPTION_DOCS) -> tuple[str, ...]:
    return tuple(name for names, _, _ in entries for name in names)


def options_table() -> str:
    """The options tables (Markdown), one a group (``OPTION_GROUPS``) under its heading: the site's options page
    shows them (docs/hooks.py writes them where docs/options.md says ``<!-- options_table -->``)."""
    entries = {names[0]: (names, default, meaning) for names, default, meaning in LOSS_OPTION_DOCS + CALL_KEYWORD_DOCS}
    grouped = [first for _, firsts in OPTION_GROUPS for first in firsts]
    if sorted(grouped) != sorted(entries):
        raise KeyError(f"OPTION_GROUPS must hold each entry once: {sorted(set(entries) ^ set(grouped))}")
    parts = []
    for title, firsts in OPTION_GROUPS:
        lines = [f"## {title}", "", "| option | default | meaning |", "|---|---|---|"]
        for first in firsts:
            names, default, meaning = entries[first]
            lines.append(f"| {', '.join(f'`{n}`' for n in names)} | {default} | {meaning} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def docstring_options(keywords: tuple[str, ...]) -> str:
    """A Module docstring's option list: every loss option, then the Module's own ``keywords``."""
    text = (
        f"Options (TRL ``GRPOConfig`` names; docs/options.md says what each does): "
        f"{', '.join(option_names())}; plus {', '.join(f'``{k}``' for k in keywords)}."
    )
    return textwrap.fill(text, 96, subsequent_indent="    ")
