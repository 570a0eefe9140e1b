"""The loss and the log-probs from hidden states [B, T, H] and the lm_head weight [V, H] (and bias): the input form,
its autograd Functions and their host functions, in the order a call runs them. The [N, V] logits are never held.

A loss call (``loss.fused_linear_grpo_loss``) prepares its inputs once (``inputs.prepare_inputs``), then
``pipeline.loss`` calls ``fused_loss`` here, which chooses the schedule (the one place) and applies its
Function; each Function's forward and backward are one host function each:

- "recompute" (4 products), ``LinearLoss`` (``linear_loss_fwd`` / ``linear_loss_bwd``): the forward kernel
  computes each token's loss terms from tiles of logits it never stores; the backward recomputes each chunk's
  logits inside the dlogits kernel, then two products give d hidden and d weight.
- "three_products", ``LinearLossThreeProducts`` (``three_products_fwd`` / ``three_products_bwd``): each chunk's
  logits once, by cuBLAS, turned into dlogits in place by the one-pass logits kernel, both gradient products in
  the same loop; the backward only scales.
- log-probs, ``HiddenStatesLogprobs`` (``passes.linear_logprobs_fwd`` / ``passes.linear_logprobs_bwd``): where the
  loss math runs in torch (sequence-level ratios, vespo, the torch backend, vocabulary parallelism) and for
  ``linear_token_logprobs``; the form's one log-prob Function, the entries and the vocabulary shard values it takes.

The fused loss Functions call the launchers (``kernels.fused_linear_launch``, a plain import); the log-prob pass runs
on the call's ``validation.Backend`` (``passes.py``: the launchers, the chunked torch path or a graph's custom
ops).
"""

from __future__ import annotations

import torch

from . import kept_set, torch_path
from .from_logits import (
    apply_or_forward,
    first_backward,
    input_grads,
    kernel_output,
    loss_outputs,
    pass_outputs,
    signature_bound_once,
    weighted_dloss,
    zero_at_masked,
)
from .kernels import fused_linear_launch, kept_launch, logits_launch, reduce_launch
from .kernels.contracts import KeptTerms, KeptTokens, LossTokens, OnePassGradient, rounds_head_logits
from .objective import GRPOLossOutput
from .options import GRPOOptions, option_value
from .passes import linear_logprobs_bwd, linear_logprobs_fwd
from .sparse_entries import KeptSetEntries, TopKEntries, kept_gradient, with_kept_lse
from .validation import TRITON_KERNELS, Backend, check_head_precision, check_linear_inputs, check_lm_head_mode
from .vocab_parallel import owned_ids, summed_over_shards, unowned_column_0_in_head_grads


def head_operands(hidden_states, weight, bias, head_precision: str) -> tuple:
    """(hidden states, weight, bias) in the head's precision (``validation.HEAD_PRECISIONS``). "input" under an
    autocast of the hidden states' device takes the operands as ``F.linear`` under it does: each floating one
    (but fp64) cast to the autocast dtype, differentiably (a model body's bf16 hidden states with its fp32 master
    weight; the gradient reaches the weight in fp32). "fp32" is fp32 whatever the autocast."""
    check_head_precision(head_precision)
    if head_precision in ("input", "fp32_logits"):  # (fp32_logits: the operands as "input", the logits unrounded)
        dtype = _autocast_dtype(hidden_states)
        if dtype is None:
            return hidden_states, weight, bias
        cast = lambda t: t.to(dtype) if _autocast_casts(t) else t  # noqa: E731
        return cast(hidden_states), cast(weight), cast(bias)
    upcast = lambda t: t.float() if isinstance(t, torch.Tensor) else t  # noqa: E731 (a bad input is checked later)
    return upcast(hidden_states), upcast(weight), upcast(bias)


def _autocast_dtype(hidden_states) -> torch.dtype | None:
    """The autocast dtype on the hidden states' device, None where autocast is off there."""
    if not isinstance(hidden_states, torch.Tensor):
        return None
    device_type = hidden_states.device.type
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _autocast_casts(t) -> bool:
    """Whether autocast casts this operand (a floating tensor below fp64, as its lower-precision ops do)."""
    return isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float16, torch.bfloat16)


