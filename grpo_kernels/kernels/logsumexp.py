"""The online log-sum-exp merge both kernel files use (``logits.py``'s lanes, ``fused_linear.py``'s tiles and
vocabulary splits).

A log-sum-exp state is (max, sum exp(x - max), sum exp(x - max) x): the third sum is the entropy's,
H = lse - sum p x. A state is moved to a larger max by rescaling its sums (``rescale_lse``: how
``logits.py`` brings its lanes to the row's max); two states merge by moving both to the larger max
(``merge_lse``: ``fused_linear.py``'s tiles and vocabulary splits). The per-logit update in
``token_math.py``'s row loop (``lse_fold``) is the one special case kept apart: there the part is a single
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
def rescale_lse(state_max, sum_exp, sum_exp_x, to_max, COMPUTE_ENTROPY: tl.constexpr, BASE2: tl.constexpr):
    """A state's two sums re-expressed at a max ``to_max`` >= its own (finite): both times exp(max - to_max).

    BASE2: the values are in base 2 (x log2(e), as ``logits.py``'s row loop keeps them), so the factor is
    exp2; else natural. Without COMPUTE_ENTROPY the third sum is passed through."""
    if BASE2:
        scale = tl.exp2(state_max - to_max)
    else:
        scale = tl.exp(state_max - to_max)
    if COMPUTE_ENTROPY:
        sum_exp_x = sum_exp_x * scale
    return sum_exp * scale, sum_exp_x


@triton.jit
def merge_lse(
    running_max, sum_exp, sum_exp_x, part_max, part_sum, part_sum_x, COMPUTE_ENTROPY: tl.constexpr, BASE2: tl.constexpr
):
    """Fold a part's state into the running one, elementwise: returns (max, sum exp, sum exp x)."""
    new_max = tl.maximum(running_max, part_max)
    offset = finite_or_zero(new_max)
    sum_exp, sum_exp_x = rescale_lse(running_max, sum_exp, sum_exp_x, offset, COMPUTE_ENTROPY, BASE2)
    part_sum, part_sum_x = rescale_lse(part_max, part_sum, part_sum_x, offset, COMPUTE_ENTROPY, BASE2)
    if COMPUTE_ENTROPY:
        sum_exp_x = sum_exp_x + part_sum_x
    return new_max, sum_exp + part_sum, sum_exp_x


@triton.jit
def merge_sum_squares(running_max, sum_sq, part_max, part_sq):
    """A part's sum exp(2 (x - part_max)) folded into the running one, both moved to the larger max (natural units:
    the fused head's tiles and splits; Σπ² is that sum over (sum exp(x - max))^2)."""
    offset = finite_or_zero(tl.maximum(running_max, part_max))
    return sum_sq * tl.exp(2.0 * (running_max - offset)) + part_sq * tl.exp(2.0 * (part_max - offset))
