"""Host launchers for the fused lm_head kernels (``fused_linear.py``): tiles, vocabulary splits, the
chunked backward, and the 3-product mode's cuBLAS chunks.

They share the per-token inputs, outputs and loss scalars with the logits kernels' launchers
(``logits_launch.py``), since both kernel families end in the same per-token loss code. No autograd here:
the host functions of ``grpo_kernels.from_hidden_states`` call these.
"""

from __future__ import annotations

import torch
import triton

from . import fused_linear as FL
from . import (
    kept_launch,
    logits_launch,  # the 3-product mode runs the logits kernels on each chunk
    tuned,
)
from .contracts import NO_TOKEN_INPUTS, KernelLoss, OnePassGradient, TokenInputs, fp32_products, rounds_head_logits
from .logits_launch import ForwardResult, allocate_outputs, loss_args, loss_pointer_args, resolved_head


def default_lm_head_mode(hidden: torch.Tensor, vocab_size: int) -> str:
    """ "recompute" unless the device sweep measured the 3-product mode faster for this GPU and vocabulary."""
    entry = tuned.fused_linear_entry(hidden.device, hidden.dtype, vocab_size)
    return "recompute" if entry is None else entry.get("mode", "recompute")


# The 3-product mode's workspace with a gradient, [chunk, V] in the input dtype (whole rows: the one-pass kernel
# needs a row's log-sum-exp before it writes any of its gradient), is at most this big (at least one token).
# 1 GiB is 3,530 tokens of a 151,936 vocabulary in bf16: few enough chunks that re-reading the fp32 d weight per
# chunk (2 x V x H x 4 bytes) stays a small part of the products. Lower it to trade speed for memory.
LINEAR_WORKSPACE_BYTES = 1 << 30
# Every other workspace of the lm_head, tiled over the vocabulary as well as the tokens: the 3-product mode without
# a gradient (each tile's log-sum-exp states merged, as the recomputing forward's vocabulary splits are) and the
# recomputing mode's backward (d hidden accumulated over the tiles). 256 MiB is 16,384 tokens x 8,192 columns in
# bf16 (19 tiles of a 151,936 vocabulary); stock TRL's own head holds a [4096, 32768] fp32 tile, 512 MiB.
LINEAR_TILED_WORKSPACE_BYTES = 256 << 20
# The narrowest vocabulary tile before the tokens are chunked: all the tokens in one chunk read the weight (and
# accumulate its gradient) once, and a tile of 4096 columns keeps the products large
MIN_VOCAB_TILE = 4096


def linear_block_config(dtype: torch.dtype) -> dict[str, dict[str, object]]:
    """Tiles of the fused lm_head kernels, per kernel: "logits" (forward and dlogits) and "matmul".

    logits: 64 x 128 output tiles over 64-wide H slices, 8 warps: a [64, 128] fp32 tile is
    32 registers a thread, and the online log-sum-exp needs a few of those live.
    matmul: 128 x 128 tiles over 64-wide (16-bit) or 32-wide (fp32) K slices, 8 warps, in
    groups of 8 row blocks. tests/test_aot_compile.py checks every one for spills. fp32
    inputs use exact ("ieee") products so that fp32 matches the reference; 16-bit inputs
    the tensor cores, whatever the precision says (it names how fp32 operands are multiplied): "ieee" there
    too, the one value every backend takes (AMD's gfx90a has no "tf32", and refuses it).
    """
    precision = "ieee"
    return {
        "logits": {"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_H": 64, "num_warps": 8, "DOT_PRECISION": precision},
        "matmul": {
            "BLOCK_M": 128,
            "BLOCK_N": 128,
            "BLOCK_K": 32 if dtype == torch.float32 else 64,
            "GROUP_M": 8,
            "num_warps": 8,
            "DOT_PRECISION": precision,
        },
    }


def _shrink(block: int, extent: int) -> int:
    """Small problems (tests, the interpreter): a tile no bigger than the problem; tl.dot needs 16."""
    return max(16, min(block, triton.next_power_of_2(max(extent, 1))))


def _interpreted_bf16(dtype) -> bool:
    """True under TRITON_INTERPRET with bf16 inputs, where tl.dot operands must be upcast (see fused_linear.py)."""
    from triton.runtime.interpreter import InterpretedFunction

    return dtype == torch.bfloat16 and isinstance(FL.linear_grpo_forward_kernel, InterpretedFunction)