# ---- The input form ----------------------------------------------------------------------------------------------


class HiddenStatesSource:
    """Hidden states [B, T, H] with the lm_head weight [V, H] and bias [V] (or None), as the caller passed them.
    ``flat`` keeps the kernels' [N, H] copy for the call's second pass (the policy masks' first pass is the
    first)."""

    what = "hidden_states"
    # inside a torch.compile graph its log-prob kernels run as custom ops (``ops.py``) and the loss math as graph
    # code: its fused loss kernels are not custom ops
    fused_in_graph = False

    def __init__(
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        lm_head_mode: str | None = None,
        head_precision: str = "input",
    ):
        hidden_states, weight, bias = head_operands(hidden_states, weight, bias, head_precision)
        self.tensor, self.weight, self.bias, self.lm_head_mode = hidden_states, weight, bias, lm_head_mode
        # the head's logits kept as its fp32 accumulator (a rollout engine's fp32-output head), not rounded to 16 bits
        self.fp32_logits = head_precision == "fp32_logits"
        self._flat, self._flat_with_grad = None, False

    def check_packable(self) -> None:
        """Hidden states pack as they are (one per completion token)."""

    def with_tensor(self, hidden_states: torch.Tensor) -> HiddenStatesSource:
        """This source's head and settings on other hidden states (a packed batch's checked one row)."""
        return type(self)(hidden_states, self.weight, self.bias, self.lm_head_mode, self.operands_precision)

    def as_one_row(self) -> HiddenStatesSource:
        return self.with_tensor(self.tensor.reshape(1, -1, self.tensor.shape[-1]))

    @property
    def operands_precision(self) -> str:
        """The head precision of a source made from this one's operands (cast already): only the logits' rounding
        is left to choose."""
        return "fp32_logits" if self.fp32_logits else "input"

    def token_rows(self) -> torch.Tensor:
        """The hidden states that predict the completion, [B, T, H]."""
        return self.tensor

    def on_rows(self, rows: torch.Tensor) -> HiddenStatesSource:
        """The head and settings on some of the tokens' hidden states, gathered as one row [1, n, H]
        (``inputs.compacted``; unsharded, as ``LogitsSource.on_rows``)."""
        return HiddenStatesSource(rows, self.weight, self.bias, self.lm_head_mode, self.operands_precision)

    def logits_shape(self, ids) -> tuple:
        """(B, T, V) of the logits the head would make, after checking the hidden states, weight and bias."""
        check_linear_inputs(self.tensor, self.weight, self.bias)
        B, T, _ = self.tensor.shape
        return B, T, self.weight.shape[0]

    def check_call(self, backend: Backend, sharded: bool) -> None:
        """The mode, where the caller chose one (``fused_loss`` chooses it otherwise)."""
        check_lm_head_mode(self.lm_head_mode)

    def flat(self, inputs) -> tuple:
        """(hidden [N, H], weight, bias, ids [N]) as the kernels read them. Masked tokens are never read:
        their hidden states become 0 and their ids 0 (one O(N * H) copy, which also makes a sliced view
        contiguous). Padding garbage (NaN, inf) would otherwise reach d weight, a sum over every token's
        hidden state."""
        if self._flat is not None and (self._flat_with_grad or not torch.is_grad_enabled()):
            return self._flat  # (a copy made under no_grad, for the masks' first pass, carries no gradient)
        B, T, H = self.tensor.shape
        if inputs.mask is None:  # a log-prob call: every token read
            hidden, ids = self.tensor.reshape(B * T, H).contiguous(), inputs.ids.reshape(-1).contiguous()
        else:
            active = (inputs.mask != 0).reshape(B * T, 1)
            hidden = torch.where(active, self.tensor.reshape(B * T, H), 0.0)
            ids = torch.where(active.squeeze(1), inputs.ids.reshape(-1), 0).contiguous()
        self._flat = (hidden, self.weight.contiguous(), None if self.bias is None else self.bias.contiguous(), ids)
        self._flat_with_grad = torch.is_grad_enabled()
        return self._flat

    def logprobs(self, inputs, compute_entropy: bool, final: bool = False):
        """(log-probs, entropy or None) [B, T], differentiable, 0 at masked tokens, as in the logits form."""
        kept = None if inputs.kept is None else KeptSetEntries(inputs.kept)
        return self.as_rows(inputs, self._pass(inputs, self.flat(inputs)[3], compute_entropy, kept)[:2])

    def logprobs_at_ids(self, inputs, ids_k: torch.Tensor) -> torch.Tensor:
        """The differentiable log-probs at K ids a token (ids_k [B, T, K]), normalized over the whole vocabulary, 0 at
        masked tokens; [B, T, K]."""
        entries = TopKEntries.of(ids_k.reshape(-1, ids_k.shape[-1]))
        return self._pass(inputs, None, False, entries)[0].view(ids_k.shape)

    def sum_squares(self, inputs, compute_entropy: bool) -> tuple:
        """(log-probs, entropy or None, Σπ²) [B, T] of a no-grad log-prob pass, from the same pass."""
        kept = None if inputs.kept is None else KeptSetEntries(inputs.kept)
        return self.as_rows(inputs, self._pass(inputs, self.flat(inputs)[3], compute_entropy, kept, True)[:3])

    def _pass(self, inputs, ids, compute_entropy: bool, entries, compute_sum_squares: bool = False) -> tuple:
        """``HiddenStatesLogprobs`` on this call's hidden states (as the kernels read them), head, options, backend
        and shard."""
        options, (hidden, weight, bias, _) = inputs.options, self.flat(inputs)
        return apply_or_forward(
            HiddenStatesLogprobs,
            hidden,
            weight,
            bias,
            ids,
            None if inputs.mask is None else flat_mask(inputs.mask),
            option_value(options, "kernel_temperature"),
            option_value(options, "kernel_softcap"),
            compute_entropy,
            inputs.backend,
            self.fp32_logits,
            entries,
            inputs.vocab_shard,
            compute_sum_squares,
        )

    @staticmethod
    def as_rows(inputs, pair) -> tuple:
        """The kernels' flat (log-probs, entropy or None) [N] as [B, T] rows, 0 at masked tokens."""
        B, T = inputs.ids.shape
        return zero_at_masked(inputs.mask, *(None if t is None else t.view(B, T) for t in pair))

    def fused_loss(self, inputs, loss_tokens: LossTokens) -> GRPOLossOutput:
        """The loss with its per-token math in the lm_head kernels (Triton): the schedule chosen here, the caller's
        ``lm_head_mode``, else the device sweep's measured choice for this GPU and vocabulary
        (``kernels/tuned.json``), else "recompute"."""
        mode = self.lm_head_mode
        if mode is None:
            mode = fused_linear_launch.default_lm_head_mode(self.tensor, self.weight.shape[0])
        opts, flat, shape = inputs.options, self.flat(inputs), inputs.ids.shape
        wants_grad = torch.is_grad_enabled() and (self.tensor.requires_grad or self.weight.requires_grad)
        kept = inputs.kept
        terms = linear_kept_terms(
            *flat, kept, loss_tokens.tokens.mask, opts.kernel_temperature, opts.kernel_softcap, TRITON_KERNELS,
            fp32_logits=self.fp32_logits,
        )  # fmt: skip
        if mode == "three_products" and wants_grad:
            loss, metrics, logp = LinearLossThreeProducts.apply(
                *flat, loss_tokens, opts, shape, kept, terms, self.fp32_logits
            )
        elif mode == "three_products":  # no gradient wanted: cuBLAS logits and the logits kernel
            loss, metrics, logp = three_products_fwd(*flat, loss_tokens, opts, None, kept, terms, self.fp32_logits)[:3]
            logp = logp.view(shape)
        else:
            loss, metrics, logp = LinearLoss.apply(*flat, loss_tokens, opts, shape, kept, terms, self.fp32_logits)
        return kernel_output(opts, loss, metrics, logp)


