"""Every kernel specialization compiles ahead of time for sm_90 (``aot.primary_launches``: the row kernels in fp32 and
fp16 at one vocabulary, in bf16 at all three), every kernel, loss option, schedule and tuned configuration
(``aot.representative_launches``) for sm_80 and AMD's gfx942 (MI300), and every kernel and tuned configuration
(``aot.kind_launches``) for each vendor's second target of the same code generator, sm_100 (Blackwell) and gfx90a
(MI250), on the CPU.

What the interpreter forgives, the compiler does not: this catches compile errors,
register spills, lost vectorization and hot loops that would be issue-bound before a GPU
ever runs the code. The specializations are the launchers' own launches, typed by Triton's
JIT binder (tools/aot.py). The compile runs in a subprocess because the test
session has TRITON_INTERPRET=1 set, over both cores (the tool forks a compile process a core), watched for
progress rather than timed: a slow machine makes it slower, never red.
"""

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading

import aot
import pytest
import torch
from aot import DTYPES
from conftest import TOOLS
from filelock import FileLock

from grpo_kernels.kernels import logits_launch, split_row_launch

# No wall-clock limit on the whole compile (hundreds of specializations; a loaded 2-core machine can take many
# times the usual): the guard is on progress. The tool prints a line a finished specialization, each a few seconds
# of work; only a compile that finishes nothing for this long has hung.
STALL_S = 1800


def _pass_lines(stream, lines: queue.Queue):
    for line in stream:
        lines.put(line)
    lines.put(None)  # the stream closed: the process is ending


