"""Input checks: every bad input gets an error naming the argument, what it got and what was expected."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from .kept_set import ENTROPY, OUTSIDE, KeptSet
from .kernels import TritonMissing, logits_launch
from .kernels.contracts import KeptTokens

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # float64: the torch path only
BACKENDS = ("auto", "triton", "torch")
# The fused head's modes: "recompute" (4 products, the logits recomputed in the backward) and "three_products"
LM_HEAD_MODES = ("recompute", "three_products")
# The head's precision: "input", as an unfused head in the operands' own dtype (16-bit on the tensor cores, fp32
# accumulation, the logits rounded once to that dtype: the kernels' ROUND_LOGITS, torch_path._chunk_logits);
# "fp32_logits", the same operands and accumulation with the fp32 accumulator kept as the logit, never rounded (an
# fp32-output head: Megatron-LM's fp32 output logits, NeMo AutoModel's LMHead(logits_dtype=torch.float32));
# "fp32", hidden states, weight and bias cast to fp32 first (exact fp32 products and logits: TRL's
# cast_lm_head_to_fp32, a head whose weights are fp32), the gradients coming back in their own dtypes
HEAD_PRECISIONS = ("input", "fp32_logits", "fp32")


def misplaced_offsets(offsets: torch.Tensor, total) -> torch.Tensor:
    """Whether ``offsets`` [S + 1] (``cu_seqlens``, a kept set's offsets) fail to start at 0, never decrease and end at
    ``total``: a 0-d bool tensor on their device (no host sync: a caller syncs once, with its other checks)."""
    return (offsets[0] != 0) | (offsets[-1] != total) | (offsets[1:] < offsets[:-1]).any()


def offsets_error(name: str, offsets: torch.Tensor, total, what: str) -> ValueError:
    """The error of offsets that ``misplaced_offsets`` refuses, naming them and ``total``, ``what`` it counts."""
    shown = offsets.tolist()
    more = f" ... ending at {shown[-1]}" if len(shown) > 8 else ""
    return ValueError(f"{name} must start at 0, never decrease and end at {what} {total}, got {shown[:8]}{more}")


def outside_vocabulary(ids: torch.Tensor, V: int) -> torch.Tensor:
    """Which ids lie outside [0, V) (bool, as ``ids``; no host sync): every id check's predicate."""
    return (ids < 0) | (ids >= V)


def vocabulary_message(name: str, V: int, where: str = "at active tokens") -> str:
    """Every id check's words: ``name`` must lie in [0, V) (at active tokens, or wherever the caller says)."""
    return f"{name} must lie in [0, V) = [0, {V}){' ' + where if where else ''}"


def check_options_or_keywords(options, option_kwargs: dict, preset=None) -> None:
    """A call's options come as ``options=`` or as keywords (with an optional ``preset=``), not both."""
    if options is not None and (option_kwargs or preset is not None):
        given = f"keywords {sorted(option_kwargs)}" if option_kwargs else f"preset={preset!r}"
        raise ValueError(
            f"pass options either as options= or as keywords (with an optional preset=), got both ({given})"
        )


def check_choice(name: str, value, choices) -> None:
    """``value`` is one of ``choices`` (a setting's names)."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_hidden_grad_reduction(reduce_hidden_grad, group, what: str) -> None:
    """``reduce_hidden_grad``: a bool; False (the caller's mapping sums d hidden over the tensor-parallel group)
    only for hidden states with a ``vocab_parallel_group``, where there is a d hidden to leave to the caller."""
    if not isinstance(reduce_hidden_grad, bool):
        raise TypeError(f"reduce_hidden_grad must be True or False, got {reduce_hidden_grad!r}")
    if reduce_hidden_grad:
        return
    if group is None:
        raise ValueError(
            "reduce_hidden_grad=False leaves d hidden's sum over the vocabulary-parallel group to the caller: it "
            "needs vocab_parallel_group, got None"
        )
    if what != "hidden_states":
        raise ValueError(
            f"reduce_hidden_grad=False is about d hidden of a vocabulary-parallel head: the input here is {what}, "
            "whose gradient is this rank's slice already"
        )


def check_number(name: str, value, *, positive=False, non_negative=False, optional=False) -> None:
    """A finite real number (not a bool), > 0 where ``positive``, >= 0 where ``non_negative``; None where
    ``optional``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if non_negative and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")


def check_backend(backend) -> None:
    check_choice("backend", backend, BACKENDS)


def check_lm_head_mode(mode) -> None:
    """The fused head's mode where the caller chose one (None: the measured default)."""
    if mode is not None:
        check_choice("lm_head_mode", mode, LM_HEAD_MODES)


def check_head_precision(precision) -> None:
    check_choice("head_precision", precision, HEAD_PRECISIONS)


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _is_dtensor(t) -> bool:
    """A torch.distributed DTensor (FSDP2's parameters, tensor parallelism's shards)."""
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def check_not_sharded(name: str, t, local_hint: str) -> None:
    """A DTensor cannot enter the kernels (its data pointer is one shard's, its ops redistribute): name it."""
    if _is_dtensor(t):
        raise TypeError(
            f"{name} is a DTensor (placements {tuple(t.placements)} over a mesh of {t.device_mesh.size()} ranks); the "
            f"loss reads plain tensors. Under FSDP2, compute the loss inside the wrapped model's forward, where the "
            f"parameters are gathered, or pass {name}.full_tensor(); {local_hint}"
        )


def check_logits(logits) -> None:
    if logits.__class__ is not torch.Tensor:  # (a plain tensor is not a DTensor: host time)
        check_not_sharded(
            "logits",
            logits,
            "logits sharded over the vocabulary are logits.to_local() with vocab_parallel_group=<their process group>",
        )
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor [B, T, V], got {type(logits).__name__}")
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V] (3 dims), got shape {tuple(logits.shape)}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"logits must be float32, bfloat16, float16 or float64 (the torch path), got {logits.dtype}")
    if logits.shape[-1] == 0:
        raise ValueError(f"logits must have a vocabulary dimension V >= 1, got shape {tuple(logits.shape)}")


