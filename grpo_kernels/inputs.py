"""A call's inputs, prepared once.

``prepare_inputs`` takes what a loss call passed (the source: logits, or hidden states with an lm_head; the
per-call tensors and settings, by keyword) and does, in one place, everything both input forms need before any
logit is read: a packed batch is turned into one row of tokens, every tensor is checked (shapes, dtypes,
devices, the ids' range and the normalizer in one host sync), the vocabulary shard is located, the backend
resolved and the loss scale and normalizer normalized. What it returns, ``LossInputs``, is frozen and carries
the whole call: the pipeline (``pipeline.loss``) and the input forms (``from_logits.py``,
``from_hidden_states.py``) read it and never re-check. ``prepare_logprob_inputs`` does the same for the
log-prob family.

Packed batches (``SequenceLayout``): which tokens form which sequence, padded [B, T] rows or a packed batch
described by ``cu_seqlens``. The kernels work per token and never need to know: a packed batch is one row
of ``total`` tokens to them ([1, total, V] logits, a view). Everything that is a sum or mean over a sequence (the
reductions, GSPO's sequence ratio, VESPO's weight, the off-policy mask, per-row metrics) runs on
the sequence layout [S, T_max], built from the per-token values by a gather (O(total), no logits),
so a packed batch gives exactly what the padded layout gives for the same sequences.
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import torch
import torch.distributed as dist

from .kernels.contracts import KeptTokens, Sequences
from .objective import GRPOLossOutput, as_row_column
from .options import GRPOOptions
from .policy_terms import HOST_SELECTED_TERMS
from .validation import (
    Backend,
    check_hidden_grad_reduction,
    check_inputs,
    check_logits,
    check_options_or_keywords,
    check_per_token,
    check_prompt_ids,
    check_token_ids,
    checked_kept_set,
    checked_loss_scale,
    misplaced_offsets,
    offsets_error,
    resolve_backend,
)
from .vocab_parallel import sharded_vocab_start


class SequenceLayout:
    """The map between the token layout (what the kernels read: [B * T] or [total]) and the sequence
    layout ([B, T] or [S, T_max], 0 where a sequence has no token)."""

    def __init__(self, B: int, T: int, cu_seqlens: torch.Tensor | None = None):
        self.packed = cu_seqlens is not None
        if not self.packed:
            self.S, self.T_max, self.N = B, T, B * T
            self.sequences = Sequences(B, T)
            return
        starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        self.S, self.N = lengths.numel(), int(cu_seqlens[-1])
        self.T_max = int(lengths.max()) if self.S else 0  # the one host sync of a packed call
        steps = torch.arange(self.T_max, device=cu_seqlens.device)
        self.valid = steps < lengths.unsqueeze(1)  # [S, T_max]
        self.index = torch.where(self.valid, starts.unsqueeze(1) + steps, 0)  # token of each (sequence, step)
        self.sequence_of_token = torch.repeat_interleave(
            torch.arange(self.S, device=cu_seqlens.device), lengths, output_size=self.N
        )
        self.sequences = Sequences(self.S, self.T_max, cu_seqlens)  # as the token-weights kernel reads them

    @staticmethod
    def padded(B: int, T: int) -> SequenceLayout:
        """The layout of padded [B, T] rows: holds two numbers, so one object serves every eager call of that shape
        (a torch.compile graph builds its own: dynamo would trace through the cache, and warn)."""
        if torch.compiler.is_compiling():
            return SequenceLayout(B, T)
        return _padded_layout(B, T)

    def token_layout(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A per-token or per-sequence tensor as the token-weights kernel reads it: a packed batch's sequence
        layout [S, T_max] taken back to its tokens, anything else as it is (N elements a token, or S a
        sequence: the padded sequence layout is the token layout)."""
        if t is not None and self.packed and self._is_seq_layout(t):
            return self.from_seq(t)
        return t

    def tokens(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A per-token or per-sequence input as the kernels read it: contiguous fp32 [N]."""
        if t is None:
            return None
        t = t.float()  # (not detached: the kernels read it inside a Function, where no gradient can reach it)
        if not self.packed:
            if tuple(t.shape) == (self.S, self.T_max):  # per token already: a view where it can be one
                return t.reshape(-1).contiguous()
            return as_row_column(t).expand(self.S, self.T_max).reshape(-1).contiguous()
        if self._is_seq_layout(t):
            return self.from_seq(t).contiguous()
        if t.numel() == self.N and (t.dim() == 1 or t.shape[-1] == self.N):  # per token
            return t.reshape(-1).contiguous()
        return t.reshape(-1)[self.sequence_of_token].contiguous()  # per sequence: [S] or [S, 1]

    def _is_seq_layout(self, t: torch.Tensor) -> bool:
        return t.dim() == 2 and tuple(t.shape) == (self.S, self.T_max) and not (self.S == 1 and self.T_max == self.N)

    def seq(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A per-token ([N], [1, N], padded [B, T]) or per-sequence tensor in the sequence layout:
        [S, T_max] (0 where there is no token) or [S, 1]; differentiable."""
        if t is None or not self.packed:
            return t if t is None or t.dim() == 2 else as_row_column(t)
        if self._is_seq_layout(t) or (t.dim() == 2 and t.shape[1] == 1 and t.shape[0] == self.S):
            return t  # already in the sequence layout
        if t.numel() == self.N and (t.dim() == 1 or t.shape[-1] == self.N):
            return torch.where(self.valid, t.reshape(-1)[self.index], 0.0)
        return t.reshape(self.S, 1)

    def from_seq(self, t: torch.Tensor) -> torch.Tensor:
        """A sequence-layout [S, T_max] tensor back in the token layout, [N]."""
        return t.reshape(-1) if not self.packed else t[self.valid]

    def one_row(self, name: str, t: torch.Tensor | None) -> torch.Tensor | None:
        """A packed call's per-token input, checked, as one row [1, total]."""
        if t is None:
            return None
        total = self.N
        if not isinstance(t, torch.Tensor) or t.numel() != total or t.dim() not in (1, 2) or t.shape[-1] != total:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} of a packed batch must be [total] or [1, total] with total = {total}, got {got}")
        return t.reshape(1, total)

    def per_sequence(self, t) -> bool:
        """Whether a call's advantages or importance weights hold one value a sequence ([S] or [S, 1]; padded:
        [B] or [B, 1]) rather than one a token."""
        return (
            isinstance(t, torch.Tensor) and t.numel() == self.S and (t.dim() == 1 or (t.dim() == 2 and t.shape[1] == 1))
        )

    def check_per_sequence_or_token(self, name: str, t: torch.Tensor | None) -> None:
        """A packed call's advantages or importance weights: per sequence [S] / [S, 1], or per token."""
        if t is None:
            return
        per_sequence = self.per_sequence(t)
        if per_sequence and t.dim() == 1 and self.S == self.N and self.T_max > 1:
            raise ValueError(
                f"{name} of shape [{self.S}] is ambiguous in this packed batch: it has as many sequences as tokens "
                f"({self.S}; some empty, some longer), so it could be one a sequence or one a token. Pass it per "
                f"sequence as [{self.S}, 1], or per token as [1, {self.N}]"
            )
        if not per_sequence:
            self.one_row(f"{name} (per token; or per sequence [S] = [{self.S}])", t)
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def packed_layout(cu_seqlens, packed_source) -> tuple[SequenceLayout, object]:
    """Check a packed call's ``cu_seqlens`` and its logits or hidden states [total, last] or [1, total, last]
    (``packed_source``, an input form's source): (its layout, the source as one row [1, total, last], a view)."""
    packed_source.check_packable()
    source, what = packed_source.tensor, packed_source.what
    if (
        not isinstance(cu_seqlens, torch.Tensor)
        or cu_seqlens.dim() != 1
        or cu_seqlens.numel() < 1
        or cu_seqlens.dtype not in (torch.int32, torch.int64)
    ):
        got = (
            f"shape {tuple(cu_seqlens.shape)}, dtype {cu_seqlens.dtype}"
            if isinstance(cu_seqlens, torch.Tensor)
            else type(cu_seqlens).__name__
        )
        raise ValueError(
            f"cu_seqlens must be an int32 / int64 tensor [S + 1] (flash-attention's convention), got {got}"
        )
    if what == "logits":
        check_logits(source if source.dim() == 3 else source.unsqueeze(0))
    if (
        not isinstance(source, torch.Tensor)
        or source.dim() not in (2, 3)
        or (source.dim() == 3 and source.shape[0] != 1)
    ):
        got = tuple(source.shape) if isinstance(source, torch.Tensor) else type(source).__name__
        last = "V" if what == "logits" else "H"
        raise ValueError(f"packed {what} must be [total, {last}] or [1, total, {last}], got {got}")
    one_row = source if source.dim() == 3 else source.unsqueeze(0)
    total = one_row.shape[1]
    if cu_seqlens.device != source.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but {what} is on {source.device}")
    bounds = cu_seqlens.detach().cpu()
    if misplaced_offsets(bounds, total):
        raise offsets_error("cu_seqlens", bounds, total, "the packed token count")
    return SequenceLayout(1, total, cu_seqlens), packed_source.with_tensor(one_row)