def _run_watched(command, env, stall_s=STALL_S) -> str:
    """``command``'s stdout; fails if it exits non-zero or prints no stderr line for ``stall_s`` seconds."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.PIPE, text=True, env=env)
        progress = queue.Queue()
        threading.Thread(target=_pass_lines, args=(proc.stderr, progress), daemon=True).start()
        stderr = []
        while True:
            try:
                line = progress.get(timeout=stall_s)
            except queue.Empty:
                proc.kill()
                proc.wait()
                pytest.fail(f"{command[1:3]} printed nothing for {stall_s} s; last lines: {stderr[-5:]}")
            if line is None:
                break
            stderr.append(line)
        assert proc.wait() == 0, "".join(stderr)[-4000:]
        out.seek(0)
        return out.read()


def _aot(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return json.loads(_run_watched([sys.executable, str(TOOLS / "aot.py"), *args], env))


def test_the_watch_fails_a_stalled_process_and_waits_for_a_slow_one():
    """A process that runs 10 s but prints a line every 2 s passes an 8 s watch (6 s of slack a line for a busy
    machine); one silent for 30 s fails a 1 s one."""
    slow = (
        "import sys, time\nfor i in range(5):\n    time.sleep(2); print(i, file=sys.stderr, flush=True)\nprint('done')"
    )
    assert _run_watched([sys.executable, "-c", slow], dict(os.environ), stall_s=8) == "done\n"
    with pytest.raises(pytest.fail.Exception, match="printed nothing for 1 s"):
        _run_watched([sys.executable, "-c", "import time; time.sleep(30)"], dict(os.environ), stall_s=1)


@pytest.fixture(scope="module")
def every_target(tmp_path_factory, worker_id):
    """One run of the tool for every target (the launches recorded once): sm_90 and sm_80, sm_100, AMD's two. Under
    xdist the first worker to need it compiles and leaves the records in the session's shared temporary folder; a
    worker that needs them meanwhile waits on the lock (the compile has both cores then) and reads them: the compile
    runs once a session, not once a worker (xdist's own recipe; its `loadgroup` mode does not group under pytest 9)."""
    arguments = ("--arch", "90", "80", "100", *aot.AMD_ARCHS)
    if worker_id == "master":
        return _aot(*arguments)
    shared = tmp_path_factory.getbasetemp().parent / "aot_records.json"
    with FileLock(f"{shared}.lock"):
        if shared.is_file():
            return json.loads(shared.read_text())
        records = _aot(*arguments)
        shared.write_text(json.dumps(records))
        return records


@pytest.fixture(scope="module")
def records(every_target):
    return [r for r in every_target if r["arch"] in ("sm_90", "sm_80")]


@pytest.fixture(scope="module")
def amd_records(every_target):
    return [r for r in every_target if r["arch"] in aot.AMD_ARCHS]


def test_every_kernel_and_tuned_configuration_compiles_for_amd(amd_records, records):
    """ROCm's compile of every kernel (each kernel kind the NVIDIA targets compile) and every tuned configuration for
    gfx942 and gfx90a, with every loss option and schedule for gfx942: a kernel that cannot build for ROCm fails here.
    None spills to scratch memory (a scalar register spilled to a vector register's lane is not a memory spill,
    and is reported)."""
    assert {r["arch"] for r in amd_records} == set(aot.AMD_ARCHS)
    for arch in aot.AMD_ARCHS:
        mine = [r for r in amd_records if r["arch"] == arch]
        assert {r["kernel"] for r in mine} == {r["kernel"] for r in records}, arch
        tuned = {r["specialization"] for r in records if " tuned " in f" {r['specialization']} "}
        assert tuned and tuned <= {r["specialization"] for r in mine}, arch
    scratch = [(r["arch"], r["specialization"], r["scratch_bytes"]) for r in amd_records if r["scratch_bytes"]]
    assert not scratch, f"spilled to scratch memory: {scratch}"
    for r in amd_records:
        if r["spilled_registers"]:
            print(f"{r['arch']} {r['specialization']}: {r['spilled_registers']} registers spilled to registers")


@pytest.fixture(scope="module")
def blackwell_records(every_target):
    return [r for r in every_target if r["arch"] == "sm_100"]


def test_every_kernel_and_tuned_configuration_compiles_for_blackwell(blackwell_records, records):
    """sm_100 (B200 / GB200): every kernel the other NVIDIA targets compile and every tuned configuration
    (``kind_launches``: the loss options and schedules, branches of the same kernels, are sm_90's and sm_80's to
    compile), compiles without a spill."""
    assert {r["arch"] for r in blackwell_records} == {"sm_100"}
    assert {r["kernel"] for r in blackwell_records} == {r["kernel"] for r in records}
    tuned = {r["specialization"] for r in records if " tuned " in f" {r['specialization']} "}
    assert tuned and tuned <= {r["specialization"] for r in blackwell_records}
    spills = [(r["specialization"], r["spill_bytes"]) for r in blackwell_records if r["spill_bytes"]]
    assert not spills, f"spilled on sm_100: {spills}"


def test_every_specialization_compiles_without_spills(records):
    print("\nkernel    arch   dtype BLOCK_V warps regs spill specialization")
    for r in records:
        print(
            f"{r['kernel']:9} {r['arch']} {r['dtype']:5} {r['BLOCK_V'] or '-':7} {r['num_warps']:5} {r['registers']:4} "
            f"{r['spill_bytes']:5} {r['specialization']}"
        )
    assert {r["arch"] for r in records} == {"sm_90", "sm_80"}
    assert {r["dtype"] for r in records} == set(DTYPES)
    assert {r["kernel"] for r in records} == {
        "forward",
        "backward",
        "scale",
        "dlogits",
        "matmul",
        "combine",
        "split-row",
        "token-weights",
        "loss-metrics",
        "tile-state",
        "kept-state",
        "kept-gradient",
    }
    spilled = [r for r in records if r["spill_bytes"] or r["local_bytes"]]
    assert not spilled, f"register spills: {spilled}"
    streaming = [r for r in records if "fused-linear" not in r["specialization"]]
    # the memory-bound logits kernels need occupancy: at most 128 registers a thread
    assert all(0 < r["registers"] <= 128 for r in streaming), "a logits kernel needs over 128 registers"
    assert any("fused-linear" in r["specialization"] for r in records)


def test_the_split_row_kernel_compiles_as_one_cooperative_launch_that_fits_the_gpu(records):
    """The split-row kernel's single launch (publish, wait, merge and write) on sm_90 and sm_80: no spills, no
    local memory, 128-bit loads, and a grid no larger than what the compiled kernel keeps resident at once
    (from its registers, shared memory and warps, on 132 SMs), so that every sibling's wait returns."""
    split = [r for r in records if r["kernel"] == "split-row"]
    assert {r["arch"] for r in split} == {"sm_90", "sm_80"} and {r["chunks"] for r in split} == {1, 4, 8, 38}
    assert {r["held_chunk"] for r in split} == {True, False}  # both variants: a chunk held, a chunk read again
    assert all(r["spill_bytes"] == 0 and r["local_bytes"] == 0 and r["vector_loads_128"] >= 1 for r in split)
    for r in split:
        resident = 132 * r["resident_programs_per_sm"]
        assert resident >= r["chunks"], r
        for N in (1, 7, 4096, 16384):
            programs = split_row_launch.split_row_grid(resident, N, r["chunks"])
            assert programs % r["chunks"] == 0 and r["chunks"] <= programs <= min(resident, N * r["chunks"])


def test_aligned_rows_use_128_bit_vector_loads(records):
    aligned = [r for r in records if (r["row_align"] or 1) > 1]
    assert aligned and all(r["vector_loads_128"] >= 1 for r in aligned), [
        r for r in aligned if r["vector_loads_128"] < 1
    ]


def test_every_hot_loop_over_aligned_rows_loads_128_bits_at_a_time(records):
    """In the sm_90 SASS of every streaming kernel over aligned rows, the heuristic's configs and each measured one
    in tuned.json (what the device runs: 16 warps over 4096 bf16 logits, where a fold by halves once loaded 64
    bits), pipelined or not, every load of a hot loop is a 16-byte vector (LDG.E.128, or LDGSTS.128 into shared
    memory). (sm_80's forward has a further loop of a logit or two a thread, the budgets' test says: not checked.)"""
    streaming = [
        r
        for r in records
        if r.get("hot_loops") and (r["row_align"] or 1) > 1 and not r.get("held_chunk") and r["arch"] == "sm_90"
    ]
    assert any(" tuned " in f" {r['specialization']} " for r in streaming)
    narrow = [
        (r["arch"], r["specialization"], loop["global_loads"], loop["loads_128"])
        for r in streaming
        for loop in r["hot_loops"]
        if loop["loads_128"] != loop["global_loads"]
    ]
    assert not narrow, narrow


def _sm90(records, label):
    (record,) = [r for r in records if r["arch"] == "sm_90" and r["specialization"] == label]
    return record


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_row_loops_carry_their_l2_eviction_hints(records, dtype):
    """The one-pass kernel reads each row twice; the second read comes from L2 only if the row is still there. Its
    first pass loads with evict_last, its gradient pass with evict_first and writes the gradient with streaming
    stores (.cs: not read again here); a log-prob pass, which reads a row once, evict_first; the two-pass
    backward evict_first and streaming stores. In the PTX (``createpolicy`` + ``L2::cache_hint``) and in the
    SASS of the hot loops themselves (LDG.E.EL.128, LDG.E.EF.128, STG.E.EF.128). Without ``l2_hints`` none."""
    tag = f"{dtype} V=32000"
    one_pass = _sm90(records, f"ppo+old+iw one-pass {tag}")
    assert one_pass["evict_last_loads"] >= 1 and one_pass["evict_first_loads"] >= 1 and one_pass["streaming_stores"]
    first, gradient = one_pass["hot_loops"]
    assert first["evict_last_loads"] == first["global_loads"] > 0 and first["global_stores"] == 0, first
    assert gradient["evict_first_loads"] == gradient["global_loads"] > 0, gradient
    assert gradient["evict_first_stores"] == gradient["global_stores"] > 0, gradient

    logprobs = _sm90(records, f"logprobs {tag}")
    assert logprobs["evict_first_loads"] >= 1 and logprobs["evict_last_loads"] == 0
    (loop,) = logprobs["hot_loops"]
    assert loop["evict_first_loads"] == loop["global_loads"] > 0, loop

    backward = _sm90(records, f"dlogits {tag}")
    (loop,) = backward["hot_loops"]
    assert (
        loop["evict_first_loads"] == loop["global_loads"] > 0
        and loop["evict_first_stores"] == loop["global_stores"] > 0
    ), loop

    for label in (
        f"ppo+old+iw one-pass no-l2-hints {tag}",
        f"logprobs no-l2-hints {tag}",
        f"dlogits no-l2-hints {tag}",
    ):
        plain = _sm90(records, label)
        assert plain["evict_last_loads"] == plain["evict_first_loads"] == plain["streaming_stores"] == 0, label
        assert not any(
            loop["evict_last_loads"] or loop["evict_first_loads"] or loop["evict_first_stores"]
            for loop in plain["hot_loops"]
        ), label


def test_fused_lm_head_products_run_on_tensor_cores_fed_by_async_copies(records):
    """bf16 lm_head tiles: wgmma (sm_90) / mma.sync (sm_80) on operands staged by cp.async, i.e. the
    tiles are pipelined through shared memory rather than loaded element by element into registers."""
    lm_head = [
        r
        for r in records
        if "fused-linear" in r["specialization"]
        and r["dtype"] == "bf16"
        and r["kernel"] not in ("combine", "tile-state")
    ]  # the two that fold states, no product
    assert {r["kernel"] for r in lm_head} == {"forward", "dlogits", "matmul"}
    slow = [r for r in lm_head if r["tensor_core_mma"] == 0 or r["async_copies"] == 0]
    assert not slow, slow
    # a regression guard on register pressure (255 when the tiles were loaded through registers)
    assert all(r["registers"] <= 192 for r in lm_head), [(r["specialization"], r["registers"]) for r in lm_head]


def test_hot_loops_fit_the_instruction_budgets(records):
    """Instructions per logit in the streaming kernels' hot loops (from the sm_90 SASS) within the budgets
    that keep them memory-bound on an H200: one-pass <= 20 (forward + gradient, entropy on)."""
    streaming = [
        r
        for r in records
        if r["arch"] == "sm_90" and r.get("budget") and not r.get("held_chunk") and "softcap" not in r["specialization"]
    ]
    print("\n" + aot.summary([r for r in records if r["arch"] == "sm_90"]))
    assert any("one-pass" in r["specialization"] for r in streaming)
    over = [
        (r["specialization"], r["instructions_per_logit"], r["budget"])
        for r in streaming
        if r["instructions_per_logit"] > r["budget"]
    ]
    assert not over, over
    # one exp2 a logit in each hot loop, nothing more (the old kernel's rescale cost a second)
    assert all(abs(loop["mufu_per_logit"] - 1.0) < 0.01 for r in streaming for loop in r["hot_loops"])
    # every hot loop was found and measured: one for the two-pass halves, two for one-pass
    for r in streaming:
        assert len(r["hot_loops"]) == (2 if "one-pass" in r["specialization"] else 1), r["specialization"]
        # the static roofline: at HBM speed neither the SFU nor the issue slots are the bound
        assert r["roofline"]["mufu_fraction"] < 0.7 and r["roofline"]["issue_fraction"] < 1.0


def test_a_soft_capped_head_is_a_specialization_of_its_own_within_its_budget(records):
    """Gemma's soft-cap in the logits kernels (forward, one-pass, backward) and the lm_head's: compiled for sm_90 and
    sm_80, no spills, its hot loops within ``aot.BUDGETS_SOFTCAP`` and at most 3 MUFU operations a logit a pass (the
    softmax's exp2, the cap's exp2 and its division's reciprocal). The uncapped specializations are held to the
    budgets of the test above, which the cap does not touch (None compiles it out)."""
    capped = [r for r in records if "softcap" in r["specialization"]]
    kinds = {(r["arch"], r["kernel"], "fused-linear" in r["specialization"]) for r in capped}
    for arch in ("sm_90", "sm_80"):
        assert {(arch, kernel, False) for kernel in ("forward", "backward")} <= kinds, kinds
        assert {(arch, "forward", True), (arch, "dlogits", True)} <= kinds, kinds
    assert all(r["spill_bytes"] == 0 and r["local_bytes"] == 0 for r in capped), [
        (r["arch"], r["specialization"], r["spill_bytes"]) for r in capped if r["spill_bytes"]
    ]
    streaming = [r for r in capped if r.get("budget")]
    assert {r["arch"] for r in streaming} == {"sm_90", "sm_80"} and any(
        "one-pass" in r["specialization"] for r in streaming
    )
    for r in streaming:
        # the passes over the logits: sm_80's forward has a further loop of 1 or 2 logits a thread, not one of them
        passes = r["hot_loops"][: 2 if "one-pass" in r["specialization"] else 1]
        per_logit = sum(loop["instructions"] / loop["logits_per_thread"] for loop in passes)
        assert per_logit <= r["budget"], (r["arch"], r["specialization"], per_logit)
        assert all(loop["mufu_per_logit"] <= 3.0 + 1e-6 for loop in passes), r["hot_loops"]


def test_a_held_chunk_is_loaded_once_and_its_item_fits_its_budget(records):
    """The split-row kernel with a chunk of one block held in registers: one 128-bit load per 8 logits and no loop
    over the logits (the item's loop is the hot one), one exp2 a logit (the state's: the gradient multiplies it
    by the row's 2^(max - lse)) and a few an item, no spill, and the item's instructions per logit (an upper
    bound: both chunk paths and the per-item work) within its budget. The roofline's issue fraction is reported,
    not bounded: at 16 logits a thread the per-item work may make it issue-bound, which the device sweep weighs
    (4 warps, 8192-logit blocks)."""
    held = [r for r in records if r.get("held_chunk")]
    assert {(r["arch"], r["dtype"]) for r in held} >= {("sm_90", "bf16"), ("sm_80", "bf16")}
    for r in held:
        assert r["spill_bytes"] == 0 and r["local_bytes"] == 0 and r["vector_loads_128"] >= 1, r
        (loop,) = r["hot_loops"]
        assert loop["logits_per_thread"] == r["BLOCK_V"] / (32 * r["num_warps"])
        assert loop["global_loads"] >= 1 and 1.0 <= loop["mufu_per_logit"] <= 1.0 + 8 / loop["logits_per_thread"], loop
        if r["arch"] == "sm_90":
            assert r["instructions_per_logit"] <= r["budget"], (r["specialization"], r["instructions_per_logit"])


def test_the_compiled_signature_is_the_jits_for_the_launchers_arguments():
    """The AOT records the launchers' own launches; Triton's binder types them as the JIT would:
    run-time integers as i32 while they fit (not the i64 a hand-written signature assumed), i64 past 2^31."""
    facts = _aot("--signature-facts")
    typical, long = facts["typical"], facts["long_context"]
    assert {typical["signature"][k] for k in ("T", "V", "stride_b", "stride_t")} == {"i32"}
    assert typical["signature"]["logits_ptr"] == "*bf16" and typical["signature"]["ids_ptr"] == "*i64"
    assert long["signature"]["stride_b"] == "i64" and long["signature"]["T"] == "i32"
    assert typical["num_warps"] == typical["launcher_config"]["num_warps"]
    assert typical["constexprs"]["BLOCK_V"] == typical["launcher_config"]["BLOCK_V"]
    assert typical["constexprs"]["ROW_ALIGN"] == 8  # 151936 bf16 rows start 16-byte aligned
    assert "logits_ptr" in typical["divisible_by_16"] and "T" not in typical["divisible_by_16"]


def test_the_recorded_launch_is_the_launch_that_runs(monkeypatch):
    """What the recorder captures is exactly what the interpreter is called with."""
    from grpo_kernels.kernels import logits as K

    seen = []

    class Spy:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def call(*args, **kwargs):
                seen.append((grid, args, kwargs))
                return self.fn[grid](*args, **kwargs)

            return call

    logits, ids = torch.randn(2, 3, 1003), torch.randint(0, 1003, (2, 3))
    monkeypatch.setattr(K, "grpo_forward_kernel", Spy(K.grpo_forward_kernel))
    logits_launch.forward(logits, ids, compute_entropy=True)
    monkeypatch.undo()
    with aot.recorded_launches() as launches:
        logits_launch.forward(logits, ids, compute_entropy=True)
    (grid, args, kwargs), item = seen[0], launches[0]

    def same(a, b):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return a is b or (a.shape == b.shape and a.dtype == b.dtype)
        return a is b or (not isinstance(a, torch.Tensor) and a == b)

    assert grid == item.grid and kwargs.keys() == item.kwargs.keys()
    assert all(same(kwargs[k], item.kwargs[k]) for k in kwargs), "the keyword arguments differ"
    assert len(args) == len(item.args) and all(same(a, b) for a, b in zip(args, item.args, strict=True))
