"""The online log-sum-exp merge both kernel files use (``grpo.py``'s lanes, ``fused_linear.py``'s tiles and
vocabulary splits).

A log-sum-exp state is (max, sum exp(x - max), sum exp(x - max) x): the third sum is the entropy's,
H = lse - sum p x. Two states merge by rescaling both sums to the larger max. The per-logit update in
``grpo.py``'s row loop (``_lse_fold``) is the one special case kept apart: there the part is a single
logit, and one exp2 is both the rescale and the logit's own term, half the exponentials of a merge.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def finite_or_zero(m):
    """A running max as the exponent's offset: 0 while it is -inf (nothing, or only -inf logits, seen yet),
    so that exp(-inf - offset) is 0 and never exp(-inf - -inf) = NaN."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def merge_lse(running_max, sum_exp, sum_exp_x, part_max, part_sum, part_sum_x,
              COMPUTE_ENTROPY: tl.constexpr, BASE2: tl.constexpr):
    """Fold a part's state into the running one, elementwise: returns (max, sum exp, sum exp x).

    BASE2: the values are in base 2 (x log2(e), as ``grpo.py``'s row loop keeps them), so the
    rescale is exp2; else natural. Without COMPUTE_ENTROPY the third sum is passed through.
    """
    new_max = tl.maximum(running_max, part_max)
    offset = finite_or_zero(new_max)
    if BASE2:
        old_scale = tl.exp2(running_max - offset)
        part_scale = tl.exp2(part_max - offset)
    else:
        old_scale = tl.exp(running_max - offset)
        part_scale = tl.exp(part_max - offset)
    sum_exp = sum_exp * old_scale + part_sum * part_scale
    if COMPUTE_ENTROPY:
        sum_exp_x = sum_exp_x * old_scale + part_sum_x * part_scale
    return new_max, sum_exp, sum_exp_x