@functools.lru_cache(maxsize=256)
def _padded_layout(B: int, T: int) -> SequenceLayout:
    return SequenceLayout(B, T)


class VocabShard(NamedTuple):
    """This rank's slice of a vocabulary-parallel call: its process group, its first global id, the global
    vocabulary's size, and who sums d hidden over the group (from hidden states: this op where
    ``reduce_hidden_grad``, else the caller's mapping)."""

    group: object
    start: int
    vocab_size: int
    reduce_hidden_grad: bool = True


class LossInputs(NamedTuple):
    """One call's checked inputs, frozen (a NamedTuple: built on every call, in one step). ids, the mask, old /
    reference / sampling log-probs are [B, T] (a packed batch: one row, [1, total]); advantages and importance
    weights stay as given (per row or per token; a packed batch's per sequence [S] or per token), read through
    ``layout``."""

    source: object  # from_logits.LogitsSource or from_hidden_states.HiddenStatesSource (a packed call's: one row)
    ids: torch.Tensor
    mask: torch.Tensor | None  # fp32, contiguous, shaped as the ids: 1 where a token counts; None: every token
    mask_seq: torch.Tensor | None  # the mask in the reductions' sequence layout (the mask itself when padded)
    advantages: torch.Tensor | None  # None in a log-prob call
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    importance_weights: torch.Tensor | None
    sampling_logps: torch.Tensor | None
    normalizer: object  # None, a number, or a detached 0-d tensor
    loss_scale: float | torch.Tensor
    options: GRPOOptions
    backend: Backend  # resolved once: the kernels or the torch path, in a torch.compile graph or not
    layout: SequenceLayout
    caller_shape: torch.Size | None  # a packed call's ids' shape, which its per-token log-probs take
    vocab_shard: VocabShard | None
    prompt_ids: torch.Tensor | None = None  # [S], each sequence's prompt (aggregation="prompt_mean")
    kept: KeptTokens | None = None  # the sampler's kept sets, as the kernels read them (``kept_set.py``)

    def as_called(self, out: GRPOLossOutput, seq_layout: bool = False) -> GRPOLossOutput:
        """A packed call's output with its per-token log-probs in the token layout, shaped as its ids (from
        the sequence layout with ``seq_layout``); a padded call's as it is."""
        if self.caller_shape is None:
            return out
        logps = self.layout.from_seq(out.per_token_logps) if seq_layout else out.per_token_logps
        return GRPOLossOutput(out.loss, out.metrics, logps.reshape(self.caller_shape))


