"""Autograd Functions over the kernels. They return per-token results; reductions live outside.

From logits, one backward formula (``dlogits = g * (onehot - p) / tau``):

- ``FusedTokenLoss`` (Triton, token-level importance sampling): the forward kernel also
  computes each token's loss and ``dloss/dlogp``; the backward only multiplies by the
  incoming gradient of the per-token loss.
- ``TokenLogprobs`` (Triton or the chunked torch path): per-token log-probs, with the loss
  math done by autograd on [B, T] tensors (sequence-level importance sampling, and the
  CPU path). Its backward receives ``g = dLoss/dlogp`` directly.
- ``FusedTokenLossOnePass``: ``FusedTokenLoss`` that also writes dlogits in the forward.

From hidden states and the lm_head weight (no [N, V] logits kept), the same split:
``FusedLinearTokenLoss`` (Triton, token level, loss math in the kernel) and
``LinearTokenLogprobs`` (log-probs only; Triton or torch).

In-place backward (opt-in): the gradient is written into the logits' own storage and
the storage's version counter is bumped, so any other autograd node that saved these
logits and runs its backward later fails with PyTorch's "modified by an inplace
operation" error instead of silently reading the gradient. After backward the logits
tensor holds the gradient: do not read it as logits again.
"""

from __future__ import annotations

from typing import Optional

import torch

from .backends import get_backend
from .kernels.contracts import LossTokens, OnePassGradient, launch_module, lm_head_launch_module, reduce_launch_module
from .options import GRPOOptions


def _first_backward(ctx, what: str) -> None:
    """The Functions that hand the forward's gradient to the backward can do so once."""
    if getattr(ctx, "backward_done", False):
        raise RuntimeError(
            f"{what} computed its gradient in the forward and handed it to the first backward (scaled in place "
            "there), so a second backward through a retained graph would read a used gradient; to "
            "backpropagate more than once, use the two-pass path (GRPOLoss(one_pass=False), "
            "lm_head_mode='recompute')"
        )
    ctx.backward_done = True


