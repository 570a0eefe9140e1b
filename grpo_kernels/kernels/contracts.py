"""Host-kernel contracts that need no Triton: the values the host passes and the flag bits it reads back.

The kernel tier (``kernels/``) imports nothing of the front end; the front end builds what it hands the
launchers from these types (``GRPOOptions.kernel_loss``, ``TokenInputs``, ``LossTokens``) and reaches the launchers
through the package's plain imports (``grpo_kernels.kernels``).

The kernels (``kernels/token_math.py``, ``kernels/logits.py``) and the front end (``loss.py``) share these names; this
module imports nothing heavy, so ``import grpo_kernels`` and the CPU path work where Triton is absent.
"""

import functools
from typing import Any, NamedTuple

import torch


class TokenInputs(NamedTuple):
    """A loss's per-token inputs, None where absent: the mask, advantages, old and reference log-probs, the
    importance weights and what the kernels read of a kept set. The loss kernels read them as contiguous fp32 [N]
    (the launchers' keywords of the same names); the torch loss math (``objective.loss_from_logps``) in the sequence
    layout."""

    mask: Any | None = None
    advantages: Any | None = None
    old_logps: Any | None = None
    ref_logps: Any | None = None
    importance_weights: Any | None = None
    kept_lse: Any | None = None  # the sampler's kept set: its log-sum-exp, +inf where unused (``KeptTerms.lse``)
    kept_entropy: Any | None = None  # its entropy, where the entropy is the set's (``KeptTerms.entropy``)


NO_TOKEN_INPUTS = TokenInputs()  # a launcher's default: no per-token input (immutable, shared)


class OnePassGradient(NamedTuple):
    """What a one-pass launch writes besides the loss terms: dlogits of the reduced loss. ``weight`` is each
    token's weight in the reduced loss (fp32 [N]); ``entropy_weight`` each token's dLoss/dH, the entropy
    bonus's weight (fp32 [N], or None); ``out`` a [B, T, V] tensor with a unit last stride to write into (None:
    a new one), or ``in_place`` to write over the logits themselves."""

    weight: Any
    entropy_weight: Any | None = None
    out: Any | None = None
    in_place: bool = False


# The loss kernels' run-time scalars, in the order of their ``loss_scalars`` tuple (token_math.token_loss_and_grad).
LOSS_SCALARS = (
    "eps_low",
    "eps_high",
    "delta",
    "dual_clip",
    "beta",
    "log_ratio_clamp",
    "kl_clamp",
    "sapo_tau_pos",
    "sapo_tau_neg",
)

# LOSS_KIND values: which policy term the forward computes.
LOSS_NONE = 0  # log-probs (and entropy) only: token_logprobs and the sequence-level path
LOSS_PPO_CLIP = 1  # grpo, bnpo, dr_grpo, dapo, luspo (optionally delta and dual-clip)
LOSS_CISPO = 2
LOSS_SAPO = 3

# KL_KIND values
KL_K3 = 0
KL_K1 = 1
KL_K2 = 2

# Bits of LOSS_FLAGS, the loss kernels' one constexpr of optional features (a feature's presence, never its
# value: the values are run-time ``loss_scalars``). One integer folds at compile time like separate flags (checked
# with the AOT report) and a new feature is one bit, not a parameter of every loss kernel.
LOSS_FLAG_DELTA = 1  # TRL's cap on the unclipped ratio
LOSS_FLAG_DUAL_CLIP = 2  # verl / OpenRLHF's bound on negative advantages' loss
LOSS_FLAG_LOG_RATIO_CLAMP = 4  # clamp the log-ratio (and k3's exponent)
LOSS_FLAG_KL_CLAMP = 8  # clamp the per-token KL
LOSS_FLAG_BIAS_CORRECTION_KL = 16  # the KL term times the importance ratio
LOSS_FLAG_KL_STRAIGHT_THROUGH = 32  # the KL estimate's value with k2's gradient, log pi - log pi_ref (verl's "k3+")

# Bits of the int8 flags output, read by the clip-ratio metrics.
FLAG_LOW_CLIPPED = 1
FLAG_HIGH_CLIPPED = 2  # for cispo: ratio above the cap with a positive advantage


class KernelLoss(NamedTuple):
    """A loss as the launchers take it, built once per options object by the front end
    (``GRPOOptions.kernel_loss``); a launch without a loss (log-probs only) takes None. The kernel tier reads
    nothing else of the options.

    ``args``: the loss kernels' keyword arguments that come from the options alone: ``loss_scalars`` (the
    run-time scalars in ``LOSS_SCALARS`` order) and the constexprs (``LOSS_KIND``, ``KL_KIND`` and ``LOSS_FLAGS``,
    a bit set of ``LOSS_FLAG_*``). ``temperature``: the options' own (a launcher's ``temperature`` argument must
    agree with it); ``kernel_temperature`` and
    ``kernel_softcap``: what the kernels divide by and cap with (the head's scale folded in). ``with_kl``: the
    loss has a KL term. ``clip_metrics``: a ``CLIP_METRICS_*`` and ``clip_metric_count`` how many it logs."""

    args: dict
    temperature: float
    kernel_temperature: float
    kernel_softcap: float | None
    compute_entropy: bool
    with_kl: bool
    clip_metrics: int
    clip_metric_count: int


# The loss arguments of a launch without a loss: never read (LOSS_KIND is LOSS_NONE), but the kernels' signature
# takes them.
NO_LOSS_ARGS = {"loss_scalars": (0.0,) * len(LOSS_SCALARS), "LOSS_KIND": LOSS_NONE, "KL_KIND": KL_K3, "LOSS_FLAGS": 0}