def _logits_config(N: int, V: int, H: int, dtype, device=None, override=None, fp32_logits=False) -> dict[str, object]:
    """The lm_head logits tiles: ``override`` (the sweep), else the measured winner, else the defaults."""
    cfg = dict(linear_block_config(dtype)["logits"])
    entry = None if device is None else tuned.fused_linear_entry(device, dtype, V)
    for source in (entry, override):
        if source:
            cfg.update({k: source[k] for k in tuned.FUSED_LINEAR_KEYS if source.get(k) is not None})
    cfg["UPCAST"] = _interpreted_bf16(dtype)
    # the logits rounded to 16-bit inputs' dtype, as an unfused head (and the 3-product mode's cuBLAS) computes them
    cfg["ROUND_LOGITS"] = rounds_head_logits(dtype, fp32_logits)
    if cfg["UPCAST"]:
        cfg["DOT_PRECISION"] = "ieee"
    # a small model's vocabulary and width shrink the tiles; the token block does not shrink with the batch: a
    # token's logits come from the same [BLOCK_N, BLOCK_V] products whatever else is in the batch (batch invariance;
    # a tile's rows are independent, so padding rows cost work, never a different sum)
    for key, extent in (("BLOCK_V", V), ("BLOCK_H", H)):
        cfg[key] = _shrink(cfg[key], extent)
    return cfg


@fp32_products
def linear_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    *,
    kernel_loss: KernelLoss | None = None,
    temperature: float | None = None,
    softcap: float | None = None,
    tokens: TokenInputs = NO_TOKEN_INPUTS,
    compute_entropy: bool = False,
    config: dict[str, int] | None = None,
    compute_sum_squares: bool = False,
    fp32_logits: bool = False,
) -> ForwardResult:
    """The forward kernel on cap(hidden [N, H] @ weight[V, H]^T + bias) / temperature (``logits_launch.resolved_head``),
    logits never stored; with ``compute_sum_squares`` (a log-prob pass) each token's Σπ² too.

    Per-token inputs (``tokens``) and outputs as in ``logits_launch.forward`` (fp32 [N]); with ``kernel_loss``
    None only log-probs (and entropy) are computed. The lm_head gradient needs the full log-sum-exp first:
    see ``linear_backward``.
    """
    temperature, softcap = resolved_head(kernel_loss, temperature, softcap)
    N, H = hidden.shape
    V = weight.shape[0]
    out = allocate_outputs(N, hidden.device, kernel_loss, compute_entropy)
    if compute_sum_squares:
        out.sum_squares = torch.empty(N, device=hidden.device, dtype=torch.float32)
    per_token = dict(**loss_pointer_args(out, tokens), **loss_args(kernel_loss))
    cfg = _logits_config(N, V, H, hidden.dtype, hidden.device, config, fp32_logits)
    if N == 0:
        return out
    blocks_n = triton.cdiv(N, cfg["BLOCK_N"])
    splits, v_per_split = linear_vocab_splits(blocks_n, V, cfg["BLOCK_V"], hidden.device)
    states = 5 if compute_sum_squares else 4
    partials = torch.empty(states, splits, N, device=hidden.device, dtype=torch.float32) if splits > 1 else None
    FL.linear_grpo_forward_kernel[(blocks_n, splits)](
        h_ptr=hidden,
        w_ptr=weight,
        b_ptr=bias,
        ids_ptr=ids,
        N=N,
        V=V,
        H=H,
        v_per_split=v_per_split,
        partials_ptr=partials,
        inv_temperature=1.0 / temperature,
        softcap=softcap,
        **per_token,
        **cfg,
    )
    if splits > 1:
        FL.linear_grpo_combine_kernel[(triton.cdiv(N, COMBINE_BLOCK),)](
            partials_ptr=partials,
            N=N,
            splits=splits,
            **per_token,
            BLOCK_N=COMBINE_BLOCK,
        )
    return out


# Vocabulary splits of the lm_head forward: None picks them from the GPU's size (below);
# tests set a number to run the split path in the interpreter.
LINEAR_FORWARD_SPLITS: int | None = None
COMBINE_BLOCK = 128