_OPTIONS_OF_KEYWORDS: dict = {}  # the functional API's options by their keywords: built (and checked) once
_VALUE = operator.itemgetter(1)


def options_from(options: GRPOOptions | None, option_kwargs: dict) -> GRPOOptions:
    """The call's options: ``options=`` or the keywords (TRL's names), not both. The options a set of keywords
    makes are kept (a few dozen sets at most), so that a loop calling ``grpo_loss(..., beta=0.04)`` builds them
    once, and with them what the launchers read of them (``GRPOOptions.kernel_loss`` and the other facts
    ``GRPOOptions._derive_facts`` keeps)."""
    if options is not None:
        check_options_or_keywords(options, option_kwargs)
        return options
    if torch.compiler.is_compiling():  # a graph's keywords are its constants: the options made once, at tracing
        return _traced_options(**option_kwargs)
    try:  # the keywords as this call site orders them, with their types (beta=True is not beta=1)
        key = (tuple(option_kwargs.items()), tuple(map(type, option_kwargs.values())))
        kept = _OPTIONS_OF_KEYWORDS.get(key)
    except TypeError:  # an unhashable value: GRPOOptions says what is wrong with it
        return GRPOOptions(**option_kwargs)
    if kept is None:  # first seen in this order: the same options as in any other order
        items = tuple(sorted(option_kwargs.items()))
        in_any_order = (items, tuple(map(type, map(_VALUE, items))))
        kept = _OPTIONS_OF_KEYWORDS.get(in_any_order)
        if kept is None:
            kept = GRPOOptions(**option_kwargs)
        if len(_OPTIONS_OF_KEYWORDS) >= 64:  # a schedule (a new beta each step) must not grow it without bound
            _OPTIONS_OF_KEYWORDS.clear()
        _OPTIONS_OF_KEYWORDS[in_any_order] = _OPTIONS_OF_KEYWORDS[key] = kept
    return kept