def flat_f32(t: torch.Tensor | None) -> torch.Tensor | None:
    """A per-token tensor as the kernels read it: contiguous fp32 [N] (fp64 stays fp64: the torch path's
    gradcheck precision; None stays None)."""
    if t is None:
        return None
    return t.reshape(-1).to(torch.float64 if t.dtype == torch.float64 else torch.float32).contiguous()


def as_input_grads(ctx, grads, inputs) -> tuple:
    """fp32 gradients in their inputs' dtypes, None where the input wants none (or has none)."""
    return tuple(
        g.to(x.dtype) if needed and g is not None else None
        for g, x, needed in zip(grads, inputs, ctx.needs_input_grad[: len(inputs)], strict=True)
    )


# ---- Recompute: the loss terms in the forward kernel, the logits recomputed by the backward ----------------------


def linear_loss_fwd(hidden, weight, bias, ids, loss_tokens: LossTokens, opts: GRPOOptions, fp32_logits=False):
    """(loss, metrics vector, ``ForwardResult`` over the N tokens, ``TokenWeights``): the token-weights kernel,
    the lm_head forward kernel with the per-token loss, the loss-metrics kernel."""
    tokens, weights = reduce_launch.weighted_tokens(loss_tokens)
    r = fused_linear_launch.linear_forward(
        hidden,
        weight,
        bias,
        ids,
        kernel_loss=opts.kernel_loss,
        tokens=tokens,
        compute_entropy=opts.compute_entropy,
        fp32_logits=fp32_logits,
    )
    loss, metrics = reduce_launch.reduced(tokens.mask, opts.kernel_loss, r, weights)
    return loss, metrics, r, weights