_INTEGER_DTYPES = frozenset(
    getattr(torch, name) for name in ("int64", "int32", "int16", "int8", "uint8") if hasattr(torch, name)
)  # (the common ids' dtypes, answered by one lookup: host time)


def check_one_position_more(ids, shape, what: str = "logits") -> None:
    """A model's whole output ([B, T + 1, V] logits, or [B, T + 1, H] hidden states) beside completion ids [B, T]: the
    last position predicts nothing, and ``drop_last_position=True`` (or a slice) is the fix; say so, before any
    per-token input is found to disagree with the logits' T."""
    B, T = shape[0], shape[1]
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and tuple(ids.shape) == (B, T - 1):
        fix = (
            "pass drop_last_position=True (its gradient written at the logits' shape, the last position's 0), or "
            "logits[:, :-1]"
            if what == "logits"
            else f"pass {what}[:, :-1]"
        )
        raise ValueError(
            f"{what} [B, T + 1, ...] = {(B, T)} hold one position more than completion_ids [B, T] = "
            f"{tuple(ids.shape)}: a model's whole output, whose last position predicts nothing; {fix}"
        )


def check_token_ids(ids, shape, device, check_range: bool, *, mask=None, normalizer=None) -> None:
    """Shape, dtype and device of the ids against the logits' ``shape`` (B, T, V) and ``device``; with
    ``check_range``, one host sync that checks the ids at active positions (``mask != 0``; all of them without a
    mask) lie in [0, V), and a tensor ``normalizer`` is positive and finite. Masked positions may hold anything
    (-100 included). The ids are the loss's and the method family's ``completion_ids`` (with their
    ``completion_mask``), the log-prob family's ``ids`` (no mask): each error names the caller's argument."""
    name = "completion_ids" if mask is not None else "ids"
    B, T, V = shape
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [B, T], got {type(ids).__name__}")
    if ids.dtype not in _INTEGER_DTYPES and (
        ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool
    ):
        raise TypeError(f"{name} must be an integer tensor, got {ids.dtype}")
    if ids.shape != (B, T):
        check_one_position_more(ids, shape)
        raise ValueError(f"{name} must be [B, T] = {(B, T)} to match logits [B, T, V], got {tuple(ids.shape)}")
    if ids.device != device:
        raise ValueError(f"{name} is on {ids.device} but logits is on {device}")
    if not check_range:
        return
    checked = ids if mask is None else ids.masked_fill(mask == 0, 0)
    weighted = mask is not None and mask.dtype != torch.bool and ids.numel()  # a mask of numbers: check them too
    if torch.compiler.is_compiling():  # a graph has no host sync: the same checks, asserted on the device
        _assert_in_graph(checked, V, mask if weighted else None, normalizer, name)
        return
    if not isinstance(normalizer, torch.Tensor) and not weighted:  # the ids' range alone: the one host sync
        values = torch.stack(torch.aminmax(checked)).tolist() if ids.numel() else []
    else:  # with the mask's range, the normalizer's value and the active tokens it may need, in the same sync
        stats = []
        if ids.numel():  # the ids' and the mask's ranges in one reduction: [ids low, ids high, mask low, mask high]
            # (fp64 holds every id exactly; a NaN anywhere in the mask makes both its ends NaN: aminmax propagates it)
            rows = torch.stack(
                [checked.reshape(-1).double(), mask.reshape(-1).double()]
                if weighted
                else [checked.reshape(-1).double()]
            )
            stats.append(torch.stack(torch.aminmax(rows, dim=1), dim=1).reshape(-1))
        if isinstance(normalizer, torch.Tensor):
            stats.append(_active_tokens(mask, ids).reshape(1).double())
            stats.append(normalizer.detach().reshape(1).double().to(ids.device))
        values = torch.cat(stats).tolist()  # the one host sync
    if ids.numel():
        low, high = int(values[0]), int(values[1])
        if low < 0 or high >= V:
            bad = low if low < 0 else high
            if mask is None:
                raise ValueError(f"{vocabulary_message('ids', V, '')}, got a token id {bad}")
            raise ValueError(
                f"{vocabulary_message('completion_ids', V, 'at active positions')}, got a token id {bad} "
                "(masked positions may hold any id, -100 included)"
            )
    if weighted:
        _check_mask_range(*values[2:4])
    if isinstance(normalizer, torch.Tensor):
        _check_normalizer_value(values[-1], lambda: int(values[-2]))