# DIVISOR values of the token-weights kernel (kernels/reduce.py): what each token's mask is divided by
# in a loss type's reduction (objective.reduction_weights)
DIVISOR_ROW = 0  # rows x the token's row's active count, at least 1 (row_token_mean: grpo, sapo)
DIVISOR_TOTAL = 1  # the batch's active count, at least 1 (batch_token_mean; token_count without a normalizer)
DIVISOR_GIVEN = 2  # a number the host knows (constant, rows, a number normalizer) or a 0-d tensor normalizer
DIVISOR_SEQUENCE = 3  # one a sequence, fp32 [S] on the device (the prompt mean: prompts x the prompt's tokens)

# CLIP_METRICS values of the loss-metrics kernel: which clip metrics a policy term logs (options.LossType)
CLIP_METRICS_NONE = 0  # sapo
CLIP_METRICS_PPO = 1  # low, high and region (either), in that order
CLIP_METRICS_CISPO = 2  # the capped share (the high flag)


class KeptTokens(NamedTuple):
    """The sampler's kept set of each token (``grpo_kernels.kept_set.KeptSet``, checked, in the kernels' token
    order): ``ids`` int32 / int64, CSR [nnz] with ``offsets`` [N + 1], or padded [N, ``width``] (``offsets`` None, a
    negative id for no entry); ``add_target``: the target joins its set where the set lacks it (else such a token,
    and one with an empty set, takes the whole vocabulary); ``entropy_over_set``: the entropy is the set's
    distribution's (else the whole vocabulary's)."""

    ids: Any
    offsets: Any | None
    width: int
    add_target: bool
    entropy_over_set: bool


class KeptTerms(NamedTuple):
    """What a log-prob pass needs of each token's kept set, fp32 [N] (``kept_set.finish``): ``lse`` the log-sum-exp
    over the set, +inf where the token takes the whole vocabulary (no set, its fallback, a masked token);
    ``entropy`` the set's entropy (only with ``entropy_over_set``, else None); ``sum_squares`` the set's Σπ² (where
    asked, else None); ``found`` 1 where the target is in the set as given; ``target_x`` the target's x; ``x`` each
    entry's x (-inf where no entry), what the gradient's entries read."""

    lse: Any
    entropy: Any | None
    sum_squares: Any | None
    found: Any
    target_x: Any
    x: Any


class Sequences(NamedTuple):
    """Which tokens form which sequence: S rows of T tokens (token s T + t), or a packed batch's S sequences
    (``cu_seqlens`` [S + 1], flash-attention's convention; T unused)."""

    S: int
    T: int
    cu_seqlens: Any | None = None


class Reduction(NamedTuple):
    """How a loss reduces its per-token terms, as the token-weights kernel reads it (``objective.reduction_weights``
    times the loss scale; built by ``objective.kernel_reduction``): ``divisor_kind`` a ``DIVISOR_*``; ``divisor``
    the number (or 0-d tensor) of DIVISOR_GIVEN, the fp32 [S] tensor of DIVISOR_SEQUENCE; ``loss_scale`` a float
    or a 0-d tensor; ``entropy_coef`` the entropy bonus's (0: none), over ``bonus_mask``'s tokens (fp32 [N]; None:
    the mask's), divided by their count, or with ``entropy_as_loss`` by the loss's divisor (a token-count loss:
    OpenRLHF's entropy loss)."""

    divisor_kind: int
    divisor: object
    loss_scale: object
    entropy_coef: float = 0.0
    bonus_mask: Any | None = None
    entropy_as_loss: bool = False


class TokenWeights(NamedTuple):
    """What the token-weights kernel writes, fp32 [N], None where not asked for."""

    advantages: Any | None
    importance_weights: Any | None
    weight: Any | None  # each token's weight in the reduced, scaled loss
    entropy_weight: Any | None  # each token's dLoss/dH (the entropy bonus), or None without one


class LossTokens(NamedTuple):
    """A fused loss launch's per-token side: its ``TokenInputs`` as given (mask fp32 and old / reference
    log-probs fp32, each N contiguous elements; advantages and importance weights per token or per sequence,
    which the token-weights kernel writes per token), which tokens form which sequence, and the reduction."""

    tokens: TokenInputs
    sequences: Sequences
    reduction: Reduction


def rounds_head_logits(dtype: torch.dtype, fp32_logits: bool = False) -> bool:
    """Whether the fused head rounds h @ W^T + b to its inputs' dtype before the cap and the temperature, as an
    unfused head in that dtype computes its logits: 16-bit inputs (fp32 ones, head_precision="fp32" among them,
    have nothing to round), unless the head keeps its fp32 accumulator as the logit (``fp32_logits``:
    head_precision="fp32_logits", a rollout engine's fp32-output head). The kernels' ROUND_LOGITS, the torch path's
    and the vocabulary-parallel head's."""
    return dtype in (torch.bfloat16, torch.float16) and not fp32_logits


def fp32_products(fn):
    """``fn`` with autocast off: its products and sums are meant in fp32 (the lm_head's logits and gradients,
    accumulated in fp32; the torch path's row statistics, whose ``vecdot`` CPU autocast runs in bf16), which an
    ambient bf16 / fp16 autocast would silently cast down. The torch path and the lm_head's launchers use it."""

    @functools.wraps(fn)
    def without_autocast(*args, **kwargs):
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)

    return without_autocast