def flat_f32(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A per-token tensor as the kernels read it: contiguous fp32 [N] (fp64 stays fp64: the torch path's
    gradcheck precision; None stays None)."""
    if t is None:
        return None
    return t.reshape(-1).to(torch.float64 if t.dtype == torch.float64 else torch.float32).contiguous()


def _input_grads(ctx, *grads) -> tuple:
    """A backward's return: the given gradients of the first inputs, None for every later forward input."""
    return grads + (None,) * (len(ctx.needs_input_grad) - len(grads))


def aligned(logits: torch.Tensor, drop_last_position: bool) -> torch.Tensor:
    """The [B, T, V] logits that predict the completion: ``logits[:, :-1]`` of a [B, T + 1, V] input
    (the model's last position predicts no completion token), else the input itself."""
    return logits[:, :-1] if drop_last_position else logits


def gradient_buffer(logits: torch.Tensor, drop_last_position: bool, in_place: bool):
    """(the gradient returned for ``logits``, the [B, T, V] view of it that the kernels write).

    For a [B, T + 1, V] input the gradient is allocated at that shape, its last position
    zeroed (B x V elements) and the kernels write the rest directly: no [B, T, V] gradient is
    copied into a zero-filled [B, T + 1, V] one afterwards, as autograd does for a sliced view.
    In place, the logits' own storage is the gradient.
    """
    grad = logits if in_place else torch.empty(logits.shape, device=logits.device, dtype=logits.dtype)
    if drop_last_position:
        grad[:, -1].zero_()
    return grad, aligned(grad, drop_last_position)


def _write_gradient(ctx, logits, ids, lse, g, h=None, entropy=None):
    """The shared backward: dlogits from g = dLoss/dlogp (and h = dLoss/dH with the entropy H, when the
    loss uses the entropy), by the backend the forward used.

    ``logits`` is the Function's input ([B, T, V], or [B, T + 1, V] when ``ctx.drop_last_position``)."""
    grad, written = gradient_buffer(logits, ctx.drop_last_position, ctx.in_place)
    get_backend(ctx.backend).logprobs_backward(aligned(logits, ctx.drop_last_position), ids, lse, g, ctx.temperature,
                                               out=written, grad_entropy=h, entropy=entropy, softcap=ctx.softcap)
    if ctx.in_place:
        torch.autograd.graph.increment_version(logits)
    return grad


def _loss_outputs(ctx, loss, metrics, logp, shape) -> tuple:
    """A fused loss Function's outputs: the loss (differentiable), the metrics vector and the log-probs shaped
    ``shape`` (neither differentiable)."""
    logp = logp.view(shape)
    ctx.mark_non_differentiable(metrics, logp)
    return loss, metrics, logp


def _weighted_dloss(grad_loss, weights, dloss_dlogp, entropy_weight):
    """(g = dLoss/dlogp, h = dLoss/dH or None) of a two-pass Function's backward: the per-token derivative and
    the entropy bonus's weight, each times the token's weight and the incoming gradient."""
    g = grad_loss * weights * dloss_dlogp
    return g, None if entropy_weight is None else grad_loss * entropy_weight


class FusedTokenLoss(torch.autograd.Function):
    """Triton, two passes: the forward kernel computes each token's loss and dLoss/dlogp, the loss-metrics
    kernel reduces them; the backward kernel writes dlogits = g (onehot - p) / tau, g = dLoss/dlogp times the
    token's weight and the incoming gradient. Returns (loss, metrics vector, log-probs [B, T])."""

    @staticmethod
    def forward(ctx, logits, ids, loss_tokens: LossTokens, opts: GRPOOptions, in_place: bool,
                drop_last_position: bool = False):
        ctx.set_materialize_grads(False)
        predicting = aligned(logits, drop_last_position)
        r = launch_module().loss_forward(predicting, ids, kernel_loss=opts.kernel_loss, loss_tokens=loss_tokens)
        ctx.save_for_backward(logits, ids, r.result.lse, r.result.dloss_dlogp, r.result.entropy, r.weights.weight,
                              r.weights.entropy_weight)
        ctx.backend, ctx.in_place = "triton", in_place
        ctx.temperature, ctx.softcap = opts.kernel_temperature, opts.kernel_softcap
        ctx.drop_last_position = drop_last_position
        return _loss_outputs(ctx, r.loss, r.metrics, r.result.logp, predicting.shape[:2])

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        logits, ids, lse, dloss_dlogp, entropy, weight, entropy_weight = ctx.saved_tensors
        if grad_loss is None or not ctx.needs_input_grad[0]:
            return _input_grads(ctx)
        g, h = _weighted_dloss(grad_loss, weight, dloss_dlogp, entropy_weight)
        return _input_grads(ctx, _write_gradient(ctx, logits, ids, lse, g, h, entropy))


class FusedTokenLossOnePass(torch.autograd.Function):
    """Triton, token-level: the forward kernel also writes dlogits of the reduced loss.

    Each token's weight in the reduction (the token-weights kernel's) is known before the logits
    kernel runs, so dLoss/dlogp is known as each row is streamed and the gradient is written in the
    same program (2 x S bytes of HBM traffic instead of 3 x S). The Function returns the scalar loss
    (with the metrics vector and the log-probs); its backward reads no logits: it returns the saved
    gradient, scaled in place by the incoming gradient (a device-side no-op when that is 1). A caller
    that knows its scale (gradient accumulation) folds it into the weights instead (``loss_scale``).
    """

    @staticmethod
    def forward(ctx, logits, ids, loss_tokens: LossTokens, opts: GRPOOptions, drop_last_position: bool = False):
        ctx.set_materialize_grads(False)
        predicting = aligned(logits, drop_last_position)
        grad = torch.empty(logits.shape, device=logits.device, dtype=logits.dtype)
        # the [B, T + 1, V] gradient itself as the kernels' [B, T, V] output: its first T positions, same strides
        r = launch_module().loss_forward(predicting, ids, kernel_loss=opts.kernel_loss, loss_tokens=loss_tokens,
                                         gradient_out=grad, dropped_gradient=grad if drop_last_position else None)
        ctx.save_for_backward(grad)
        return _loss_outputs(ctx, r.loss, r.metrics, r.result.logp, predicting.shape[:2])

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        _first_backward(ctx, "the one-pass GRPO loss")
        (grad,) = ctx.saved_tensors
        if grad_loss is None:  # the loss is not part of what is differentiated
            return _input_grads(ctx)
        # In place, with the scale read on the device: no host sync, no second [B, T, V] tensor,
        # and no pass over the gradient at all when grad_loss is 1 (a plain loss.backward()).
        launch_module().scale_in_place(grad, grad_loss)
        return _input_grads(ctx, grad)


class TokenLogprobs(torch.autograd.Function):
    """log softmax(cap(logits) / tau)[ids] (and entropy), by the Triton kernel or the torch path; ``softcap`` None: no
    cap (``backends``).

    ``mask`` (fp32 [N] or None): log-prob and entropy are 0 where it is 0, as in the fused
    kernel, which never reads those rows. Returns (logp [B, T], entropy [B, T] or None, and the
    log-sum-exp fp32 [N] the backward reads, not differentiable). Written with ``setup_context``, so
    torch.func transforms (``torch.func.grad``) apply.
    """

    @staticmethod
    def forward(logits, ids, mask: Optional[torch.Tensor], temperature: float, softcap: Optional[float],
                compute_entropy: bool, backend: str, in_place: bool, drop_last_position: bool = False):
        predicting = aligned(logits, drop_last_position)
        B, T, _ = predicting.shape
        r = get_backend(backend).logprobs(predicting, ids, temperature, mask, compute_entropy, softcap)
        entropy = None if r.entropy is None else r.entropy.view(B, T)
        # both differentiable: a loss may use the entropy (the entropy bonus)
        return r.logp.view(B, T), entropy, r.lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, ids, mask, temperature, softcap, _, backend, in_place = inputs[:8]
        _, entropy, lse = output
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        # the backward's ids: masked positions may hold any id (-100); the torch path's scatter needs one in range
        # there (the kernels never read a masked row's id)
        if backend == "torch" and mask is not None:
            ids = torch.where(mask.view(ids.shape) != 0, ids, 0)
        ctx.save_for_backward(logits, ids, lse, entropy)
        ctx.backend, ctx.temperature, ctx.softcap, ctx.in_place = backend, temperature, softcap, in_place
        ctx.drop_last_position = inputs[8] if len(inputs) > 8 else False

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, _grad_lse):
        logits, ids, lse, entropy = ctx.saved_tensors
        grad = None
        if ctx.needs_input_grad[0] and (grad_logp is not None or grad_entropy is not None):
            g = torch.zeros_like(lse) if grad_logp is None else grad_logp
            grad = _write_gradient(ctx, logits, ids, lse, g, grad_entropy, entropy)
        return _input_grads(ctx, grad)