def _check_mask_range(low: float, high: float) -> None:
    """A mask's values are finite and >= 0: 1 counts a token, 0 masks it, another value weights it (TRL's
    ``per_token_loss * mask``: a weight of 0.5 or 2 counts as such). A negative value (a -1 for padding), a NaN or an
    inf would be taken as a weight, silently."""
    if math.isnan(low) or low < 0 or high == float("inf"):
        got = "a NaN" if math.isnan(low) else f"values from {low:g} to {high:g}"
        raise ValueError(
            f"completion_mask must be finite and >= 0 (1 counts a token, 0 masks it, another value "
            f"weights it), got {got}: a -1 or another padding marker must become 0 (e.g. "
            f"(mask == 1).float())"
        )


def _assert_in_graph(checked: torch.Tensor, V: int, mask, normalizer, name: str = "completion_ids") -> None:
    """``check_token_ids``'s checks inside a torch.compile graph: device-side assertions (``torch._assert_async``,
    no host sync, no graph break) that fail the step when an active id is outside [0, V) or a tensor
    normalizer is neither a positive finite count nor 0 over a batch with no active token."""
    if checked.numel():
        torch._assert_async(~outside_vocabulary(checked, V).any(), vocabulary_message(name, V, "at active positions"))
    if mask is not None:
        torch._assert_async(((mask >= 0) & (mask < float("inf"))).all(), "completion_mask must be finite and >= 0")
    if isinstance(normalizer, torch.Tensor):
        value = normalizer.detach().reshape(())
        valid = (torch.isfinite(value) & (value > 0)) | ((value == 0) & (_active_tokens(mask, checked) == 0))
        torch._assert_async(
            valid, "normalizer must be a positive, finite token count (or 0 for a batch with no active token)"
        )


def _active_tokens(mask, like: torch.Tensor) -> torch.Tensor:
    """The number of active tokens (``mask != 0``; every position without a mask), as a 0-d tensor."""
    return (mask != 0).sum() if mask is not None else torch.tensor(like.numel())


def _check_normalizer_value(value, active_tokens) -> None:
    """A token count: positive and finite, or 0 for a batch with no active token (``active_tokens()``
    counts them), whose loss and gradient are then 0, as with TRL's count clamped to 1."""
    active = active_tokens() if value == 0 else None
    if active == 0:
        return
    if not (math.isfinite(value) and value > 0):
        zero = "" if active is None else f"; 0 is accepted only for a batch with no active token, this one has {active}"
        raise ValueError(
            f"normalizer must be a positive, finite token count, got {value!r} (TRL clamps its "
            f"num_items_in_batch to at least 1 before dividing by the process count; do the same){zero}"
        )


def check_per_token(name: str, t, shape, device, *, allow_row: bool, allow_bool=False, allow_int=False):
    """A [B, T] (or [B] / [B, 1] where allow_row) tensor on ``device``; ``shape`` starts with (B, T)."""
    if t is None:
        return
    B, T = shape[0], shape[1]
    if (
        t.__class__ is torch.Tensor
        and t.dtype.is_floating_point
        and t.device == device
        and (t.shape == (B, T) or (allow_row and (t.shape == (B,) or t.shape == (B, 1))))
    ):
        return  # the common cases, accepted by every rule below (host time)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    ok_dtype = (
        t.dtype.is_floating_point
        or (allow_bool and t.dtype == torch.bool)
        or (allow_int and not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool)
    )
    if not ok_dtype:
        wanted = "a floating-point" + (", integer or bool" if allow_int else "")
        raise TypeError(f"{name} must be {wanted} tensor, got {t.dtype}")
    shapes = [(B, T)] + ([(B,), (B, 1)] if allow_row else [])
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(str(s) for s in shapes)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but logits is on {device}")


