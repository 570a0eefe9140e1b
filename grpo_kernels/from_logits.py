"""The loss and the log-probs from logits [B, T, V]: the input form, its autograd Functions and their host
functions, in the order a call runs them.

A loss call (``loss.grpo_loss``) prepares its inputs once (``inputs.prepare_inputs``: one frozen ``LossInputs``),
then ``pipeline.loss`` calls ``fused_loss`` here, which chooses the schedule (the one place) and applies its
Function; each Function's forward and backward are one host function each, which launch the kernels:

- one-pass, ``OnePassLoss`` (``one_pass_fwd`` / ``one_pass_bwd``): the logits kernel writes dlogits of the reduced
  loss while it streams each row (2 S bytes, S the logits' size); the backward scales that gradient in place.
- two-pass, ``TwoPassLoss`` (``two_pass_fwd`` / ``two_pass_bwd``): the forward kernel computes each token's loss
  and dLoss/dlogp, the backward kernel writes dlogits (3 S).
- log-probs, ``LogitsLogprobs`` (``passes.logprobs_fwd`` / ``passes.logprobs_bwd``): where the loss math runs in
  torch on them (sequence-level ratios, vespo, the torch backend, vocabulary parallelism) and for the log-prob
  family; the one log-prob Function of this form, whatever the entries (a kept set, a teacher's top-k:
  ``sparse_entries.py``) and the vocabulary shard (``vocab_parallel.py``), each a value it takes.

The host functions take plain tensors. The fused loss Functions are the Triton kernels' own (``kernels.logits_launch``,
a plain import; inside a ``torch.compile`` graph, ``ops.graph_loss``'s custom ops); the log-prob pass runs on the
call's ``validation.Backend``, chosen once by the preparation (``passes.py``: the launchers, the chunked torch path
or a graph's custom ops).
Every one computes log softmax(cap(x) / temperature) of the raw logits x, cap(x) = softcap * tanh(x / softcap)
with a head's soft-cap, x itself with ``softcap`` None.

With ``drop_last_position`` the logits are [B, T + 1, V], as a causal LM returns them with
``logits_to_keep = T + 1``: the Triton launchers read the first T positions in place (the ids give T) and the
gradient is allocated at the full shape, its last position zeroed, so autograd never copies a sliced view's
gradient into a zero-filled tensor (3 S more bytes).

In-place backward (opt-in): the gradient is written into the logits' own storage and the storage's version
counter is bumped, so any other autograd node that saved these logits and runs its backward later fails with
PyTorch's "modified by an inplace operation" error instead of silently reading the gradient.
"""

from __future__ import annotations

import inspect

import torch

from . import kept_set, ops
from .kernels import logits_launch
from .kernels.contracts import KeptTerms, KernelLoss, LossTokens
from .objective import GRPOLossOutput
from .options import GRPOOptions, option_value
from .passes import aligned, logprobs_bwd, logprobs_fwd
from .sparse_entries import KeptSetEntries, TopKEntries, kept_gradient, kept_terms, with_kept_lse, with_kept_set
from .validation import TRITON_KERNELS, Backend, check_in_place, check_logits, checked_drop_last_position
from .vocab_parallel import combined_result, owned_ids, unowned_column_0_in_logits_grad

# ---- The input form ----------------------------------------------------------------------------------------------


