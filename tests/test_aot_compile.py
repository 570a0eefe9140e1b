"""Every kernel specialization compiles ahead of time for sm_90 and sm_80, on the CPU.

What the interpreter forgives, the compiler does not: this catches compile errors,
register spills and lost vectorization before a GPU ever runs the code. The compile runs
in a subprocess because the test session has TRITON_INTERPRET=1 set.
"""

import json
import os
import subprocess
import sys

import pytest

from grpo_kernels.kernels.aot import DTYPES


@pytest.fixture(scope="module")
def records():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "grpo_kernels.kernels.aot", "--arch", "90", "80"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_every_specialization_compiles_without_spills(records):
    print("\nkernel    arch   dtype BLOCK_V warps regs spill specialization")
    for r in records:
        print(f"{r['kernel']:9} {r['arch']} {r['dtype']:5} {r['BLOCK_V']:7} {r['num_warps']:5} {r['registers']:4} "
              f"{r['spill_bytes']:5} {r['specialization']}")
    assert {r["arch"] for r in records} == {"sm_90", "sm_80"}
    assert {r["dtype"] for r in records} == set(DTYPES)
    assert {r["kernel"] for r in records} == {"forward", "backward", "dlogits", "matmul", "combine"}
    spilled = [r for r in records if r["spill_bytes"] or r["local_bytes"]]
    assert not spilled, f"register spills: {spilled}"
    streaming = [r for r in records if "fused-linear" not in r["specialization"]]
    # the memory-bound logits kernels need occupancy: at most 128 registers a thread
    assert all(0 < r["registers"] <= 128 for r in streaming), "a logits kernel needs over 128 registers"
    assert any("fused-linear" in r["specialization"] for r in records)


def test_aligned_rows_use_128_bit_vector_loads(records):
    aligned = [r for r in records if "row_align=1" not in r["specialization"] and "fused-linear" not in
               r["specialization"]]
    assert aligned and all(r["vector_loads_128"] >= 1 for r in aligned), [
        r for r in aligned if r["vector_loads_128"] < 1]


def test_fused_lm_head_products_run_on_tensor_cores_fed_by_async_copies(records):
    """bf16 lm_head tiles: wgmma (sm_90) / mma.sync (sm_80) on operands staged by cp.async, i.e. the
    tiles are pipelined through shared memory rather than loaded element by element into registers."""
    lm_head = [r for r in records if "fused-linear" in r["specialization"] and r["dtype"] == "bf16"
               and r["kernel"] != "combine"]
    assert {r["kernel"] for r in lm_head} == {"forward", "dlogits", "matmul"}
    slow = [r for r in lm_head if r["tensor_core_mma"] == 0 or r["async_copies"] == 0]
    assert not slow, slow
    # a regression guard on register pressure (255 when the tiles were loaded through registers)
    assert all(r["registers"] <= 192 for r in lm_head), [(r["specialization"], r["registers"]) for r in lm_head]