def check_inputs(
    shape,
    device,
    completion_ids,
    completion_mask,
    advantages,
    old_logps,
    ref_logps,
    importance_weights,
    normalizer,
    opts,
    check_ids: bool = True,
    what: str = "logits",
) -> None:
    """Every per-call tensor of a loss call against the logits' ``shape`` (B, T, V) and ``device`` (the logits
    themselves, or the hidden states and head, are their input form's to check; ``what`` names them)."""
    check_one_position_more(completion_ids, shape, what)
    if completion_mask is None:
        raise ValueError("completion_mask is required ([B, T], 1 where a completion token counts), got None")
    if advantages is None:
        raise ValueError("advantages is required ([B] or [B, T]), got None")
    check_per_token("completion_mask", completion_mask, shape, device, allow_row=False, allow_bool=True, allow_int=True)
    check_per_token("advantages", advantages, shape, device, allow_row=True)
    if old_logps is not None:
        check_per_token("old_logps", old_logps, shape, device, allow_row=False)
    if ref_logps is not None:
        check_per_token("ref_logps", ref_logps, shape, device, allow_row=False)
    if importance_weights is not None:
        check_per_token("importance_weights", importance_weights, shape, device, allow_row=True)
    if opts.uses_kl and ref_logps is None:
        raise ValueError(f"beta={opts.beta} > 0 needs ref_logps [B, T] (the reference model's log-probs), got None")
    if normalizer is not None:
        if not opts.takes_normalizer:
            if opts.loss.takes_normalizer:  # aggregation="prompt_mean" divides by the prompts instead
                raise ValueError(
                    f"normalizer is a token-count loss type's; aggregation={opts.aggregation!r} divides by the "
                    "call's prompts and their tokens instead (a step whose prompts span calls: loss_scale = this "
                    "call's prompts / the step's)"
                )
            raise ValueError(
                f"normalizer is the token count of loss_type in {list(opts.token_count_loss_types)}; "
                f"loss_type={opts.loss_type!r} does not use it"
            )
        if isinstance(normalizer, torch.Tensor):
            if normalizer.numel() != 1:
                raise ValueError(f"normalizer must be a scalar, got shape {tuple(normalizer.shape)}")
            if normalizer.dtype == torch.bool or normalizer.dtype.is_complex:
                raise TypeError(f"normalizer must be a real number tensor, got {normalizer.dtype}")
        elif isinstance(normalizer, bool) or not isinstance(normalizer, (int, float)):
            raise ValueError(f"normalizer must be a positive number (a token count), got {normalizer!r}")
        else:  # a Python number: checked at once (a host sync only to count the tokens behind a 0)
            _check_normalizer_value(normalizer, lambda: int(_active_tokens(completion_mask, completion_ids)))
    check_token_ids(completion_ids, shape, device, check_ids, mask=completion_mask, normalizer=normalizer)


def check_prompt_ids(prompt_ids, S: int, device, opts, packed: bool) -> None:
    """The call's ``prompt_ids``: each sequence's prompt (any integers; equal ids, one prompt), [S] on the
    device, given exactly where ``aggregation="prompt_mean"`` reads them."""
    rows = "sequences (cu_seqlens' S)" if packed else "rows (B)"
    if opts.aggregation != "prompt_mean":
        if prompt_ids is not None:
            raise ValueError(
                f"prompt_ids group the sequences for aggregation='prompt_mean'; aggregation={opts.aggregation!r} "
                "does not read them (pass aggregation='prompt_mean', or no prompt_ids)"
            )
        return
    if prompt_ids is None:
        raise ValueError(
            f"aggregation='prompt_mean' needs prompt_ids: an integer tensor [{S}] naming each of the {S} {rows}' "
            "prompt, got None"
        )
    if not isinstance(prompt_ids, torch.Tensor):
        raise TypeError(f"prompt_ids must be an integer torch.Tensor [{S}], got {type(prompt_ids).__name__}")
    if prompt_ids.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"prompt_ids must hold integers (one id a prompt), got {_describe(prompt_ids)}")
    if prompt_ids.dim() != 1 or prompt_ids.shape[0] != S:
        raise ValueError(f"prompt_ids must be [{S}], one id for each of the {S} {rows}, got {_describe(prompt_ids)}")
    if prompt_ids.device != device:
        raise ValueError(f"prompt_ids must be on the logits' device {device}, got {_describe(prompt_ids)}")