def _linear_gradients(ctx, g, h=None, entropy=None):
    """The shared backward of the lm_head Functions: d hidden, d weight, d bias from g = dLoss/dlogp
    (and h = dLoss/dH with the forward's entropy, when the loss uses the entropy)."""
    hidden, weight, bias, ids, lse = ctx.saved_tensors[:5]
    wants_weight = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
    dh, dw, db = get_backend(ctx.backend).linear_backward(
        hidden, weight, bias, ids, lse, flat_f32(g), ctx.temperature, wants_weight, grad_entropy=flat_f32(h),
        entropy=flat_f32(entropy) if h is not None else None, softcap=ctx.softcap)
    return as_input_grads(ctx, (dh, dw, db), (hidden, weight, bias))


def as_input_grads(ctx, grads, inputs) -> tuple:
    """fp32 gradients in their inputs' dtypes, None where the input wants none (or has none)."""
    return tuple(g.to(x.dtype) if needed and g is not None else None
                 for g, x, needed in zip(grads, inputs, ctx.needs_input_grad))


class LinearTokenLogprobs(torch.autograd.Function):
    """log softmax(cap(h @ W^T + b) / tau)[ids] with the lm_head fused in: no [N, V] tensor is kept.

    hidden [N, H], weight [V, H], bias [V] or None, ids [N]. The backward recomputes the
    logits a chunk at a time (Triton or torch); a frozen weight gets no gradient. Used
    where the loss math needs autograd: sequence-level importance sampling, the torch path. Returns
    (logp, entropy or None, lse), as ``TokenLogprobs``; ``setup_context`` style (torch.func applies).
    """

    @staticmethod
    def forward(hidden, weight, bias, ids, temperature: float, softcap: Optional[float], compute_entropy: bool,
                backend: str):
        r = get_backend(backend).linear_logprobs(hidden, weight, bias, ids, temperature, compute_entropy, softcap)
        return r.logp, r.entropy, r.lse  # both differentiable: a loss may use the entropy (the entropy bonus)

    @staticmethod
    def setup_context(ctx, inputs, output):
        hidden, weight, bias, ids, temperature, softcap, _, backend = inputs
        _, entropy, lse = output
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(hidden, weight, bias, ids, lse, entropy)
        ctx.backend, ctx.temperature, ctx.softcap = backend, temperature, softcap

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, _grad_lse):
        if grad_logp is None and grad_entropy is None:
            return _input_grads(ctx)
        lse, entropy = ctx.saved_tensors[4], ctx.saved_tensors[5]
        g = torch.zeros_like(lse) if grad_logp is None else grad_logp
        return _input_grads(ctx, *_linear_gradients(ctx, g, grad_entropy, entropy))