class LogitsSource:
    """Logits as the caller passed them: [B, T, V], or [B, T + 1, V] with ``drop_last_position``. Its methods
    check and read it; none keeps state for another."""

    what = "logits"
    fused_in_graph = True  # inside a torch.compile graph its fused loss runs as custom ops (``ops.graph_loss``)
    __slots__ = ("tensor", "drop_last_position", "in_place_backward", "one_pass")

    def __init__(
        self,
        logits: torch.Tensor,
        *,
        drop_last_position: bool = False,
        in_place_backward: bool = False,
        one_pass: bool | None = None,
    ):
        self.tensor, self.drop_last_position = logits, drop_last_position
        self.in_place_backward, self.one_pass = in_place_backward, one_pass

    def check_packable(self) -> None:
        """A packed batch (``cu_seqlens``) gives the completion tokens' logits only."""
        if self.drop_last_position:
            raise ValueError(
                "drop_last_position=True applies to padded [B, T + 1, V] logits, not to a packed batch "
                "(cu_seqlens): give the packed logits of the completion tokens only"
            )

    def with_tensor(self, logits: torch.Tensor) -> LogitsSource:
        """This source's settings on other logits (a packed batch's checked one row [1, total, V])."""
        return type(self)(logits, in_place_backward=self.in_place_backward, one_pass=self.one_pass)

    def as_one_row(self) -> LogitsSource:
        """Logits [..., V] of other leading dims as one row [1, N, V] (a view where possible)."""
        return self.with_tensor(self.tensor.reshape(1, -1, self.tensor.shape[-1]))

    def token_rows(self) -> torch.Tensor:
        """The logits that predict the completion, [B, T, V] (a view: the dropped position left out)."""
        return aligned(self.tensor, self.drop_last_position)

    def on_rows(self, rows: torch.Tensor) -> LogitsSource:
        """This form's settings on some of its tokens' rows, gathered as one row [1, n, V] (``inputs.compacted``:
        an unsharded source, which the compacted call's preparation shards again where the call is sharded)."""
        return LogitsSource(rows, one_pass=self.one_pass)

    def logits_shape(self, ids) -> tuple:
        """(B, T, V) of the logits that predict the completion, after checking ``drop_last_position`` against the
        ids; no view is made (the Triton launchers read the first T positions in place)."""
        check_logits(self.tensor)
        B, T, V = self.tensor.shape
        if self.drop_last_position is False:
            return B, T, V
        checked_drop_last_position(self.drop_last_position, self.tensor, ids)
        return B, T - 1, V

    def check_call(self, backend: Backend, sharded: bool) -> None:
        """What this call's backend and vocabulary sharding allow of the logits."""
        if self.in_place_backward:
            if sharded:
                raise ValueError("in_place_backward=True is not supported with vocab_parallel_group")
            check_in_place(True, self.tensor)
        if self.tensor.stride(-1) != 1:  # on every backend: code that passes on a laptop runs on the GPU
            raise ValueError(
                f"logits need a unit last stride, got strides {tuple(self.tensor.stride())} "
                f"(backend={backend.name!r}); views that slice B or T are fine, a transposed or strided vocabulary is "
                "not (call .contiguous())"
            )

    def logprobs(self, inputs, compute_entropy: bool, final: bool = False):
        """(log-probs, entropy or None) [B, T], differentiable, 0 at masked tokens (over the kept sets where the call
        has them, over the whole vocabulary where it is sharded). ``final``: the pass the gradient flows through (it
        may write the gradient into the logits, with in_place_backward)."""
        kept = None if inputs.kept is None else KeptSetEntries(inputs.kept)
        return self._pass(inputs, inputs.ids.contiguous(), compute_entropy, kept, final and self.in_place_backward)[:2]

    def logprobs_at_ids(self, inputs, ids_k: torch.Tensor) -> torch.Tensor:
        """The differentiable log-probs at K ids a token (ids_k [B, T, K]: a teacher's top-k), normalized over the
        whole vocabulary, 0 at masked tokens."""
        return self._pass(inputs, None, False, TopKEntries.of(ids_k), False)[0]

    def sum_squares(self, inputs, compute_entropy: bool) -> tuple:
        """(log-probs, entropy or None, Σπ²) [B, T] of a no-grad log-prob pass, from the same pass."""
        kept = None if inputs.kept is None else KeptSetEntries(inputs.kept)
        return self._pass(inputs, inputs.ids.contiguous(), compute_entropy, kept, False, True)[:3]

    def _pass(self, inputs, ids, compute_entropy: bool, entries, in_place: bool, compute_sum_squares=False) -> tuple:
        """``LogitsLogprobs`` on this call's logits, options, backend and shard."""
        options = inputs.options
        return apply_or_forward(
            LogitsLogprobs,
            self.tensor,
            ids,
            inputs.mask,
            option_value(options, "kernel_temperature"),
            option_value(options, "kernel_softcap"),
            compute_entropy,
            inputs.backend,
            in_place,
            self.drop_last_position,
            entries,
            inputs.vocab_shard,
            compute_sum_squares,
        )

    def fused_loss(self, inputs, loss_tokens: LossTokens) -> GRPOLossOutput:
        """The loss with its per-token math in the logits kernel (Triton): the schedule chosen here, one-pass
        (dlogits written in the forward) where a gradient is wanted and allowed, else two-pass; without a hint,
        the device sweep's measured choice for this GPU and vocabulary (``kernels/tuned.json``), else one-pass."""
        one_pass = self.one_pass
        if one_pass is None:
            one_pass = default_one_pass(self.tensor)
        one_pass = one_pass and not self.in_place_backward and self.tensor.requires_grad and torch.is_grad_enabled()
        if inputs.backend.in_graph:  # the same schedules as one opaque op each in the graph
            loss, metrics, logp = ops.graph_loss(self, inputs.ids.contiguous(), loss_tokens, inputs.options, one_pass)
        elif one_pass:
            loss, metrics, logp = OnePassLoss.apply(self.tensor, inputs, loss_tokens)
        else:
            loss, metrics, logp = TwoPassLoss.apply(self.tensor, inputs, loss_tokens)
        return kernel_output(inputs.options, loss, metrics, logp)