@torch.compiler.assume_constant_result
def _traced_options(**option_kwargs) -> GRPOOptions:
    """The options of a compiled call's keywords, built when dynamo traces the call and kept in the graph as a
    constant (dynamo would otherwise trace the cache's key and the options' checks, and break the graph): its
    floats are the call site's constants, read as numbers (``GRPOOptions.scalar``)."""
    return GRPOOptions(**option_kwargs).as_graph_constant()


class LossCall(NamedTuple):
    """A loss call's per-call inputs as the caller passed them, unchecked (``prepare_inputs`` checks them): built once
    by each public loss function and Module (``loss.py``), read by nothing but ``prepare_inputs``. See ``grpo_loss``
    for each one's meaning."""

    completion_ids: object
    completion_mask: object
    advantages: object
    old_logps: object = None
    ref_logps: object = None
    importance_weights: object = None
    normalizer: object = None
    loss_scale: object = 1.0
    sampling_logps: object = None
    cu_seqlens: object = None
    prompt_ids: object = None
    kept_set: object = None


class CallSettings(NamedTuple):
    """What a loss call runs with besides its tensors: the options and the settings every loss entry point takes (a
    Module's, fixed at construction; a function's keywords)."""

    options: GRPOOptions
    backend: str = "auto"
    check_ids: bool = True
    vocab_parallel_group: object = None
    vocab_start_index: int | None = None
    reduce_hidden_grad: bool = True
    context_parallel_group: object = None


class LogprobSettings(NamedTuple):
    """The log-prob family's shared keywords (``loss.token_logprobs`` and the rest), one set for all of them: each
    function hands its own with ``of(locals())``, so that they are listed once, here."""

    backend: str = "auto"
    check_ids: bool = True
    drop_last_position: bool = False
    cu_seqlens: object = None
    vocab_parallel_group: object = None
    vocab_start_index: int | None = None
    logit_scale: float = 1.0
    logit_softcap: float | None = None
    kept_set: object = None
    reduce_hidden_grad: bool = True

    @classmethod
    def of(cls, namespace: dict) -> LogprobSettings:
        """The settings among a public function's arguments (its ``locals()``); one it does not take keeps its
        default."""
        return cls._make(namespace.get(name, default) for name, default in _LOGPROB_DEFAULTS)


_LOGPROB_DEFAULTS = tuple(LogprobSettings._field_defaults.items())


