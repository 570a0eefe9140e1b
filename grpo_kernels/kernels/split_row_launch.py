"""Host launcher of the split-row schedule (``split_row.py``): each row of logits cut into K chunks read by K
sibling programs of one cooperative, persistent launch; in Triton's interpreter, two launches (publish, then merge
and write). ``logits_launch._run_forward`` calls ``split_row_forward`` where the launch configuration (the device
sweep's ``tuned.json``, or ``split_row_schedule`` in tests and benchmarks) asks for K chunks; the grid, the chunking
and the co-residency are this module's.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import NamedTuple

import torch
import triton
from packaging.version import Version

from . import split_row

# The split-row schedule (kernels/split_row.py): None keeps the one-program-per-row kernel unless the device
# sweep measured a K for this GPU and vocabulary (tuned.json's "split_row"); tests set a K to run it.
SPLIT_ROW_CHUNKS: int | None = None
SPLIT_ROW_BLOCK: int | None = None  # a BLOCK_V for the split-row kernel alone (tests: a chunk of several blocks)
SPLIT_ROW_MAX_SPIN = 1 << 22  # a wait's bound in reads of the counter (a cooperative launch never reaches it)
_RESIDENT_PROGRAMS: dict[tuple, int] = {}


@contextlib.contextmanager
def split_row_schedule(chunks: int | None, block_v: int | None = None):
    """Within the block the one-pass loss runs on the split-row kernel with each row over ``chunks``
    programs (None: the measured default), with blocks of ``block_v`` logits where given; for tests,
    benchmarks and the AOT report."""
    global SPLIT_ROW_CHUNKS, SPLIT_ROW_BLOCK
    saved, SPLIT_ROW_CHUNKS, SPLIT_ROW_BLOCK = (SPLIT_ROW_CHUNKS, SPLIT_ROW_BLOCK), chunks, block_v
    try:
        yield
    finally:
        SPLIT_ROW_CHUNKS, SPLIT_ROW_BLOCK = saved


class SplitRowChunks(NamedTuple):
    """How the split-row kernel cuts a row: K chunks of ``length`` logits; ``held``: a chunk of one block, held in
    registers (``HOLD_CHUNK``), else streamed twice (the second read from L2)."""

    K: int
    length: int
    held: bool


def split_row_chunks(V: int, block_v: int, chunks: int) -> SplitRowChunks:
    """The row cut into at most ``chunks`` chunks of the same whole number of blocks (so that full blocks load
    unmasked), as few blocks a chunk as that allows; K the chunks that then cover the row, none empty (only the
    last one short)."""
    blocks = triton.cdiv(V, block_v)
    chunk_blocks = triton.cdiv(blocks, max(int(chunks), 1))
    return SplitRowChunks(triton.cdiv(blocks, chunk_blocks), chunk_blocks * block_v, chunk_blocks == 1)


def resident_programs_per_sm(
    registers: int,
    num_warps: int,
    shared_bytes: int,
    *,
    regs_per_sm: int = 65536,
    threads_per_sm: int = 2048,
    shared_per_sm: int = 228 * 1024,
) -> int:
    """How many programs of a compiled kernel one SM holds at once, from its registers a thread, its warps
    and its shared memory (the defaults: sm_90's limits). Registers are allocated per warp in units of
    256, as the occupancy calculator does."""
    threads = 32 * num_warps
    warp_registers = -(-max(1, registers) * 32 // 256) * 256
    by_registers = (regs_per_sm // warp_registers) // num_warps
    by_threads = threads_per_sm // threads
    by_shared = shared_per_sm // shared_bytes if shared_bytes else by_threads
    return max(0, min(by_registers, by_threads, by_shared))


def resident_programs(compiled, device, num_warps: int) -> int:
    """How many programs of a compiled kernel the GPU holds at once (what a cooperative launch may use)."""
    compiled._init_handles()  # loads the binary: n_regs is known from then on (Triton 3.2 to 3.9)
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count * resident_programs_per_sm(
        compiled.n_regs,
        num_warps,
        compiled.metadata.shared,
        regs_per_sm=props.regs_per_multiprocessor,
        threads_per_sm=props.max_threads_per_multi_processor,
        shared_per_sm=props.shared_memory_per_multiprocessor,
    )


def split_row_grid(resident: int, N: int, K: int) -> int:
    """The cooperative grid: as many programs as the GPU holds at once (``resident``), no more than the
    N x K items, a multiple of K (so that a row's K siblings run in the same iteration of the same K
    programs, all resident: the wait always returns)."""
    programs = min(resident, N * K) // K * K
    if programs < K:
        raise RuntimeError(
            f"the split-row kernel fits {resident} programs on this GPU, fewer than its K = {K} "
            "siblings of a row; use a smaller split_row"
        )
    return programs


def split_row_forward(logits: torch.Tensor, kwargs: dict, launch_config: dict, chunks: int) -> tuple:
    """The one-pass forward (``kwargs``: the one-pass kernel's arguments) on the split-row kernel: one
    cooperative, persistent launch on a GPU; in Triton's interpreter (which runs programs one at a time) two
    launches, publish then merge. Returns (ran, the GPU's wait-timeout flag or None): ran is False if the GPU
    refused the cooperative launch (nothing ran; the caller runs the one-pass kernel)."""
    N, V = kwargs["N"], kwargs["V"]
    if N == 0:
        return True, None
    # 3.3's interpreter lacks what the atomics build on
    if not logits.is_cuda and Version(triton.__version__).release < (3, 4):
        raise RuntimeError(
            f"the split-row schedule in Triton's interpreter needs triton >= 3.4, got "
            f"{triton.__version__} ('InterpreterBuilder' object has no attribute 'get_int1_ty'): "
            "upgrade triton, or leave split_row unset on CPU tensors"
        )
    K, chunk_len, held = split_row_chunks(V, launch_config["BLOCK_V"], chunks)
    error = torch.zeros(1, device=logits.device, dtype=torch.int32)
    kwargs = dict(
        kwargs,
        state_ptr=torch.empty(N, K, split_row.STATE_WIDTH, device=logits.device, dtype=torch.float32),
        counter_ptr=torch.zeros(N, device=logits.device, dtype=torch.int32),
        error_ptr=error,
        chunk_blocks=chunk_len // launch_config["BLOCK_V"],
        K=K,
        K_LANES=triton.next_power_of_2(K),
        HOLD_CHUNK=held,
        MAX_SPIN=SPLIT_ROW_MAX_SPIN,
        BLOCK_V=launch_config["BLOCK_V"],
        num_warps=launch_config["num_warps"],
        **({"num_stages": launch_config["num_stages"]} if "num_stages" in launch_config else {}),
    )
    kernel = split_row.split_row_forward_kernel
    if not logits.is_cuda:  # the interpreter: every item publishes, then every item merges and writes
        kernel[(N * K,)](**kwargs, PHASE=1)
        kernel[(N * K,)](**kwargs, PHASE=2)
        return True, None
    key = (
        logits.device.index,
        logits.dtype,
        launch_config["num_warps"],
        launch_config.get("num_stages"),
        tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, (bool, int)) and k.isupper())),
        tuple(sorted(k for k, v in kwargs.items() if v is None)),
    )  # None tensors specialize the kernel too
    try:
        if key not in _RESIDENT_PROGRAMS:
            compiled = kernel.warmup(**kwargs, PHASE=0, grid=(K,), launch_cooperative_grid=True)
            _RESIDENT_PROGRAMS[key] = resident_programs(compiled, logits.device, launch_config["num_warps"])
        programs = split_row_grid(_RESIDENT_PROGRAMS[key], N, K)
        kernel[(programs,)](**kwargs, PHASE=0, launch_cooperative_grid=True)
    except RuntimeError as refused:  # the driver refused the cooperative launch: today's schedule runs instead
        warnings.warn(
            f"the split-row kernel's cooperative launch was refused ({refused}); the one-pass kernel runs instead",
            RuntimeWarning,
            stacklevel=2,
        )
        _RESIDENT_PROGRAMS[key] = 0
        return False, None
    return True, error