class Backend(NamedTuple):
    """How a call's passes run, chosen once (``resolve_backend``, from ``inputs.prepare_inputs``): ``name`` "triton",
    the kernels, or "torch", the chunked torch path; ``in_graph``, inside a torch.compile graph, where each pass is one
    of ``ops.py``'s custom ops (and a kept set's or a teacher's entries are the torch path's gathers). Every pass
    below the pipeline reads this one value, never a string."""

    name: str
    in_graph: bool

    @property
    def kernels(self) -> bool:
        """The Triton kernels (eager, or as a graph's custom ops)."""
        return self.name == "triton"

    @property
    def eager_kernels(self) -> bool:
        """The Triton launchers called directly (not inside a graph)."""
        return self.name == "triton" and not self.in_graph


TRITON_KERNELS = Backend("triton", False)  # the fused loss Functions' own: they run eagerly, on the kernels


def resolve_backend(backend: str, logits: torch.Tensor) -> Backend:
    """This call's ``Backend``: 'triton' or 'torch' (from 'auto' by the device and dtype), in a graph or not."""
    in_graph = torch.compiler.is_compiling()
    if backend == "torch":
        return Backend("torch", in_graph)
    if backend == "auto":  # the chunked torch path also runs on CUDA where triton is absent
        # (fp64, gradcheck's, is the torch path's: the kernels are fp32 inside)
        name = "triton" if logits.is_cuda and logits.dtype != torch.float64 and triton_available() else "torch"
        return Backend(name, in_graph)
    check_backend(backend)
    if logits.dtype == torch.float64:
        raise TypeError(
            "backend='triton' takes float32, bfloat16 or float16; float64 runs on backend='torch' "
            "(for gradcheck), or cast to float32"
        )
    if not in_graph:  # (a graph's ops import it when they run)
        if logits_launch.__class__ is TritonMissing:  # a clear ImportError where triton is absent
            raise logits_launch.error()
    if not logits.is_cuda:
        if not interpreter_enabled():
            raise ValueError(
                f"backend='triton' got logits on {logits.device}: Triton runs CPU tensors only in its "
                "interpreter, which needs TRITON_INTERPRET=1 set before triton is imported; "
                "use backend='torch' or 'auto' for CPU tensors"
            )
        if not in_graph:  # dynamo (torch 2.7) cannot trace the version parsing; eager checks
            check_interpreter_versions()
    return Backend(backend, in_graph)


@functools.cache
def check_interpreter_versions() -> None:
    """Refuse, with the versions, a Triton interpreter that cannot run the kernels: before triton 3.7 it turns
    a kernel's scalar into a NumPy array that NumPy 2.4 refuses to convert (``only 0-dimensional arrays can be
    converted to Python scalars``, deep in a kernel)."""
    import numpy
    import triton
    from packaging.version import Version

    if Version(triton.__version__).release < (3, 7) and Version(numpy.__version__).release >= (2, 4):
        raise RuntimeError(
            f"Triton's interpreter (TRITON_INTERPRET=1) before triton 3.7 fails with numpy >= 2.4; "
            f"got triton {triton.__version__} and numpy {numpy.__version__}: install "
            "'numpy<2.4' or triton >= 3.7, or use backend='torch' on CPU tensors"
        )


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_INTERPRETER_ENABLED: list = []  # the answer, once asked (a functools cache would be traced by dynamo, which warns)


@torch.compiler.assume_constant_result  # (a graph reads it once, when traced)
def interpreter_enabled() -> bool:
    """True when the kernels were built by Triton's interpreter (TRITON_INTERPRET=1 at import): fixed when triton is
    imported, read once from the kernel's own type."""
    if not _INTERPRETER_ENABLED:
        from triton.runtime.interpreter import InterpretedFunction

        from .kernels.logits import grpo_forward_kernel

        _INTERPRETER_ENABLED.append(isinstance(grpo_forward_kernel, InterpretedFunction))
    return _INTERPRETER_ENABLED[0]