def prepare_inputs(source, call: LossCall, settings: CallSettings) -> LossInputs:
    """A loss call's ``LossInputs``, every input checked (see ``grpo_loss`` for the arguments). ``source`` is a
    ``from_logits.LogitsSource`` or a ``from_hidden_states.HiddenStatesSource``."""
    ids, mask, old, ref, sampling = (
        call.completion_ids,
        call.completion_mask,
        call.old_logps,
        call.ref_logps,
        call.sampling_logps,
    )
    token_shape = ids.shape if isinstance(ids, torch.Tensor) else None
    advantages, importance_weights, normalizer, options = (
        call.advantages,
        call.importance_weights,
        call.normalizer,
        settings.options,
    )
    check_compilable(options, call.cu_seqlens)
    check_context_parallel(settings.context_parallel_group, options)
    layout, caller_shape = None, None
    if call.cu_seqlens is not None:  # a packed batch: one row of tokens to the kernels, sequences to the reductions
        caller_shape = ids.shape if isinstance(ids, torch.Tensor) else None
        layout, source = packed_layout(call.cu_seqlens, source)
        ids, mask, old, ref, sampling = (
            layout.one_row(name, x)
            for name, x in (
                ("completion_ids", ids),
                ("completion_mask", mask),
                ("old_logps", old),
                ("ref_logps", ref),
                ("sampling_logps", sampling),
            )
        )
        layout.check_per_sequence_or_token("advantages", advantages)
        layout.check_per_sequence_or_token("importance_weights", importance_weights)
    shape = source.logits_shape(ids)  # (B, T, V): checks the logits, or the hidden states and the head
    device = source.tensor.device
    sharded = settings.vocab_parallel_group is not None
    check_inputs(
        shape,
        device,
        ids,
        mask,
        layout.tokens(advantages).view(1, -1) if layout else advantages,
        old,
        ref,
        None if layout else importance_weights,
        normalizer,
        options,
        settings.check_ids and not sharded,
        what=source.what,
    )
    if sampling is not None:
        check_per_token("sampling_logps", sampling, shape, device, allow_row=False)
    check_prompt_ids(call.prompt_ids, layout.S if layout else shape[0], device, options, packed=layout is not None)
    source, backend, shard = _on_backend(source, settings, shape, ids, mask=mask, normalizer=normalizer)
    if isinstance(normalizer, torch.Tensor):
        normalizer = normalizer.detach()  # a count, per step: no gradient
    mask = mask if mask.dtype is torch.float32 and mask.is_contiguous() else mask.float().contiguous()
    if layout is None:  # (the kernels' one mask, checked: shaped as the ids)
        layout, mask_seq = SequenceLayout.padded(shape[0], shape[1]), mask
    else:
        mask_seq = layout.seq(mask)
    kept = _kept(call.kept_set, token_shape, ids, shape, shard, mask, settings.check_ids)
    return LossInputs(
        source,
        ids,
        mask,
        mask_seq,
        advantages,
        old,
        ref,
        importance_weights,
        sampling,
        normalizer,
        checked_loss_scale(call.loss_scale),
        options,
        backend,
        layout,
        caller_shape,
        shard,
        call.prompt_ids,
        kept,
    )


def prepare_logprob_inputs(
    source, ids: torch.Tensor | None, temperature: float, settings: LogprobSettings, mask=None
) -> LossInputs:
    """The ``LossInputs`` of a log-prob call (see ``token_logprobs`` for the arguments). ``ids`` None: the entropy
    alone (no target). A source with other leading dims than [B, T] ([N, V], [B, T, K, V], ...) is read as one row;
    the results take the ids' shape (a packed call's: [total]). Without a ``mask`` every token is read; with one (the
    method family's losses: [B, T], a packed call's [total]) masked tokens are not, their ids may be anything, and
    the layout maps the tokens to their sequences."""
    opts = options_from(
        None, dict(temperature=temperature, logit_scale=settings.logit_scale, logit_softcap=settings.logit_softcap)
    )  # validated once per set of values
    check_compilable(opts, settings.cu_seqlens)
    caller_shape, layout = None, None
    check_ids = settings.check_ids
    token_shape = ids.shape if isinstance(ids, torch.Tensor) else None
    if settings.cu_seqlens is not None:
        layout, source = packed_layout(settings.cu_seqlens, source)
        caller_shape = (layout.N,)
        ids = None if ids is None else layout.one_row("ids", ids)
        mask = None if mask is None else layout.one_row("completion_mask", mask)
    elif isinstance(source.tensor, torch.Tensor) and source.tensor.dim() not in (0, 3):
        lead = source.tensor.shape[:-1]
        if ids is not None and (not isinstance(ids, torch.Tensor) or tuple(ids.shape) != tuple(lead)):
            got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"ids must have shape {tuple(lead)} ({source.what} without its last dim), got {got}")
        caller_shape, source = lead, source.as_one_row()
        ids = None if ids is None else ids.reshape(1, -1)
    if ids is None:  # no target: every id 0, never checked
        check_logits(source.tensor)
        B, T = source.tensor.shape[0], source.tensor.shape[1] - int(settings.drop_last_position)
        ids = torch.zeros((B, max(T, 0)), dtype=torch.long, device=source.tensor.device)
        check_ids = False
    shape = source.logits_shape(ids)
    device = source.tensor.device
    if mask is not None:
        check_per_token("completion_mask", mask, shape, device, allow_row=False, allow_bool=True, allow_int=True)
    if settings.vocab_parallel_group is None:
        check_token_ids(ids, shape, device, check_ids, mask=mask)
    source, backend, shard = _on_backend(source, settings._replace(check_ids=check_ids), shape, ids, mask=mask)
    mask_seq = None
    if mask is not None:
        mask = mask if mask.dtype is torch.float32 and mask.is_contiguous() else mask.float().contiguous()
        mask_seq = mask if layout is None else layout.seq(mask)
    kept = _kept(settings.kept_set, token_shape, ids, shape, shard, mask, settings.check_ids)
    return LossInputs(  # a log-prob call: none of a loss's per-token inputs, its reduction's scale 1
        source=source,
        ids=ids,
        mask=mask,
        mask_seq=mask_seq,
        advantages=None,
        old_logps=None,
        ref_logps=None,
        importance_weights=None,
        sampling_logps=None,
        normalizer=None,
        loss_scale=1.0,
        options=opts,
        backend=backend,
        layout=layout or SequenceLayout.padded(shape[0], shape[1]),
        caller_shape=caller_shape,
        vocab_shard=shard,
        kept=kept,
    )