@torch.compiler.assume_constant_result  # (a graph reads the measured table once, as it is when traced)
def default_one_pass(logits: torch.Tensor) -> bool:
    """The device sweep's measured schedule for this GPU and vocabulary (``kernels/tuned.json``), else one-pass."""
    return logits_launch.default_one_pass(logits)


def gradient_buffer(logits: torch.Tensor, drop_last_position: bool, in_place: bool) -> torch.Tensor:
    """The gradient returned for ``logits``, at its full shape: for a [B, T + 1, V] input its last position zeroed
    (B x V elements) and the rest written by the kernels. In place, the logits' own storage, its version bumped (the
    backward writes it)."""
    if in_place:
        torch.autograd.graph.increment_version(logits)
    grad = logits if in_place else torch.empty(logits.shape, device=logits.device, dtype=logits.dtype)
    if drop_last_position:
        grad[:, -1].zero_()
    return grad


def kernel_output(opts: GRPOOptions, loss, metrics, logp) -> GRPOLossOutput:
    """A fused loss Function's output: its loss, its metrics vector under TRL's names (the loss-metrics kernel's
    order), its log-probs (not differentiable)."""
    return GRPOLossOutput(loss, dict(zip(opts.fused_metric_names, metrics.unbind(), strict=True)), logp)


# ---- Shared by the Functions of both input forms (and vocab_parallel.py) ---------------------------------------


def first_backward(ctx, what: str) -> None:
    """The Functions that hand the forward's gradient to the backward can do so once."""
    if getattr(ctx, "backward_done", False):
        raise RuntimeError(
            f"{what} computed its gradient in the forward and handed it to the first backward (scaled in place "
            "there), so a second backward through a retained graph would read a used gradient; to "
            "backpropagate more than once, use the two-pass path (GRPOLoss(one_pass=False), "
            "lm_head_mode='recompute')"
        )
    ctx.backward_done = True


def input_grads(ctx, *grads) -> tuple:
    """A backward's return: the given gradients of the first inputs, None for every later forward input."""
    return grads + (None,) * (len(ctx.needs_input_grad) - len(grads))


def loss_outputs(ctx, loss, metrics, logp, shape) -> tuple:
    """A fused loss Function's outputs: the loss (differentiable), the metrics vector and the log-probs shaped
    ``shape`` (neither differentiable)."""
    if logp.shape != shape:  # (the launchers' rows are shaped as the ids where that is free)
        logp = logp.view(shape)
    ctx.mark_non_differentiable(metrics, logp)
    return loss, metrics, logp