def linear_vocab_splits(blocks_n: int, V: int, block_v: int, device) -> tuple:
    """(splits, vocabulary columns per split) of the forward grid.

    One program per token block streams all of V, which fills an H200's 132 SMs only from
    about 2 x 132 blocks (17k tokens at 64 a block). With fewer blocks the vocabulary is
    cut into splits so that the grid has about two programs per SM; each split is whole
    BLOCK_V tiles. The price is a [4, splits, N] fp32 buffer and one small combine kernel.
    """
    tiles = triton.cdiv(V, block_v)
    if LINEAR_FORWARD_SPLITS is not None:
        wanted = LINEAR_FORWARD_SPLITS
    elif device.type == "cuda":
        wanted = triton.cdiv(2 * torch.cuda.get_device_properties(device).multi_processor_count, blocks_n)
    else:
        wanted = 1
    tiles_per_split = triton.cdiv(tiles, max(1, min(wanted, tiles)))
    splits = triton.cdiv(tiles, tiles_per_split)  # every split has at least one tile
    return splits, tiles_per_split * block_v


def workspace_tiles(N: int, V: int, element_size: int, budget: int | None = None) -> tuple:
    """(tokens, columns) of a [tokens, columns] workspace tile within ``budget`` bytes
    (``LINEAR_TILED_WORKSPACE_BYTES``): whole rows of all N tokens where they fit; else all N tokens over vocabulary
    tiles as wide as fit, down to ``MIN_VOCAB_TILE`` columns (one pass over the weight); else tiles of
    ``MIN_VOCAB_TILE`` columns (or V) over chunks of tokens. Columns are a multiple of 64 (16-byte aligned rows in
    any dtype) unless they are V."""
    budget = LINEAR_TILED_WORKSPACE_BYTES if budget is None else budget
    N = max(N, 1)
    if N * V * element_size <= budget:
        return N, V
    columns = budget // (N * element_size) // 64 * 64
    if columns >= min(V, MIN_VOCAB_TILE):
        return N, min(columns, V)
    columns = min(V, MIN_VOCAB_TILE)
    return max(1, min(N, budget // (columns * element_size))), columns


def linear_chunk_tokens(N: int, V: int, element_size: int, block_n: int) -> int:
    """Tokens per backward chunk: the [chunk, V] workspace within LINEAR_WORKSPACE_BYTES, whole token blocks."""
    fits = LINEAR_WORKSPACE_BYTES // max(V * element_size, 1)
    if fits >= N:
        return max(N, 1)
    return max(block_n, fits // block_n * block_n)


def _matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """out (fp32 [M, N], contiguous) = (out if accumulate) + a [M, K] @ b [K, N], any strides."""
    M, K_ = a.shape
    N = b.shape[1]
    cfg = dict(linear_block_config(a.dtype)["matmul"])
    upcast = _interpreted_bf16(a.dtype)
    blocks = {
        "BLOCK_M": _shrink(cfg["BLOCK_M"], M),
        "BLOCK_N": _shrink(cfg["BLOCK_N"], N),
        "BLOCK_K": _shrink(cfg["BLOCK_K"], K_),
    }
    grid = (triton.cdiv(M, blocks["BLOCK_M"]) * triton.cdiv(N, blocks["BLOCK_N"]),)
    FL.matmul_kernel[grid](
        a_ptr=a,
        b_ptr=b,
        c_ptr=out,
        M=M,
        N=N,
        K=K_,
        stride_am=a.stride(0),
        stride_ak=a.stride(1),
        stride_bk=b.stride(0),
        stride_bn=b.stride(1),
        ACCUMULATE=accumulate,
        DOT_PRECISION="ieee" if upcast else cfg["DOT_PRECISION"],
        UPCAST=upcast,
        GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"],
        **blocks,
    )


# cuBLAS products with fp32 output (torch's mm / addmm with out_dtype, CUDA), per op: None = not
# tried yet; False = this torch lacks it, and the Triton product runs instead.
_CUBLAS_FP32_OUT: dict[str, bool | None] = {"mm": None, "addmm": None}


def product_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """out (fp32 [M, N]) = (out if accumulate) + a @ b with fp32 accumulation.

    On CUDA, cuBLAS (about 790 TFLOP/s in bf16 on an H200) writing fp32 directly, d weight
    accumulated in place across chunks (addmm's beta = 1); where torch has no fp32-output
    product (or on CPU, under the interpreter), the Triton tile product ``matmul_kernel``.
    """
    op = "addmm" if accumulate else "mm"
    if a.is_cuda and _CUBLAS_FP32_OUT[op] is not False:
        try:
            if accumulate:
                torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
            else:
                torch.mm(a, b, out_dtype=torch.float32, out=out)
            _CUBLAS_FP32_OUT[op] = True
            return
        except (TypeError, RuntimeError, NotImplementedError):
            if _CUBLAS_FP32_OUT[op]:  # it worked before: a real error
                raise
            _CUBLAS_FP32_OUT[op] = False
    _matmul(a, b, out, accumulate)


def _linear_gradient_buffers(hidden, weight, bias, compute_weight_grad: bool):
    """fp32 d hidden [N, H], d weight [V, H] (or None: a frozen head) and d bias [V] (or None).

    d weight is written by the first chunk's product and added to by the later ones.
    """
    N, H = hidden.shape
    f32 = dict(device=hidden.device, dtype=torch.float32)
    dw = torch.empty(weight.shape[0], H, **f32) if compute_weight_grad else None
    db = torch.zeros(weight.shape[0], **f32) if compute_weight_grad and bias is not None else None
    return torch.empty(N, H, **f32), dw, db


def _add_chunk_gradients(dx, weight, hidden_chunk, dh_chunk, dw, db, first: bool, first_tile: bool = True) -> None:
    """From one tile's dlogits dx [chunk, columns] (the columns of ``weight``, ``dw`` and ``db``: the whole vocabulary,
    or a tile of it): its share of d hidden, d weight and d bias. d hidden is written by a chunk's first tile and
    added to by its later ones; d weight by the first chunk's product and added to by the later ones."""
    product_into(dx, weight, dh_chunk, accumulate=not first_tile)
    if dw is not None:
        product_into(dx.T, hidden_chunk, dw, accumulate=not first)
    if db is not None:
        db += dx.sum(0, dtype=torch.float32)


def _tiles(N: int, V: int, tokens: int, columns: int):
    """(token slice, first column, last column + 1) of each workspace tile, the vocabulary fastest."""
    for n0 in range(0, N, tokens):
        for v0 in range(0, V, columns):
            yield slice(n0, min(n0 + tokens, N)), v0, min(v0 + columns, V)


def _tile_view(workspace: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """A contiguous [rows, columns] tile at the start of a flat workspace (cuBLAS writes it whole, rows adjacent)."""
    return workspace[: rows * columns].view(rows, columns)


@fp32_products
def linear_three_products(
    hidden,
    weight,
    bias,
    ids,
    *,
    kernel_loss: KernelLoss,
    tokens: TokenInputs,
    compute_entropy: bool,
    gradient: OnePassGradient | None,
    compute_weight_grad: bool,
    kept: tuple | None = None,
    fp32_logits: bool = False,
):
    """The fused lm_head with 3 products instead of 4: loss terms and every gradient in one chunk loop.

    Each chunk's logits are computed once (``hidden @ weight.T + bias``, in the input dtype, into
    one reused [chunk, V] workspace); the one-pass logits kernel turns them into the loss terms
    and, in place, into dlogits of the reduced loss (``gradient``: each token's weight, and the entropy
    bonus's; its ``out`` and ``in_place`` are this function's); then d hidden = dx @ W and d weight +=
    dx^T @ h. The gradient is complete when the forward ends: the backward only scales it. Memory is
    bounded by the chunk, as in the recomputing mode. Returns (ForwardResult over the N tokens, d hidden,
    d weight or None, d bias or None), fp32. With ``gradient`` None only the forward runs (no gradient
    wanted: evaluation, old log-probs: ``_three_products_forward``, its workspace tiled over the vocabulary
    too), and the three gradients are None. ``kept``: (``KeptTokens``, ``KeptTerms``) of the call's kept sets (the
    ``tokens`` carry their log-sum-exp): the logits kernel leaves a set's token's share of dlogits out, and
    ``kept_launch.kept_gradient`` writes its entries into the chunk before the products. ``fp32_logits``: 16-bit
    inputs' logits are the product's fp32 output, unrounded (``product_into``), and dlogits, written over them, are
    cast to the inputs' dtype for the gradient products (as an fp32-output head's backward casts its gradient).
    """
    N, H = hidden.shape
    V = weight.shape[0]
    out = allocate_outputs(N, hidden.device, kernel_loss, compute_entropy)
    if gradient is None:
        r = _three_products_forward(hidden, weight, bias, ids, out, kernel_loss, tokens, fp32_logits)
        return r, None, None, None
    dh, dw, db = _linear_gradient_buffers(hidden, weight, bias, compute_weight_grad)
    fp32_logits = fp32_logits and hidden.dtype != torch.float32
    logit_bytes = 4 + hidden.element_size() if fp32_logits else hidden.element_size()  # (+ the 16-bit dlogits)
    chunk = linear_chunk_tokens(N, V, logit_bytes, 1)
    rows = min(chunk, max(N, 1))
    workspace = torch.empty(rows, V, device=hidden.device, dtype=torch.float32 if fp32_logits else hidden.dtype)
    dlogits = torch.empty(rows, V, device=hidden.device, dtype=hidden.dtype) if fp32_logits else None
    pick = lambda t, n: None if t is None else t.reshape(-1)[n]  # noqa: E731  (per-token inputs: N elements)
    for n0 in range(0, N, chunk):
        n = slice(n0, min(n0 + chunk, N))
        x = workspace[: n.stop - n0]
        _head_product(hidden[n], weight, bias, x, fp32_logits)
        chunk_gradient = OnePassGradient(gradient.weight[n], pick(gradient.entropy_weight, n), in_place=True)
        r = logits_launch.forward(
            x.unsqueeze(0),
            ids[n].unsqueeze(0),
            kernel_loss=kernel_loss,
            tokens=TokenInputs(*(pick(t, n) for t in tokens)),
            compute_entropy=compute_entropy,
            gradient=chunk_gradient,
        )
        for name in ("logp", "entropy", "lse", "loss", "dloss_dlogp", "kl", "flags"):
            if getattr(out, name) is not None:
                getattr(out, name)[n] = getattr(r, name)
        if kept is not None:
            kept_launch.kept_gradient(
                x,
                ids,
                *kept,
                r.dloss_dlogp * chunk_gradient.weight,
                temperature=kernel_loss.kernel_temperature,
                softcap=kernel_loss.kernel_softcap,
                h=chunk_gradient.entropy_weight,
                lse=r.lse,
                entropy=r.entropy,
                n0=n0,
            )
        dx = x if dlogits is None else dlogits[: n.stop - n0].copy_(x)  # x now holds dlogits
        _add_chunk_gradients(dx, weight, hidden[n], dh[n], dw, db, first=n0 == 0)
    return out, dh, dw, db


def _head_product(hidden, weight, bias, out, fp32_logits: bool) -> None:
    """out = hidden @ weight^T + bias: in the inputs' dtype, as an unfused head (cuBLAS) rounds it, or with
    ``fp32_logits`` the fp32 product left unrounded (``product_into``: cuBLAS with an fp32 output where torch has it,
    else the Triton tile product), the bias added in fp32."""
    if fp32_logits:
        product_into(hidden, weight.T, out, accumulate=False)
        if bias is not None:
            out += bias
    elif bias is None:
        torch.mm(hidden, weight.T, out=out)
    else:
        torch.addmm(bias, hidden, weight.T, out=out)


def _three_products_forward(
    hidden, weight, bias, ids, out: ForwardResult, kernel_loss: KernelLoss, tokens: TokenInputs, fp32_logits=False
) -> ForwardResult:
    """The 3-product mode without a gradient, into ``out``: each [tokens, columns] tile of logits (``workspace_tiles``:
    at most ``LINEAR_TILED_WORKSPACE_BYTES``) by cuBLAS in the input dtype, as an unfused head rounds them; each
    token's log-sum-exp state over the tile and its target logit (``logits_tile_state_kernel``) into [4, tiles, N]
    partials; then the vocabulary-split forward's combine kernel merges them and computes every loss term."""
    N = hidden.shape[0]
    V = weight.shape[0]
    fp32_logits = fp32_logits and hidden.dtype != torch.float32
    logits_dtype = torch.float32 if fp32_logits else hidden.dtype
    tokens_per_tile, columns = workspace_tiles(N, V, logits_dtype.itemsize)
    splits = triton.cdiv(V, columns)
    partials = torch.empty(4, splits, N, device=hidden.device, dtype=torch.float32)
    workspace = torch.empty(min(tokens_per_tile, N) * columns, device=hidden.device, dtype=logits_dtype)
    mask = None if tokens.mask is None else tokens.mask.reshape(-1)  # (the per-token inputs may come as [B, T])
    for n, v0, v1 in _tiles(N, V, tokens_per_tile, columns):
        x = _tile_view(workspace, n.stop - n.start, v1 - v0)
        _head_product(hidden[n], weight[v0:v1], None if bias is None else bias[v0:v1], x, fp32_logits)
        config = logits_launch.logits_launch_config(x, kind="logprobs")  # each tile is read once
        FL.logits_tile_state_kernel[(n.stop - n.start,)](
            logits_ptr=x,
            stride_n=x.stride(0),
            ids_ptr=ids[n],
            mask_ptr=None if mask is None else mask[n],
            V=v1 - v0,
            v0=v0,
            states_ptr=partials[0, v0 // columns, n.start :],
            state_stride=splits * N,
            inv_temperature=1.0 / kernel_loss.kernel_temperature,
            softcap=kernel_loss.kernel_softcap,
            COMPUTE_ENTROPY=out.entropy is not None,
            ROW_ALIGN=logits_launch.row_alignment(x),
            BLOCK_V=config["BLOCK_V"],
            num_warps=config["num_warps"],
        )
    if N > 0:
        FL.linear_grpo_combine_kernel[(triton.cdiv(N, COMBINE_BLOCK),)](
            partials_ptr=partials,
            N=N,
            splits=splits,
            **loss_pointer_args(out, tokens),
            **loss_args(kernel_loss),
            BLOCK_N=COMBINE_BLOCK,
        )
    return out


@fp32_products
def linear_backward(
    hidden,
    weight,
    bias,
    ids,
    lse,
    g,
    temperature: float,
    compute_weight_grad: bool,
    config=None,
    grad_entropy=None,
    entropy=None,
    softcap: float | None = None,
    write_entries=None,
    fp32_logits: bool = False,
):
    """d hidden [N, H], d weight [V, H] (or None), d bias [V] (or None), all fp32, from g = dLoss/dlogp (fp32 [N])
    and, when the loss uses the entropy, h = dLoss/dH (``grad_entropy``) with the forward's ``entropy``; the logits
    are cap(hidden @ weight^T + bias) / temperature (``logits_launch.resolved_head``).

    A tile of the logits at a time (``workspace_tiles``: [tokens, columns], at most
    ``LINEAR_TILED_WORKSPACE_BYTES``): the dlogits kernel writes the tile's gradient of the logits into one
    reused workspace (the tile's weight rows and bias, the ids shifted to its first column), then two products
    add its share of d hidden and of d weight (fp32, in place). ``write_entries(tile, first token, first column)``,
    where given, writes sparse entries over the tile's dense gradient
    before the products (the kept sets', ``kept_launch.kept_gradient``).
    """
    N, H = hidden.shape
    V = weight.shape[0]
    cfg = _logits_config(N, V, H, hidden.dtype, hidden.device, config, fp32_logits)
    dh, dw, db = _linear_gradient_buffers(hidden, weight, bias, compute_weight_grad)
    tokens_per_tile, columns = workspace_tiles(N, V, hidden.element_size())
    workspace = torch.empty(min(tokens_per_tile, N) * columns, device=hidden.device, dtype=hidden.dtype)
    for n, v0, v1 in _tiles(N, V, tokens_per_tile, columns):
        rows, width = n.stop - n.start, v1 - v0
        dx = _tile_view(workspace, rows, width)
        grid = (triton.cdiv(rows, cfg["BLOCK_N"]) * triton.cdiv(width, cfg["BLOCK_V"]),)
        FL.linear_dlogits_kernel[grid](
            h_ptr=hidden[n],
            w_ptr=weight[v0:v1],
            b_ptr=None if bias is None else bias[v0:v1],
            ids_ptr=ids[n] if v0 == 0 else ids[n] - v0,
            N=rows,
            V=width,
            H=H,
            lse_ptr=lse[n],
            g_ptr=g[n],
            dx_ptr=dx,
            inv_temperature=1.0 / temperature,
            softcap=None if softcap is None else float(softcap),
            grad_entropy_ptr=None if grad_entropy is None else grad_entropy[n],
            entropy_ptr=None if grad_entropy is None else entropy[n],
            **cfg,
        )
        if write_entries is not None:
            write_entries(dx, n.start, v0)
        _add_chunk_gradients(
            dx,
            weight[v0:v1],
            hidden[n],
            dh[n],
            None if dw is None else dw[v0:v1],
            None if db is None else db[v0:v1],
            first=n.start == 0,
            first_tile=v0 == 0,
        )
    return dh, dw, db