# A loss call whose active tokens are at most this share of its tokens runs on them alone (``compacted``): measured on
# the CPU torch path (benchmarks/active_tokens_cpu.py), the gather of the active rows and the scatter of their gradient
# cost about what a tenth of the rows' math does
COMPACTION_SHARE = 0.5


def active_tokens(inputs: LossInputs, check_ids: bool) -> tuple | None:
    """(the active tokens' positions in the token layout [n], ``cu_seqlens`` of each sequence's active tokens [S + 1],
    their rows gathered as one [1, n, V or H]) of a call whose active tokens are at most ``COMPACTION_SHARE`` of its
    tokens, where running on them alone pays; None otherwise.

    A token the mask leaves out then costs no product of the head and no read of its logits: from hidden states on
    every backend (the head's products over the active rows), from logits on the torch path (the Triton kernel already
    reads no masked row). Not inside a torch.compile graph (the count is data), without the ids' check
    (``check_ids=False``: no host sync, as CUDA graphs need); one host sync (the active count of each sequence)
    where it applies, and one more for a kept set in CSR (its entries' count, ``KeptSet.at_tokens``). The gathered
    rows' backward scatters their gradient into zeros at the masked tokens."""
    source = inputs.source
    if (
        inputs.mask is None
        or not check_ids
        or inputs.backend.in_graph
        or (source.what == "logits" and inputs.backend.kernels)
    ):
        return None
    L = inputs.layout
    counts = (inputs.mask_seq != 0).sum(-1)
    total = sum(counts.tolist())  # the one host sync
    if total == 0 or total > COMPACTION_SHARE * L.N:
        return None
    positions = torch.nonzero_static(inputs.mask.reshape(-1) != 0, size=total).squeeze(1)
    rows = source.token_rows()
    gathered = rows[positions // rows.shape[1], positions % rows.shape[1]].unsqueeze(0)
    cu_seqlens = torch.zeros(L.S + 1, dtype=torch.int64, device=positions.device)
    cu_seqlens[1:] = torch.cumsum(counts, 0)
    return positions, cu_seqlens, gathered


def compacted(inputs: LossInputs, call: LossCall, settings: CallSettings) -> tuple | None:
    """The loss call on its active tokens alone (``active_tokens``), as a packed call: each of its sequences' active
    tokens in order, so that every reduction, sequence ratio, correction and metric sees the same tokens as before.
    (its source, its ``LossCall``, its ``CallSettings``, the active tokens' positions [n]), or None."""
    active = active_tokens(inputs, settings.check_ids)
    if active is None:
        return None
    positions, cu_seqlens, gathered = active
    L = inputs.layout
    token = lambda t: None if t is None else t.reshape(-1)[positions]  # noqa: E731

    def sequence_or_token(t):  # as [S, 1] or [1, n]: unambiguous whatever the counts
        if t is None:
            return None
        return t.reshape(-1, 1) if L.per_sequence(t) else token(t).reshape(1, -1)

    packed = LossCall(
        token(inputs.ids),
        token(inputs.mask),
        sequence_or_token(inputs.advantages),
        token(inputs.old_logps),
        token(inputs.ref_logps),
        sequence_or_token(inputs.importance_weights),
        call.normalizer,
        call.loss_scale,
        token(inputs.sampling_logps),
        cu_seqlens,
        inputs.prompt_ids,
        None if call.kept_set is None else call.kept_set.at_tokens(positions),
    )
    return inputs.source.on_rows(gathered), packed, settings._replace(check_ids=False), positions


def check_compilable(options: GRPOOptions, cu_seqlens) -> None:
    """Inside a torch.compile graph, what it cannot hold, refused by name before any of the call is traced (each
    reads sizes or selects tokens on the host; ``docs/stacks.md`` lists them; the kept set: ``_kept``)."""
    if not torch.compiler.is_compiling():
        return
    if cu_seqlens is not None:
        raise NotImplementedError(
            "cu_seqlens (a packed batch) inside a torch.compile graph: its sequence layout is as wide as the longest "
            "sequence, a length read on the host; call the loss eagerly, or pass the batch padded [B, T] with its mask"
        )
    if options.loss.policy_term in HOST_SELECTED_TERMS:
        raise NotImplementedError(
            f"loss_type={options.loss_type!r} inside a torch.compile graph: its tokens are chosen on the host (a "
            "top-k or a random draw over the active tokens, as verl does); call the loss eagerly"
        )
    if options.masks_high_entropy:
        raise NotImplementedError(
            f"top_entropy_quantile={options.top_entropy_quantile!r} inside a torch.compile graph: the quantile is "
            "taken over the active tokens' entropies (gathered across processes), a selection sized on the host; "
            "call the loss eagerly, or leave top_entropy_quantile at 1"
        )


def check_context_parallel(group, options: GRPOOptions | None = None) -> None:
    """``context_parallel_group``: None, or a torch.distributed process group. With one, what selects tokens over
    every process is refused (each rank of the group holds the whole sequences once they are exchanged, and would
    count each token once a rank: TRL's top-entropy quantile, Clip-Cov's and KL-Cov's choice), and so is a
    torch.compile graph (the exchange reads the parts' sizes on the host)."""
    if group is None:
        return
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "context_parallel_group inside a torch.compile graph: the exchange reads the parts' sizes on the host; "
            "call the loss eagerly"
        )
    if not dist.is_available() or not dist.is_initialized() or not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "context_parallel_group must be a torch.distributed ProcessGroup of an initialized process group, got "
            f"{type(group).__name__}"
        )
    if options is not None and options.masks_high_entropy:
        raise NotImplementedError(
            f"top_entropy_quantile={options.top_entropy_quantile!r} with context_parallel_group: the quantile is "
            "taken over every process's tokens, and each rank of the group holds the whole sequences; leave "
            "top_entropy_quantile at 1"
        )
    if options is not None and options.loss.policy_term in HOST_SELECTED_TERMS:
        raise NotImplementedError(
            f"loss_type={options.loss_type!r} with context_parallel_group: its tokens are chosen over every "
            "process's tokens, and each rank of the group holds the whole sequences"
        )