def linear_loss_bwd(
    hidden,
    weight,
    bias,
    ids,
    lse,
    g,
    temperature: float,
    softcap: float | None,
    backend: Backend,
    wants_weight: bool,
    h=None,
    entropy=None,
    write_entries=None,
    fp32_logits: bool = False,
) -> tuple:
    """(d hidden, d weight or None, d bias or None), fp32, from g = dLoss/dlogp (and h = dLoss/dH with the
    forward's entropy): a chunk of tokens at a time, the logits recomputed (Triton or the torch path);
    ``write_entries`` and ``fp32_logits`` as in ``linear_logprobs_bwd``."""
    return linear_logprobs_bwd(
        hidden,
        weight,
        bias,
        ids,
        lse,
        flat_f32(g),
        temperature,
        softcap,
        backend,
        wants_weight,
        grad_entropy=flat_f32(h),
        entropy=flat_f32(entropy) if h is not None else None,
        write_entries=write_entries,
        fp32_logits=fp32_logits,
    )


class LinearLoss(torch.autograd.Function):
    """Log-probs and the per-token GRPO loss from hidden states in one kernel (Triton, token level): no logits
    stored; the backward recomputes the lm_head a chunk of tokens at a time with g = dLoss/dlogp times the
    token's weight and the incoming gradient. Returns (loss, metrics vector, log-probs [B, T])."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, loss_tokens: LossTokens, opts: GRPOOptions, out_shape, kept=None,
                terms=None, fp32_logits=False):  # fmt: skip
        ctx.set_materialize_grads(False)
        if terms is not None:  # the kernels take each set's token's log-prob over its set
            loss_tokens = with_kept_lse(loss_tokens, terms)
        loss, metrics, r, weights = linear_loss_fwd(hidden, weight, bias, ids, loss_tokens, opts, fp32_logits)
        ctx.save_for_backward(
            hidden, weight, bias, ids, r.lse, r.dloss_dlogp, r.entropy, weights.weight, weights.entropy_weight
        )
        ctx.temperature, ctx.softcap, ctx.kept, ctx.terms = opts.kernel_temperature, opts.kernel_softcap, kept, terms
        ctx.fp32_logits = fp32_logits
        return loss_outputs(ctx, loss, metrics, r.logp, out_shape)

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        if grad_loss is None:
            return input_grads(ctx)
        hidden, weight, bias, ids, lse, dloss_dlogp, entropy, weight_of_token, entropy_weight = ctx.saved_tensors
        g, h = weighted_dloss(grad_loss, weight_of_token, dloss_dlogp, entropy_weight)
        g_dense, h_dense = kept_set.dense_share(ctx.terms, ctx.kept, g, h)
        grads = linear_loss_bwd(
            hidden,
            weight,
            bias,
            ids,
            lse,
            g_dense,
            ctx.temperature,
            ctx.softcap,
            TRITON_KERNELS,
            _wants_weight(ctx, bias),
            h_dense,
            entropy,
            kept_entries(ids, ctx.kept, ctx.terms, g, h, lse, entropy, ctx.temperature, ctx.softcap, TRITON_KERNELS),
            fp32_logits=ctx.fp32_logits,
        )
        return input_grads(ctx, *as_input_grads(ctx, grads, (hidden, weight, bias)))


def _wants_weight(ctx, bias) -> bool:
    return ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])


# ---- Three products: every gradient in the forward's chunk loop -------------------------------------------------


def three_products_fwd(
    hidden, weight, bias, ids, loss_tokens: LossTokens, opts: GRPOOptions, wants_weight: bool | None, kept=None,
    terms=None, fp32_logits: bool = False,
) -> tuple:  # fmt: skip
    """(loss, metrics vector, log-probs [N], d hidden, d weight, d bias) of the 3-product launches: each chunk's
    logits by cuBLAS, the one-pass logits kernel turning them into the loss terms and, in place, dlogits of the
    reduced loss (each token's weight from the token-weights kernel), both gradient products in the same loop.
    ``wants_weight`` None: no gradient at all (the three are None). ``kept``, ``terms``: the kept sets and their
    terms (``linear_kept_terms``), their entries written into each chunk's dlogits."""
    tokens, weights = reduce_launch.weighted_tokens(loss_tokens if terms is None else with_kept_lse(loss_tokens, terms))
    gradient = None if wants_weight is None else OnePassGradient(weights.weight, weights.entropy_weight)
    r, dh, dw, db = fused_linear_launch.linear_three_products(
        hidden,
        weight,
        bias,
        ids,
        kernel_loss=opts.kernel_loss,
        tokens=tokens,
        compute_entropy=opts.compute_entropy,
        gradient=gradient,
        compute_weight_grad=bool(wants_weight),
        kept=None if terms is None else (kept, terms),
        fp32_logits=fp32_logits,
    )
    loss, metrics = reduce_launch.reduced(tokens.mask, opts.kernel_loss, r, weights)
    return loss, metrics, r.logp, dh, dw, db


def three_products_bwd(gradients: tuple, grad_loss: torch.Tensor) -> list:
    """The forward's gradients times the incoming one, in place, the scale read on the device (fp32, small next
    to the logits; no host sync); None stays None."""
    return [None if t is None else logits_launch.scale_in_place(t, grad_loss.detach()) for t in gradients]


class LinearLossThreeProducts(torch.autograd.Function):
    """The fused lm_head with 3 products (Triton, token level): the whole gradient computed in the forward, the
    backward only scales d hidden, d weight and d bias by the incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, loss_tokens: LossTokens, opts: GRPOOptions, out_shape, kept=None,
                terms=None, fp32_logits=False):  # fmt: skip
        loss, metrics, logp, dh, dw, db = three_products_fwd(
            hidden, weight, bias, ids, loss_tokens, opts, _wants_weight(ctx, bias), kept, terms, fp32_logits
        )
        ctx.save_for_backward(dh, dw, db)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss_outputs(ctx, loss, metrics, logp, out_shape)

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        first_backward(ctx, "the 3-product lm_head loss")
        wanted = [t if needed else None for t, needed in zip(ctx.saved_tensors, ctx.needs_input_grad[:3], strict=True)]
        scaled = three_products_bwd(wanted, grad_loss)
        return input_grads(
            ctx, *(None if t is None else t.to(dtype) for t, dtype in zip(scaled, ctx.dtypes, strict=True))
        )


# ---- Log-probs: the lm_head kernels' (or the torch path's) log-probs, the loss math in torch ---------------------


@signature_bound_once
class HiddenStatesLogprobs(torch.autograd.Function):
    """The log-prob pass from hidden states [N, H] and the lm_head (weight [V, H], bias [V] or None), the logits never
    held: log softmax(cap(h @ W^T + b) / tau) at each token's target ``ids`` [N] (and the entropy, and Σπ²), a tile or
    a chunk of tokens at a time (Triton or the torch path), as ``from_logits.LogitsLogprobs`` with the same values:

    - ``entries`` (``sparse_entries``): the targets (None), each token's kept set (``KeptSetEntries``: each entry's
      logit its own dot product) or K ids a token (``TopKEntries``, ids_k [N, K]; ``ids`` unused).
    - ``shard`` (``inputs.VocabShard``): this rank's head shard [V / P, H], the ids global. The gradient of the
      hidden states sums every rank's share of the vocabulary; who sums it is the caller's layout
      (``shard.reduce_hidden_grad``: ``vocab_parallel.summed_over_shards``).

    The backward recomputes the logits a chunk at a time, the entries written over each tile's dense gradient
    before its products; a frozen weight gets no gradient. ``mask`` [N] or None. Returns (values [N] or [N, K],
    entropy or None, Σπ² or None, the log-sum-exp and the entries' terms, not differentiable); ``setup_context``
    style (torch.func applies)."""

    @staticmethod
    def forward(hidden, weight, bias, ids, mask, temperature, softcap, compute_entropy, backend, fp32_logits, entries,
                shard, compute_sum_squares):  # fmt: skip
        if entries is None and shard is None:  # the targets over the whole vocabulary: the pass alone
            r = linear_logprobs_fwd(
                hidden, weight, bias, ids, temperature, compute_entropy, softcap, backend, compute_sum_squares,
                fp32_logits,
            )  # fmt: skip
            # both differentiable: a loss may use the entropy (the entropy bonus)
            return r.logp, r.entropy, r.sum_squares, r.lse
        entries = None if entries is None else entries.on_shard(mask, shard)
        target, owned, local = _pass_ids(ids, entries, shard, weight.shape[0])
        terms = None
        if entries is not None:
            terms = linear_kept_terms(
                hidden, weight, bias, target, entries.kept_tokens, mask, temperature, softcap, backend,
                col0=0 if shard is None else shard.start, group=entries.terms_group(shard),
                compute_sum_squares=compute_sum_squares and entries.read_by_the_pass, fp32_logits=fp32_logits,
            )  # fmt: skip
            terms = entries.merged(terms, shard, weight.shape[0])
        r = linear_logprobs_fwd(
            hidden, weight, bias, local, temperature, compute_entropy, softcap, backend, compute_sum_squares,
            fp32_logits,
        )  # fmt: skip
        values, entropy, squares, lse = pass_outputs(r, entries, terms, shard, owned, mask, False)
        return values, entropy, squares, lse, *(() if terms is None else terms)

    @staticmethod
    def setup_context(ctx, inputs, output):
        hidden, weight, bias, ids, mask, temperature, softcap, _, backend, fp32_logits, entries, shard, _ = inputs
        _, entropy, squares, lse, *terms = output
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse, *(t for t in (squares, *terms) if t is not None))
        entries = None if entries is None else entries.on_shard(mask, shard)
        target, owned, local = _pass_ids(ids, entries, shard, weight.shape[0])
        ctx.save_for_backward(hidden, weight, bias, target, owned, local, mask, lse, entropy, *terms)
        ctx.entries, ctx.shard, ctx.backend, ctx.fp32_logits = entries, shard, backend, fp32_logits
        ctx.temperature, ctx.softcap = temperature, softcap

    @staticmethod
    def backward(ctx, grad_values, grad_entropy, *unused):
        if grad_values is None and grad_entropy is None:
            return input_grads(ctx)
        hidden, weight, bias, target, owned, local, mask, lse, entropy, *terms = ctx.saved_tensors
        entries, shard, temperature, softcap = ctx.entries, ctx.shard, ctx.temperature, ctx.softcap
        if entries is None:
            g, h, entry_gradient = torch.zeros_like(lse) if grad_values is None else grad_values, grad_entropy, None
        else:
            g, h, entry_gradient = entries.gradient(grad_values, grad_entropy, KeptTerms(*terms), lse, entropy, mask)
        if entry_gradient is not None and ctx.backend.in_graph:
            # a graph's op takes no per-tile writer: the top-k's entries as a sparse update after the dense pass
            grads = linear_loss_bwd(
                hidden, weight, bias, local, lse, g, temperature, softcap, ctx.backend, _wants_weight(ctx, bias),
                fp32_logits=ctx.fp32_logits,
            )  # fmt: skip
            grads = with_entry_gradients(
                grads, hidden, weight, bias, entries.ids_k, entry_gradient.per_entry, g, temperature, softcap,
                ctx.fp32_logits,
            )  # fmt: skip
            return input_grads(ctx, *as_input_grads(ctx, grads, (hidden, weight, bias)))
        write_entries = None
        if entry_gradient is not None:
            e = entry_gradient
            write_entries = kept_entries(
                target, e.tokens, e.terms, e.g, e.h, e.lse, e.entropy, temperature, softcap, ctx.backend,
                col0=0 if shard is None else shard.start, lead=e.lead,
            )  # fmt: skip
        dh, dw, db = linear_loss_bwd(
            hidden, weight, bias, local, lse, g, temperature, softcap, ctx.backend, _wants_weight(ctx, bias), h,
            entropy, write_entries, fp32_logits=ctx.fp32_logits,
        )  # fmt: skip
        if shard is not None:  # the one-hot belongs to the target's owner; d hidden summed where this op owns it
            kept_column_0 = owned if entries is None else entries.kept_column_0(owned, shard)
            unowned_column_0_in_head_grads(
                dh, dw, db, hidden, weight, bias, kept_column_0, g, temperature, softcap, ctx.fp32_logits
            )
            summed_over_shards(dh, shard)
        return input_grads(ctx, *as_input_grads(ctx, (dh, dw, db), (hidden, weight, bias)))


def _pass_ids(ids, entries, shard, width: int) -> tuple:
    """(each token's target: the ids, or the entries' first; on a shard which targets this rank owns, else None; the
    ids the dense passes read: on a shard the owned targets' local columns). A masked token's id is 0 already
    (``HiddenStatesSource.flat``)."""
    target = ids if entries is None else entries.target(ids)
    if shard is None:
        return target, None, target
    return target, *owned_ids(target, shard.start, width)


# ---- The sampler's kept set (kept_set.py) from the head: each kept logit its own dot product ---------------------


def flat_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A per-token mask as the kept-set kernels read it: contiguous [N] (None: every token read)."""
    return None if mask is None else mask.reshape(-1).contiguous()


def linear_kept_terms(hidden, weight, bias, ids, kept: KeptTokens | None, mask, temperature: float, softcap,
                      backend, *, col0: int = 0, group=None, compute_sum_squares: bool = False,
                      fp32_logits: bool = False):  # fmt: skip
    """Each token's kept-set terms (``kernels.contracts.KeptTerms``) from hidden states [N, H] and the head's weight
    [width, H] (a vocabulary slice from global id ``col0`` with ``group``) and bias, None without a set: each
    entry's logit its own dot product (``kernels/kept.py::kept_state_kernel`` with the head, or the torch path's
    gathered products), rounded as the head rounds its logits; then ``kept_set.finish``."""
    if kept is None:
        return None
    if backend.eager_kernels:  # (a graph: the torch path's gathered products)
        x, state = kept_launch.linear_kept_state(
            hidden,
            weight,
            bias,
            ids,
            kept,
            temperature=temperature,
            softcap=softcap,
            mask=mask,
            col0=col0,
            compute_entropy=kept.entropy_over_set,
            compute_sum_squares=compute_sum_squares,
            fp32_logits=fp32_logits,
        )
    else:
        x_of = _head_logits_of(hidden, weight, bias, temperature, softcap, fp32_logits)
        x, state = kept_set.torch_state(x_of, ids, kept, mask, col0, weight.shape[0])
    return kept_set.finish(state, kept, x, mask, group, compute_sum_squares)


def _head_logits_of(hidden, weight, bias, temperature: float, softcap, fp32_logits: bool = False):
    """x_of(token, local column) of the torch path: cap(h . W[v] + b[v]) / tau of gathered pairs, in the compute
    dtype, rounded to 16 bits first for 16-bit inputs unless ``fp32_logits`` (``torch_path._chunk_logits``), a
    bounded chunk at a time."""
    dtype = torch_path.compute_dtype(hidden)
    step = max(1, (1 << 22) // max(hidden.shape[1], 1))  # pairs a chunk: 2^22 gathered elements

    def x_of(token: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        out = torch.empty(token.shape, device=hidden.device, dtype=dtype)
        for e0 in range(0, token.numel(), step):
            t, v = token[e0 : e0 + step], local[e0 : e0 + step]
            raw = torch.einsum("eh,eh->e", hidden[t].to(dtype), weight[v].to(dtype))
            if bias is not None:
                raw = raw + bias[v].to(dtype)
            if rounds_head_logits(hidden.dtype, fp32_logits):
                raw = raw.to(hidden.dtype).to(dtype)
            out[e0 : e0 + step] = torch_path.capped(raw, softcap)[0] * (1.0 / temperature)
        return out

    return x_of


def kept_entries(ids, kept: KeptTokens | None, terms: KeptTerms | None, g, h, lse, entropy, temperature: float,
                 softcap, backend, col0: int = 0, lead=None):  # fmt: skip
    """The head's backward's ``write_entries`` for the kept sets (None without): over each tile of dlogits (its
    tokens from n0, its columns from v0), the sets' entries (``sparse_entries.kept_gradient``) from the full ``g`` and
    ``h`` (the dense pass had their share of the sets' tokens taken out), the forward's ``lse`` and ``entropy``;
    ``col0``: the slice's first global id (a vocabulary shard's); ``lead`` one an entry (the top-k entries',
    ``sparse_entries.TopKEntries``)."""
    if terms is None:
        return None
    flat = lambda t: None if t is None else t.reshape(-1).to(torch_path.compute_dtype(t))  # noqa: E731
    g, h, lse, entropy = flat(g), flat(h), flat(lse), flat(entropy)
    if not backend.kernels:  # the torch path: every entry's value once, each tile takes its own
        values = kept_set.torch_entry_gradients(ids, kept, terms, g, 1.0 / temperature, softcap, h, lse, entropy, lead)
        return lambda tile, n0, v0: kept_set.write_entries(tile, values, col0 + v0, n0)

    def write(tile: torch.Tensor, n0: int, v0: int) -> None:
        rows = slice(n0, n0 + tile.shape[0])
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        kept_gradient(
            tile, ids, kept, terms, g[rows], pick(h), pick(lse), pick(entropy), temperature, softcap, backend,
            col0=col0 + v0, n0=n0, lead=lead,
        )  # fmt: skip

    return write


def with_entry_gradients(grads, hidden, weight, bias, ids_k, G, g, temperature, softcap, fp32_logits=False) -> tuple:
    """A dense backward's (d hidden, d weight, d bias), run with g = sum_k G_k at each token's first id, made the
    top-k's: at each entry (token n, its k-th id) the logit's gradient gains G[n, k] / tau, and at the first id loses
    the dense one-hot's g / tau, each times the cap's slope there (repeated ids add up), carried through the head:
    d hidden += c W[id], d weight[id] += c h, d bias[id] += c. O(N K H), a [N, H] gather an entry column, no [N, V]
    tensor (inside a graph, where the dense op writes no entry over its tiles as ``kept_entries`` does)."""
    dh, dw, db = grads
    coefficient = G.clone()
    coefficient[:, 0] -= g
    h32 = hidden.float()
    for k in range(ids_k.shape[1]):
        rows = weight[ids_k[:, k]].float()  # [N, H]
        raw = (h32 * rows).sum(-1) + (0.0 if bias is None else bias[ids_k[:, k]].float())
        if rounds_head_logits(hidden.dtype, fp32_logits):  # the head's logits are rounded to 16 bits before the cap
            raw = raw.to(hidden.dtype).float()
        slope = torch_path.capped(raw, softcap)[1]
        c = coefficient[:, k] / temperature * (1.0 if slope is None else slope)  # [N]
        dh = dh + c.unsqueeze(1) * rows
        if dw is not None:
            dw = dw.index_add(0, ids_k[:, k], c.unsqueeze(1) * h32)
        if db is not None:
            db = db.index_add(0, ids_k[:, k], c)
    return dh, dw, db