def zero_at_masked(mask, *values) -> tuple:
    """``values`` with 0 at masked tokens (``mask != 0`` false), whatever a pass left there: what every log-prob
    output holds at a masked token, on every form and sharding. Each value is per token (as many elements as the
    mask, any shape) or a row of K per token ([..., K]); None stays None; without a mask, unchanged."""
    if mask is None:
        return values
    active = (mask != 0).reshape(-1)
    return tuple(
        None
        if t is None
        else torch.where(active.view(t.shape) if t.numel() == active.numel() else active.view(*t.shape[:-1], 1), t, 0.0)
        for t in values
    )


def weighted_dloss(grad_loss, weights, dloss_dlogp, entropy_weight):
    """(g = dLoss/dlogp, h = dLoss/dH or None) of a two-pass backward: the per-token derivative and the entropy
    bonus's weight, each times the token's weight and the incoming gradient."""
    g = grad_loss * weights * dloss_dlogp
    return g, None if entropy_weight is None else grad_loss * entropy_weight


# ---- One-pass: dlogits written by the forward kernel -------------------------------------------------------------


def one_pass_fwd(
    logits, ids, loss_tokens: LossTokens, kernel_loss: KernelLoss, drop_last_position: bool, kept=None
) -> tuple:
    """(loss, metrics vector, log-probs [N], the gradient at the logits' shape) of the one-pass launches: the
    token-weights kernel, the logits kernel writing dlogits of the reduced loss into the gradient (its first T
    positions, in place of a [B, T, V] view; the token-weights kernel zeroes a dropped last position), the
    loss-metrics kernel. ``kept``: the call's kept sets (``KeptTokens``): their terms first, their entries written
    after the logits kernel's dense gradient."""
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    terms = None if kept is None else with_kept_terms(logits, ids, kept, loss_tokens, kernel_loss, drop_last_position)
    if terms is not None:  # (a call without a set never enters sparse_entries)
        loss_tokens = with_kept_lse(loss_tokens, terms)
    r = logits_launch.loss_forward(
        logits,
        ids,
        kernel_loss=kernel_loss,
        loss_tokens=loss_tokens,
        gradient_out=grad,
        dropped_gradient=grad if drop_last_position else None,
    )
    if terms is not None:
        kept_gradient(
            aligned(grad, drop_last_position),
            ids,
            kept,
            terms,
            r.result.dloss_dlogp * r.weights.weight,
            r.weights.entropy_weight,
            r.result.lse,
            r.result.entropy,
            kernel_loss.kernel_temperature,
            kernel_loss.kernel_softcap,
            TRITON_KERNELS,
        )
    return r.loss, r.metrics, r.result.logp, grad


def with_kept_terms(logits, ids, kept, loss_tokens: LossTokens, kernel_loss: KernelLoss, drop_last_position: bool):
    """A fused loss's kept-set terms (``kept_terms`` on the logits that predict the completion)."""
    return kept_terms(
        aligned(logits, drop_last_position),
        ids,
        kept,
        loss_tokens.tokens.mask,
        kernel_loss.kernel_temperature,
        kernel_loss.kernel_softcap,
        TRITON_KERNELS,
    )