def _kept(kept_set, token_shape, ids, shape, shard, mask, check_ids: bool):
    """The call's kept sets as the kernels read them (``validation.checked_kept_set``), None without; refused inside
    a torch.compile graph, whose ops do not take them yet."""
    if kept_set is None:
        return None
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "kept_set inside a torch.compile graph: the kept set's passes are not custom ops yet; call the loss "
            "eagerly (or leave kept_set out of the compiled step)"
        )
    vocab_size = shape[-1] if shard is None else shard.vocab_size
    return checked_kept_set(kept_set, token_shape, ids.numel(), vocab_size, ids.device, mask, check_ids)


def _on_backend(source, settings, shape, ids, *, mask=None, normalizer=None) -> tuple:
    """The steps both kinds of call share once their tensors are checked: (the source as the call reads it, the
    backend, the vocabulary shard or None). The shard is located (its ids, which are global, checked against the
    whole vocabulary: ``vocab_parallel.sharded_vocab_start``), the backend resolved, the source's own checks made
    for them (the input forms' Functions take the shard as a value)."""
    group = settings.vocab_parallel_group
    check_hidden_grad_reduction(settings.reduce_hidden_grad, group, source.what)
    shard = None
    if group is not None:
        start, vocab_size = sharded_vocab_start(
            shape,
            source.tensor.device,
            ids,
            group,
            settings.vocab_start_index,
            settings.check_ids,
            mask=mask,
            normalizer=normalizer,
        )
        shard = VocabShard(group, start, vocab_size, settings.reduce_hidden_grad)
    backend = resolve_backend(settings.backend, source.tensor)
    source.check_call(backend, group is not None)
    return source, backend, shard