class FusedLinearTokenLoss(torch.autograd.Function):
    """Triton, token level: log-probs and the per-token GRPO loss from hidden states, in one kernel.

    The forward kernel computes each token's loss and dloss/dlogp on the fly (no logits stored), the
    loss-metrics kernel reduces them; the backward recomputes the lm_head a chunk of tokens at a time
    with g = dLoss/dlogp times the token's weight and the incoming gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, loss_tokens: LossTokens, opts: GRPOOptions, out_shape):
        ctx.set_materialize_grads(False)
        tokens, weights = reduce_launch_module().weighted_tokens(loss_tokens)
        r = lm_head_launch_module().linear_forward(hidden, weight, bias, ids, kernel_loss=opts.kernel_loss,
                                                   tokens=tokens, compute_entropy=opts.compute_entropy)
        loss, metrics = reduce_launch_module().reduced(tokens.mask, opts.kernel_loss, r, weights)
        ctx.save_for_backward(hidden, weight, bias, ids, r.lse, r.dloss_dlogp, r.entropy, weights.weight,
                              weights.entropy_weight)
        ctx.backend, ctx.temperature, ctx.softcap = "triton", opts.kernel_temperature, opts.kernel_softcap
        return _loss_outputs(ctx, loss, metrics, r.logp, out_shape)

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        if grad_loss is None:
            return _input_grads(ctx)
        dloss_dlogp, entropy, weight, entropy_weight = ctx.saved_tensors[5:9]
        g, h = _weighted_dloss(grad_loss, weight, dloss_dlogp, entropy_weight)
        return _input_grads(ctx, *_linear_gradients(ctx, g, h, entropy))


class FusedLinearThreeProducts(torch.autograd.Function):
    """The fused lm_head with 3 products (Triton token level): the whole gradient is computed in the forward.

    ``fused_linear_launch.linear_three_products`` computes each chunk's logits once, turns them into the loss
    terms and, in place, into dlogits of the reduced loss (each token's weight from the token-weights kernel),
    and runs the two gradient products in the same chunk loop. The backward only scales d hidden,
    d weight and d bias by the incoming gradient, in place and on the device.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, loss_tokens: LossTokens, opts: GRPOOptions, out_shape):
        wants_weight = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
        tokens, weights = reduce_launch_module().weighted_tokens(loss_tokens)
        r, dh, dw, db = lm_head_launch_module().linear_three_products(
            hidden, weight, bias, ids, kernel_loss=opts.kernel_loss, tokens=tokens,
            compute_entropy=opts.compute_entropy, gradient=OnePassGradient(weights.weight, weights.entropy_weight),
            compute_weight_grad=wants_weight)
        loss, metrics = reduce_launch_module().reduced(tokens.mask, opts.kernel_loss, r, weights)
        ctx.save_for_backward(dh, dw, db)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return _loss_outputs(ctx, loss, metrics, r.logp, out_shape)

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        _first_backward(ctx, "the 3-product lm_head loss")
        grads = []
        for t, dtype, needed in zip(ctx.saved_tensors, ctx.dtypes, ctx.needs_input_grad[:3]):
            if t is None or not needed:
                grads.append(None)
                continue
            launch_module().scale_in_place(t, grad_loss.detach())  # fp32, small next to the logits; no host sync
            grads.append(t.to(dtype))
        return _input_grads(ctx, *grads)


def three_products_loss_without_gradient(hidden, weight, bias, ids, loss_tokens: LossTokens, opts: GRPOOptions,
                                         out_shape) -> tuple:
    """(loss, metrics vector, log-probs) of the 3-product lm_head where no gradient is wanted: each chunk's
    logits by cuBLAS, the logits kernel on them, no gradient written."""
    tokens, weights = reduce_launch_module().weighted_tokens(loss_tokens)
    r = lm_head_launch_module().linear_three_products(
        hidden, weight, bias, ids, kernel_loss=opts.kernel_loss, tokens=tokens, compute_entropy=opts.compute_entropy,
        gradient=None, compute_weight_grad=False)[0]
    loss, metrics = reduce_launch_module().reduced(tokens.mask, opts.kernel_loss, r, weights)
    return loss, metrics, r.logp.view(out_shape)