def one_pass_bwd(grad: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """The saved gradient times the incoming one, in place, the scale read on the device: no host sync, no
    second [B, T, V] tensor, and no pass over the gradient at all when grad_loss is 1 (a plain backward)."""
    return logits_launch.scale_in_place(grad, grad_loss)


class OnePassLoss(torch.autograd.Function):
    """The loss with dlogits written in the forward (Triton, token level), of the logits and a call's
    ``inputs.LossInputs`` (with its ``LossTokens``). Each token's weight in the reduction
    is known before the logits kernel runs (the token-weights kernel's), so dLoss/dlogp is known as each row is
    streamed and the gradient is written in the same program. A caller that knows its loss scale (gradient
    accumulation) folds it into the weights (``loss_scale``); the backward then moves nothing.
    Returns (loss, metrics vector, log-probs [B, T])."""

    @staticmethod
    def forward(ctx, logits, inputs, loss_tokens: LossTokens):
        ctx.set_materialize_grads(False)
        ids = inputs.ids.contiguous()
        loss, metrics, logp, grad = one_pass_fwd(
            logits, ids, loss_tokens, inputs.options.kernel_loss, inputs.source.drop_last_position, inputs.kept
        )
        ctx.save_for_backward(grad)
        return loss_outputs(ctx, loss, metrics, logp, ids.shape)

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        first_backward(ctx, "the one-pass GRPO loss")
        if grad_loss is None:  # the loss is not part of what is differentiated
            return None, None, None
        return one_pass_bwd(ctx.saved_tensors[0], grad_loss), None, None  # (logits, inputs, loss_tokens)


# ---- Two-pass: the forward kernel's dLoss/dlogp, then the backward kernel ----------------------------------------


def two_pass_fwd(logits, ids, loss_tokens: LossTokens, kernel_loss: KernelLoss):
    """The launches of ``one_pass_fwd`` without the gradient (``logits_launch.LossForward``: the per-token results,
    dLoss/dlogp among them, the token weights, the loss and the metrics)."""
    return logits_launch.loss_forward(logits, ids, kernel_loss=kernel_loss, loss_tokens=loss_tokens)


def two_pass_bwd(
    logits,
    ids,
    lse,
    g,
    temperature: float,
    softcap: float | None,
    drop_last_position: bool,
    in_place: bool,
    h=None,
    entropy=None,
) -> torch.Tensor:
    """dlogits of g = dLoss/dlogp (and h = dLoss/dH with the forward's entropy), at the logits' shape (a dropped
    last position zeroed), written by the backward kernel (in place: into the logits, their version bumped)."""
    grad = gradient_buffer(logits, drop_last_position, in_place)
    logits_launch.backward(
        logits, ids, lse, g, temperature, softcap=softcap, out=grad, grad_entropy=h, entropy=entropy
    )  # fmt: skip
    return grad


class TwoPassLoss(torch.autograd.Function):
    """The loss over two reads of the logits (Triton, token level): the forward kernel computes each token's loss
    and dLoss/dlogp, the loss-metrics kernel reduces them; the backward kernel writes dlogits = g (onehot - p) /
    tau, g = dLoss/dlogp times the token's weight and the incoming gradient. Returns (loss, metrics vector,
    log-probs [B, T])."""

    @staticmethod
    def forward(ctx, logits, inputs, loss_tokens: LossTokens):
        ctx.set_materialize_grads(False)
        ids, opts, source = inputs.ids.contiguous(), inputs.options, inputs.source
        terms = None
        if inputs.kept is not None:
            terms = with_kept_terms(logits, ids, inputs.kept, loss_tokens, opts.kernel_loss, source.drop_last_position)
            loss_tokens = with_kept_lse(loss_tokens, terms)
        ctx.kept, ctx.terms = inputs.kept, terms
        r = two_pass_fwd(logits, ids, loss_tokens, opts.kernel_loss)
        ctx.save_for_backward(
            logits,
            ids,
            r.result.lse,
            r.result.dloss_dlogp,
            r.result.entropy,
            r.weights.weight,
            r.weights.entropy_weight,
        )
        ctx.in_place, ctx.drop_last_position = source.in_place_backward, source.drop_last_position
        ctx.temperature, ctx.softcap = opts.kernel_temperature, opts.kernel_softcap
        return loss_outputs(ctx, r.loss, r.metrics, r.result.logp, ids.shape)

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        logits, ids, lse, dloss_dlogp, entropy, weight, entropy_weight = ctx.saved_tensors
        if grad_loss is None or not ctx.needs_input_grad[0]:
            return input_grads(ctx)
        g, h = weighted_dloss(grad_loss, weight, dloss_dlogp, entropy_weight)
        g_dense, h_dense = (g, h) if ctx.terms is None else kept_set.dense_share(ctx.terms, ctx.kept, g, h)
        grad = two_pass_bwd(
            logits,
            ids,
            lse,
            g_dense,
            ctx.temperature,
            ctx.softcap,
            ctx.drop_last_position,
            ctx.in_place,
            h_dense,
            entropy,
        )
        if ctx.terms is not None:
            kept_gradient(
                aligned(grad, ctx.drop_last_position),
                ids,
                ctx.kept,
                ctx.terms,
                g,
                h,
                lse,
                entropy,
                ctx.temperature,
                ctx.softcap,
                TRITON_KERNELS,
            )
        return input_grads(ctx, grad)


def apply_or_forward(function, *args):
    """``function.apply(*args)``, or where no gradient can flow (no grad mode, or no input that requires one) its
    ``forward`` alone: the same outputs without the autograd Function's fixed cost, most of a small call's time (an
    old / reference log-prob pass). Under torch.compile and torch.func transforms, always ``apply``."""
    if (
        (torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args))
        or torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
    ):
        return function.apply(*args)
    return function.forward(*args)