def check_in_place(in_place: bool, logits: torch.Tensor) -> None:
    """In-place backward overwrites the logits' storage: refuse it when that storage is a leaf's.

    ``logits[:, :-1]`` of a leaf is a view whose ``._base`` is the leaf: writing the gradient
    there would overwrite the leaf itself, so the check looks through views.
    """
    if not in_place:
        return
    base = logits
    while base._base is not None:
        base = base._base
    if base.is_leaf and base.requires_grad:
        what = "a leaf tensor" if base is logits else f"a view of a leaf tensor (shape {tuple(base.shape)})"
        raise ValueError(
            f"in_place_backward=True would overwrite logits, {what} that requires grad, with its own "
            "gradient; use it only on logits produced by the model (an lm_head output)"
        )


def checked_drop_last_position(drop_last_position, logits, completion_ids) -> bool:
    """``drop_last_position`` after checking that the logits carry exactly one position more than the ids."""
    if not isinstance(drop_last_position, bool):
        raise TypeError(f"drop_last_position must be a bool, got {drop_last_position!r}")
    if drop_last_position:  # (the logits themselves checked by the caller: check_logits)
        T = completion_ids.shape[-1] if isinstance(completion_ids, torch.Tensor) and completion_ids.dim() == 2 else None
        if T is None or logits.shape[1] != T + 1:
            got = tuple(completion_ids.shape) if isinstance(completion_ids, torch.Tensor) else None
            raise ValueError(
                f"drop_last_position=True needs logits [B, T + 1, V] for completion_ids [B, T], got "
                f"logits {tuple(logits.shape)} and completion_ids {got}"
            )
    return drop_last_position


def checked_loss_scale(loss_scale):
    """A loss scale as the loss reads it: a Python float, or a detached 0-d float tensor."""
    if loss_scale.__class__ is float and -math.inf < loss_scale < math.inf:  # (the common case first: host time)
        return loss_scale
    if isinstance(loss_scale, torch.Tensor):
        if loss_scale.numel() != 1 or not loss_scale.dtype.is_floating_point:
            raise ValueError(
                f"loss_scale must be a number or a one-element float tensor, got shape "
                f"{tuple(loss_scale.shape)} and dtype {loss_scale.dtype}"
            )
        return loss_scale.detach().reshape(())
    # a comparison, not math.isfinite: torch.compile(dynamic=True) traces floats as symbols, which it refuses
    if (
        isinstance(loss_scale, bool)
        or not isinstance(loss_scale, (int, float))
        or not -math.inf < loss_scale < math.inf
    ):
        raise ValueError(
            f"loss_scale must be a finite number (e.g. 1 / gradient-accumulation steps), got {loss_scale!r}"
        )
    return float(loss_scale)


def check_linear_inputs(hidden_states, weight, bias) -> None:
    """Hidden states [B, T, H], the lm_head weight [V, H] and bias [V] of the fused lm_head."""
    shard_hint = (
        "a weight sharded over the vocabulary (Shard(0), a column-parallel head) is weight.to_local() with "
        "vocab_parallel_group=<its process group>"
    )
    for name, t in (("hidden_states", hidden_states), ("weight", weight), ("bias", bias)):
        check_not_sharded(name, t, shard_hint)
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        got = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
        raise ValueError(f"hidden_states must be [B, T, H], got {got}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden_states.shape[-1]:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be the lm_head weight [V, H] with H = {hidden_states.shape[-1]}, got {got}")
    for name, t in (("hidden_states", hidden_states), ("weight", weight)):
        if t.dtype not in LOGIT_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16, float16 or float64 (the torch path), got {t.dtype}")
    if weight.dtype != hidden_states.dtype or weight.device != hidden_states.device:
        raise ValueError(
            f"weight ({weight.dtype}, {weight.device}) must match hidden_states "
            f"({hidden_states.dtype}, {hidden_states.device})"
        )
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.device != weight.device):
        raise ValueError(
            f"bias must be [V] = ({weight.shape[0]},) on {weight.device}, got {tuple(bias.shape)} on {bias.device}"
        )