def signature_bound_once(function_class):
    """A ``setup_context``-style autograd Function whose ``forward`` signature is computed once: ``apply`` binds
    the call's arguments to it (``inspect.signature``) on every call, about as long as a small call's torch ops."""
    function_class.forward.__signature__ = inspect.signature(function_class.forward)
    return function_class


# ---- Log-probs: the kernels' (or the torch path's) log-probs, the loss math in torch ------------------------------


@signature_bound_once
class LogitsLogprobs(torch.autograd.Function):
    """The log-prob pass from logits, by the Triton kernels or the torch path: log softmax(cap(logits) / tau) at each
    token's target ``ids`` (and the entropy, and with ``compute_sum_squares`` Σπ²), every sparse feature and sharding
    a value it takes:

    - ``entries`` (``sparse_entries``): None, the targets; ``KeptSetEntries``, each token's log-prob (and entropy)
      over the sampler's kept set; ``TopKEntries``, the log-probs at K ids a token ([B, T, K]; ``ids`` unused).
    - ``shard`` (``inputs.VocabShard``): None, the whole vocabulary; else this rank's slice [B, T, V / P], the ids
      global: the slice's pass, the global values from O(N) all-reduces (``vocab_parallel.combined``), the
      backward's one-hot at the target's owner only.

    ``mask`` (fp32 [N] or None): every output is 0 where it is 0 (the kernels never read those rows). Returns
    (values, entropy or None, Σπ² or None, and, not differentiable, the log-sum-exp fp32 [N] the backward reads and
    the entries' terms, ``KeptTerms``' fields, where there are entries). ``setup_context`` style: torch.func
    transforms (``torch.func.grad``) apply."""

    @staticmethod
    def forward(logits, ids, mask, temperature, softcap, compute_entropy, backend, in_place, drop_last_position,
                entries, shard, compute_sum_squares):  # fmt: skip
        if entries is None and shard is None:  # the targets over the whole vocabulary: the pass alone
            r = logprobs_fwd(
                logits, ids, temperature, mask, compute_entropy, softcap, backend, drop_last_position,
                compute_sum_squares,
            )  # fmt: skip
            B, T = ids.shape
            as_bt = lambda t: None if t is None else t.view(B, T)  # noqa: E731
            # both differentiable: a loss may use the entropy (the entropy bonus)
            return r.logp.view(B, T), as_bt(r.entropy), as_bt(r.sum_squares), r.lse
        rows = aligned(logits, drop_last_position)
        entries = None if entries is None else entries.on_shard(mask, shard)
        target, owned, local = pass_ids(ids, entries, shard, rows.shape[-1], mask, backend)
        terms = None
        if entries is not None:
            terms = kept_terms(
                rows, target, entries.kept_tokens, mask, temperature, softcap, backend,
                col0=0 if shard is None else shard.start, group=entries.terms_group(shard),
                compute_sum_squares=compute_sum_squares and entries.read_by_the_pass,
            )  # fmt: skip
            terms = entries.merged(terms, shard, rows.shape[-1])
        read = terms if shard is None and entries is not None and entries.read_by_the_pass else None
        r = logprobs_fwd(
            logits, target if shard is None else local, temperature, mask, compute_entropy, softcap, backend,
            drop_last_position, compute_sum_squares, kept=read,
        )  # fmt: skip
        values, entropy, squares, lse = pass_outputs(r, entries, terms, shard, owned, mask, read is not None)
        B, T = target.shape
        as_bt = lambda t: None if t is None else t.view(B, T)  # noqa: E731
        if values.dim() == 1:  # (the targets' log-probs; the entries' are [B, T, K])
            values = values.view(B, T)
        return values, as_bt(entropy), as_bt(squares), lse, *(() if terms is None else terms)

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, ids, mask, temperature, softcap, _, backend, in_place, drop_last_position, entries, shard, _ = inputs
        _, entropy, squares, lse, *terms = output
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse, *(t for t in (squares, *terms) if t is not None))
        entries = None if entries is None else entries.on_shard(mask, shard)
        target, owned, local = pass_ids(ids, entries, shard, logits.shape[-1], mask, backend)
        ctx.save_for_backward(logits, target, owned, local, mask, lse, entropy, *terms)
        ctx.entries, ctx.shard, ctx.backend, ctx.in_place = entries, shard, backend, in_place
        ctx.temperature, ctx.softcap, ctx.drop_last_position = temperature, softcap, drop_last_position

    @staticmethod
    def backward(ctx, grad_values, grad_entropy, *unused):
        if not ctx.needs_input_grad[0] or (grad_values is None and grad_entropy is None):
            return input_grads(ctx)
        logits, target, owned, local, mask, lse, entropy, *terms = ctx.saved_tensors
        entries, shard, dropped = ctx.entries, ctx.shard, ctx.drop_last_position
        if entries is None:
            g, h, entry_gradient = torch.zeros_like(lse) if grad_values is None else grad_values, grad_entropy, None
        else:
            g, h, entry_gradient = entries.gradient(grad_values, grad_entropy, KeptTerms(*terms), lse, entropy, mask)
        grad = gradient_buffer(logits, dropped, ctx.in_place)
        logprobs_bwd(
            logits, local, lse, g, ctx.temperature, ctx.softcap, dropped, ctx.backend, out=grad, grad_entropy=h,
            entropy=entropy,
        )  # fmt: skip
        if shard is not None:  # the one-hot belongs to the target's owner
            unowned_column_0_in_logits_grad(
                aligned(grad, dropped), aligned(logits, dropped), owned, lse, g, h, entropy, ctx.temperature,
                ctx.softcap,
            )  # fmt: skip
        if entry_gradient is not None:  # the entries written over the dense gradient
            e = entry_gradient
            kept_gradient(
                aligned(grad, dropped), local if shard is None else target, e.tokens, e.terms, e.g, e.h, e.lse,
                e.entropy, ctx.temperature, ctx.softcap, ctx.backend, col0=0 if shard is None else shard.start,
                lead=e.lead,
            )  # fmt: skip
        return input_grads(ctx, grad)