def checked_kept_set(kept_set, token_shape: tuple, N: int, V: int, device, mask, check_range: bool):
    """The sampler's kept sets (``kept_set.KeptSet``) of a call's N tokens (``token_shape``: the completion ids'
    shape as the caller gave them) as the kernels read them (``kernels.contracts.KeptTokens``): CSR ids [nnz] with
    offsets [N + 1] (starting at 0, never decreasing, ending at nnz), or padded ids ``token_shape`` + [K]; integer
    ids below V (a negative padded id: no entry), checked at active tokens with ``check_range`` (one host sync;
    inside a torch.compile graph, device-side assertions). A masked token's set is never read."""
    if kept_set is None:
        return None
    if not isinstance(kept_set, KeptSet):
        raise TypeError(
            f"kept_set must be a grpo_kernels.KeptSet (KeptSet.from_vllm(ids, offsets) or KeptSet.from_padded(ids)), "
            f"got {type(kept_set).__name__}"
        )
    check_choice("kept_set.outside", kept_set.outside, OUTSIDE)
    check_choice("kept_set.entropy", kept_set.entropy, ENTROPY)
    ids, offsets = kept_set.ids, kept_set.offsets
    if not isinstance(ids, torch.Tensor) or ids.dtype not in _INTEGER_DTYPES:
        got = _describe(ids) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"kept_set.ids must be an integer tensor, got {got}")
    if ids.device != device:
        raise ValueError(f"kept_set.ids must be on the logits' device {device}, got {_describe(ids)}")
    if offsets is None:
        if tuple(ids.shape[:-1]) != tuple(token_shape) or ids.dim() != len(token_shape) + 1:
            raise ValueError(
                f"kept_set.ids (padded, no offsets) must be the completion ids' shape {tuple(token_shape)} plus the "
                f"set's width K, got {_describe(ids)}"
            )
        wide, width = ids.reshape(N, ids.shape[-1]), int(ids.shape[-1])
        entry_token = None
    else:
        if not isinstance(offsets, torch.Tensor) or offsets.dtype not in _INTEGER_DTYPES or offsets.dim() != 1:
            got = _describe(offsets) if isinstance(offsets, torch.Tensor) else type(offsets).__name__
            raise TypeError(f"kept_set.offsets must be a 1-D integer tensor [N + 1] (vLLM's CSR offsets), got {got}")
        if ids.dim() != 1:
            raise ValueError(f"kept_set.ids with offsets (CSR) must be 1-D [nnz], got {_describe(ids)}")
        if offsets.numel() != N + 1:
            raise ValueError(
                f"kept_set.offsets must hold one more than the call's {N} tokens, [{N + 1}], got {_describe(offsets)}"
            )
        if offsets.device != device:
            raise ValueError(f"kept_set.offsets must be on the logits' device {device}, got {_describe(offsets)}")
        wide, width = ids, 0
        offsets = offsets.to(torch.int64).contiguous()
        # each entry's token (offsets[n] <= entry < offsets[n + 1]), defined whatever the offsets (checked next)
        entry = torch.arange(ids.numel(), device=device)
        entry_token = torch.searchsorted(offsets[1:], entry, right=True).clamp(max=max(N - 1, 0))
    if check_range:  # on the ids as given: an int64 id past 2**31 must not wrap into range
        _check_kept_values(wide, offsets, entry_token, V, mask, N)
    flat = wide.to(torch.int32).contiguous()  # the kernels' ids (V < 2**31)
    return KeptTokens(flat, offsets, width, kept_set.outside == "add_target", kept_set.entropy == "set")


def _check_kept_values(ids, offsets, entry_token, V: int, mask, N: int) -> None:
    """The kept sets' offsets and ids (``checked_kept_set``), in one host sync (device-side assertions in a graph)."""
    active = None if mask is None else mask.reshape(-1) != 0
    if offsets is None:
        at = ids if active is None else ids.masked_fill(~active.view(N, 1), -1)
        bad_id = at >= V
        bad_offsets = torch.zeros((), dtype=torch.bool, device=ids.device)
        ordered = at.sort(dim=-1).values  # a repeated id: equal neighbours once sorted (no entries: negative)
        repeated = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any()
    else:
        at = ids if active is None else ids.masked_fill(~active[entry_token], 0)
        bad_id = outside_vocabulary(at, V)
        bad_offsets = misplaced_offsets(offsets, ids.numel())
        # a repeated id within a token's set: equal neighbours of the sorted (token, id) keys (masked tokens skipped)
        keys = (entry_token * (V + 1) + at.long() + 1).masked_fill(at < 0, -1)
        if active is not None:
            keys = keys.masked_fill(~active[entry_token], -1)
        ordered = keys.sort().values
        repeated = ((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)).any()
    if torch.compiler.is_compiling():
        torch._assert_async(~bad_offsets, "kept_set.offsets must start at 0, never decrease and end at the ids' count")
        torch._assert_async(~bad_id.any(), vocabulary_message("kept_set.ids", V))
        torch._assert_async(~repeated, "kept_set.ids must not repeat an id within a token's set")
        return
    flags = torch.stack([bad_offsets, bad_id.any(), repeated]).tolist()  # the one host sync
    if flags[0]:
        raise offsets_error("kept_set.offsets", offsets, ids.numel(), "the ids' count")
    if flags[1]:
        bad = int(at[bad_id].reshape(-1)[0])
        padding = " (a padded set's negative ids mean no entry)" if offsets is None else ""
        raise ValueError(f"{vocabulary_message('kept_set.ids', V)}{padding}, got {bad}")
    if flags[2]:
        raise ValueError(
            "kept_set.ids must not repeat an id within a token's set (each kept id once: a repeat would count its "
            "probability twice)"
        )


def check_like_mask(name: str, t, completion_mask) -> None:
    """A floating-point per-token tensor shaped as the completion mask (the reverse-KL distillation's log-probs)."""
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name} must be a floating-point tensor shaped as the completion mask, got {got}")
    if t.shape != completion_mask.shape:
        raise ValueError(
            f"{name} must have the completion mask's shape {tuple(completion_mask.shape)}, got {tuple(t.shape)}"
        )


def check_teacher_topk(teacher_ids, teacher_logps, completion_mask) -> None:
    """A distillation call's teacher inputs before anything reads them: integer ids and floating-point log-probs of
    one shape, the completion mask's plus K."""
    for name, t, integer in (("teacher_ids", teacher_ids, True), ("teacher_logps", teacher_logps, False)):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            got = "a 0-d tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a torch.Tensor [..., K], got {got}")
        if integer != (not t.dtype.is_floating_point and t.dtype != torch.bool and not t.dtype.is_complex):
            raise TypeError(f"{name} must be {'an integer' if integer else 'a floating-point'} tensor, got {t.dtype}")
    if teacher_ids.shape != teacher_logps.shape:
        raise ValueError(
            f"teacher_ids and teacher_logps must have one shape, got {tuple(teacher_ids.shape)} and "
            f"{tuple(teacher_logps.shape)}"
        )
    if isinstance(completion_mask, torch.Tensor) and tuple(teacher_ids.shape[:-1]) != tuple(completion_mask.shape):
        raise ValueError(
            f"teacher_ids must be the completion mask's shape {tuple(completion_mask.shape)} plus the teacher's K, "
            f"got {tuple(teacher_ids.shape)}"
        )


def checked_teacher_topk(teacher_ids, teacher_logps, token_shape: tuple, ids_shape: tuple, V: int, device, mask,
                         check_values: bool) -> tuple:  # fmt: skip
    """(teacher ids int64, teacher log-probs) [..., K] of a distillation call (``check_teacher_topk`` first),
    reshaped to the kernels' ``ids_shape`` + [K] (a packed call's one row): shaped as the completion's tokens
    (``token_shape``) plus K, K at most V; with ``check_values`` (one host sync) the ids in [0, V) and the log-probs
    finite at active tokens (a masked token is never read: its ids and log-probs may be anything, and its ids are
    returned as 0, so that no pass of any backend or input form gathers at them)."""
    for name, t in (("teacher_ids", teacher_ids), ("teacher_logps", teacher_logps)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the logits (or hidden states) are on {device}")
        if t.dim() != len(token_shape) + 1 or tuple(t.shape[:-1]) != tuple(token_shape):
            raise ValueError(
                f"{name} must be the completion ids' shape {tuple(token_shape)} plus the teacher's K, got "
                f"{tuple(t.shape)}"
            )
    K = teacher_ids.shape[-1]
    if not 1 <= K <= V:
        raise ValueError(f"the teacher's K (the last dim of teacher_ids) must be in [1, V] = [1, {V}], got {K}")
    ids = teacher_ids.reshape(*ids_shape, K).long()
    logps = teacher_logps.reshape(*ids_shape, K)
    if check_values:
        active = (
            torch.ones(ids_shape, dtype=torch.bool, device=device) if mask is None else mask.reshape(ids_shape) != 0
        )
        at = active.unsqueeze(-1)
        outside = outside_vocabulary(ids, V) & at
        bad_ids = outside.any()
        bad_logps = (~torch.isfinite(logps)).logical_and(at).any()
        if torch.compiler.is_compiling():  # a graph has no host sync: the same checks, asserted on the device
            torch._assert_async(~bad_ids, vocabulary_message("teacher_ids", V))
            torch._assert_async(~bad_logps, "teacher_logps must be finite at active tokens")
            flags = (False, False)
        else:
            flags = torch.stack([bad_ids, bad_logps]).tolist()  # the one host sync
        if flags[0]:
            raise ValueError(f"{vocabulary_message('teacher_ids', V)}, got {int(ids[outside][0])}")
        if flags[1]:
            bad = float(logps[~torch.isfinite(logps) & at][0])
            raise ValueError(f"teacher_logps must be finite at active tokens, got {bad}")
    if mask is not None:
        ids = torch.where(mask.reshape(*ids_shape, 1) != 0, ids, 0)
    return ids, logps