def pass_outputs(r, entries, terms, shard, owned, mask, read_by_the_pass: bool) -> tuple:
    """(values, entropy, Σπ², lse) of a log-prob pass's results ``r`` (either form's): on a shard the global ones
    (``vocab_parallel.combined_result``), over the kept sets where the pass did not read them itself, the entries'
    values, 0 at masked tokens."""
    if shard is not None:
        r = combined_result(r, owned, shard.group)
    if entries is not None and entries.read_by_the_pass and not read_by_the_pass:
        r = with_kept_set(r, terms)
    values = r.logp if entries is None else entries.values(r, terms)
    return (*zero_at_masked(mask, values, r.entropy, r.sum_squares), r.lse)


def pass_ids(ids, entries, shard, width: int, mask, backend: Backend) -> tuple:
    """(each token's target: the ids, or the entries' first; on a shard which targets this rank owns, else None;
    the ids the dense passes read: on a shard the owned targets' local columns (``vocab_parallel.owned_ids``), on the
    torch path 0 at masked tokens, whose ids may be anything (-100) where its scatter needs one in range; the kernels
    never read a masked row's)."""
    target = ids if entries is None else entries.target(ids)
    if shard is not None:
        return target, *owned_ids(target, shard.start, width)
    if not backend.kernels and mask is not None:
        return target, None, torch.where(mask.view(target.shape) != 0, target, 0)
    return target, None, target
