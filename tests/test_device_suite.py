"""The device suite's parts that can be checked without a GPU: winners become defaults, peers load, reports parse.

The whole suite (benchmarks/gpu_suite.sh) runs end to end in its CPU smoke mode in CI.
"""

import json
import os
import pathlib
import sys

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import report  # noqa: E402
import sweep  # noqa: E402

from grpo_kernels import token_logprobs  # noqa: E402
from grpo_kernels.kernels import logits_launch, tuned  # noqa: E402


def _gpu_results():
    """A sweep result as a GPU run writes it: two logits candidates per shape, one of them inexact."""
    env = {"torch": "2.11.0", "triton": "3.6.0", "date": "2026-11-30", "device": "NVIDIA H200", "arch": "sm_90"}
    rows = [
        {
            "N": 16384,
            "V": 151936,
            "dtype": "bfloat16",
            "mode": "one_pass",
            "BLOCK_V": 4096,
            "num_warps": 8,
            "num_stages": 1,
            "status": "ok",
            "exact": True,
            "median_ms": 3.0,
            "model_GBps": 3300.0,
        },
        {
            "N": 16384,
            "V": 151936,
            "dtype": "bfloat16",
            "mode": "two_pass",
            "BLOCK_V": 8192,
            "num_warps": 16,
            "num_stages": 3,
            "status": "ok",
            "exact": True,
            "median_ms": 2.5,
            "model_GBps": 6000.0,
        },
        {
            "N": 16384,
            "V": 151936,
            "dtype": "bfloat16",
            "mode": "one_pass",
            "BLOCK_V": 2048,
            "num_warps": 4,
            "num_stages": 1,
            "status": "ok",
            "exact": False,
            "median_ms": 1.0,
            "model_GBps": 9000.0,
        },
        {
            "N": 16384,
            "V": 32000,
            "dtype": "bfloat16",
            "mode": "one_pass",
            "BLOCK_V": 2048,
            "num_warps": 4,
            "num_stages": 3,
            "status": "ok",
            "exact": True,
            "median_ms": 0.6,
            "model_GBps": 3500.0,
        },
    ]
    fused = [
        {
            "N": 16384,
            "H": 4096,
            "V": 151936,
            "dtype": "bfloat16",
            "mode": "recompute",
            "BLOCK_N": 128,
            "BLOCK_V": 128,
            "BLOCK_H": 64,
            "num_warps": 8,
            "num_stages": 4,
            "status": "ok",
            "exact": True,
            "median_ms": 200.0,
            "useful_TFLOPs": 300.0,
        }
    ]
    return {"environment": env, "logits": rows, "fused_linear": fused}


@pytest.fixture
def table_path(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"logits": [], "fused_linear": []}))
    monkeypatch.setattr(tuned, "TABLE_PATH", path)
    monkeypatch.setattr(tuned, "arch_of", lambda index: "sm_90")
    tuned.table.cache_clear()
    yield path
    tuned.table.cache_clear()


def test_sweep_winners_become_the_launchers_defaults(table_path, tmp_path):
    results = _gpu_results()
    results["winners"] = sweep.winners(results)
    assert [w["BLOCK_V"] for w in results["winners"]["logits"]] == [8192, 2048]  # the inexact 1.0 ms never wins
    sweep_file = tmp_path / "sweep.json"
    sweep_file.write_text(json.dumps(results))
    sweep.apply(str(sweep_file))
    tuned.table.cache_clear()

    cuda = torch.device("cuda", 0)  # the lookup reads only the device type and index
    entry = tuned.logits_entry(cuda, torch.bfloat16, 151936)
    assert (entry["one_pass"], entry["BLOCK_V"], entry["num_warps"], entry["num_stages"]) == (False, 8192, 16, 3)
    assert tuned.logits_entry(cuda, torch.bfloat16, 32768)["BLOCK_V"] == 2048  # the nearest vocabulary measured
    assert tuned.logits_entry(cuda, torch.float16, 151936) is None  # another dtype: the heuristics
    assert tuned.logits_entry(torch.device("cpu"), torch.bfloat16, 151936) is None
    fused = tuned.fused_linear_entry(cuda, torch.bfloat16, 151936)
    assert (fused["BLOCK_N"], fused["num_stages"]) == (128, 4)
    assert "NVIDIA H200" in fused["measured"]

    # applying again replaces the entries of the same arch, dtype and vocabulary
    sweep.apply(str(sweep_file))
    assert len(json.loads(table_path.read_text())["logits"]) == 2


def test_launch_config_takes_the_table_then_the_override(table_path, monkeypatch):
    table_path.write_text(
        json.dumps(
            {
                "logits": [
                    {
                        "arch": "sm_90",
                        "dtype": "float32",
                        "V": 1003,
                        "one_pass": False,
                        "BLOCK_V": 512,
                        "num_warps": 2,
                        "num_stages": 1,
                    }
                ],
                "fused_linear": [],
            }
        )
    )
    tuned.table.cache_clear()
    logits = torch.zeros(1, 1, 1003)
    heuristic = {**logits_launch.block_config(1003, 4), "loop_stages": 1, "l2_hints": True}
    assert logits_launch.logits_launch_config(logits) == heuristic  # a CPU tensor: heuristics
    assert logits_launch.default_one_pass(logits) is True
    monkeypatch.setattr(
        tuned, "_nearest", lambda kind, device, dtype, V: (json.loads(table_path.read_text()).get(kind) or [None])[0]
    )
    # an entry without "l2_hints" was measured before they existed: it runs without them, as measured
    measured = {"BLOCK_V": 512, "num_warps": 2, "num_stages": 1, "loop_stages": 1, "l2_hints": False}
    assert logits_launch.logits_launch_config(logits) == measured
    assert logits_launch._forward_grid(100, logits.device, None) == ((100,), False)
    assert logits_launch._forward_grid(100, logits.device, 4) == ((8,), True)  # CPU: 2 "SMs" x 4
    assert logits_launch.default_one_pass(logits) is False
    assert logits_launch.logits_launch_config(logits, {"num_warps": 4, "BLOCK_V": None}) == {**measured, "num_warps": 4}
    # a log-prob pass never takes the loss's entry: its own ("logprobs"), else the heuristic
    assert logits_launch.logits_launch_config(logits, kind="logprobs") == heuristic
    table = json.loads(table_path.read_text())
    table["logprobs"] = [
        {
            "arch": "sm_90",
            "dtype": "float32",
            "V": 1003,
            "BLOCK_V": 1024,
            "num_warps": 1,
            "num_stages": 2,
            "loop_stages": 3,
            "l2_hints": True,
        }
    ]
    table_path.write_text(json.dumps(table))
    tuned.table.cache_clear()
    assert logits_launch.logits_launch_config(logits, kind="logprobs") == {
        "BLOCK_V": 1024,
        "num_warps": 1,
        "num_stages": 2,
        "loop_stages": 3,
        "l2_hints": True,
    }
    assert logits_launch.logits_launch_config(logits) == measured


def test_the_l2_schedule_keeps_the_rows_in_flight_within_l2():
    """The persistent one-pass schedule's arithmetic (``programs_per_sm: "l2"``): programs per SM such that the rows
    in flight (one a program: V x the logit's bytes) fill at most ``logits_launch.L2_ROWS_FRACTION`` of L2, at least
    1."""
    MiB = 1 << 20
    sms, l2 = 132, 50 * MiB  # an H100 / H200 (torch's L2_cache_size: 50 MiB)
    for V, bytes_per_logit, expected in (
        (151936, 2, 1),
        (128256, 2, 1),
        (32000, 2, 4),
        (32000, 4, 2),
        (151936, 4, 1),
        (262144, 2, 1),
    ):
        row = V * bytes_per_logit
        programs = logits_launch.l2_programs_per_sm(l2, sms, row)
        assert programs == expected, (V, bytes_per_logit, programs)
        budget = logits_launch.L2_ROWS_FRACTION * l2
        one_a_sm_fits = sms * row <= budget
        # within the rows' share of L2 wherever one program a SM fits, and the most programs that do
        assert programs * sms * row <= budget or (programs == 1 and not one_a_sm_fits), (V, bytes_per_logit)
        assert (programs + 1) * sms * row > budget
    # Qwen's row in bf16 over 132 SMs: 38.3 MiB, inside the rows' 40 MiB; Gemma's 262,144 cannot fit (66 MiB) and
    # still gets one program a SM (an idle SM would cost more than the misses)
    assert 132 * 151936 * 2 <= logits_launch.L2_ROWS_FRACTION * l2 < 132 * 262144 * 2
    # the grid: "l2" on a CPU tensor sizes itself from the stand-in's 2 SMs and 50 MiB
    cpu = torch.device("cpu")
    assert logits_launch._forward_grid(1000, cpu, "l2", 151936 * 2) == (
        (2 * logits_launch.l2_programs_per_sm(logits_launch.CPU_L2_BYTES, logits_launch.CPU_SMS, 151936 * 2),),
        True,
    )
    assert logits_launch._forward_grid(3, cpu, "l2", 1003 * 4) == ((3,), True)  # never more programs than tokens


def test_every_sweep_candidate_is_distinct():
    for candidates in (list(sweep.logits_candidates()), list(sweep.fused_candidates())):
        assert len({json.dumps(c, sort_keys=True) for c in candidates}) == len(candidates)


def test_the_sweep_runs_its_candidates_and_they_agree_with_the_default(tmp_path):
    out = tmp_path / "sweep.json"
    assert sweep.main(["--out", str(out), "--smoke"]) == 0
    results = json.loads(out.read_text())
    ran = [r for kind in ("logits", "logprobs", "fused_linear") for r in results[kind] if r["status"] == "ok"]
    assert ran and all(r["exact"] for r in ran)
    assert {kind for kind in ("logits", "logprobs", "fused_linear") for r in results[kind] if r["status"] == "ok"} == {
        "logits",
        "logprobs",
        "fused_linear",
    }  # the log-prob pass has candidates of its own
    assert results["winners"] == {"logits": [], "logprobs": [], "fused_linear": []}  # CPU figures never become defaults
    assert "Winners" in report.sweep_table(str(out))


def test_the_sweep_times_todays_default_first(tmp_path, monkeypatch):
    """The launchers' current configuration (here a tuned entry as a GPU would read it) is the first candidate
    timed, and not timed twice: a sweep cut short by its budget never crowns a candidate it did not compare
    with the default it would replace."""
    entry = {"one_pass": True, "BLOCK_V": 256, "num_warps": 2, "num_stages": 1, "programs_per_sm": None, "split_row": 8}
    monkeypatch.setattr(
        tuned, "logits_entry", lambda device, dtype, V, kind="logits": entry if kind == "logits" else None
    )
    logits = sweep.logits_inputs(*sweep.SMOKE_LOGITS_SHAPES[0], "cpu")["logits"]
    incumbent = sweep.incumbent_candidate(logits)
    # an entry measured before the L2 hints existed runs without them (and not pipelined), as measured
    assert incumbent == {
        "mode": "one_pass",
        "BLOCK_V": 256,
        "num_warps": 2,
        "num_stages": 1,
        "loop_stages": 1,
        "l2_hints": False,
        "programs_per_sm": None,
        "split_row": 8,
    }
    out = tmp_path / "sweep.json"
    assert sweep.main(["--out", str(out), "--smoke"]) == 0
    results = json.loads(out.read_text())
    rows = results["logits"]
    keys = tuple(incumbent)
    assert {k: rows[0][k] for k in keys} == incumbent and rows[0]["status"] == "ok"
    assert sum({k: r[k] for k in keys} == incumbent for r in rows) == 1
    # the log-prob pass's incumbent: the heuristic (no "logprobs" entry), timed first too
    logprobs = results["logprobs"]
    assert (
        {k: logprobs[0][k] for k in tuned.LOGPROBS_KEYS}
        == sweep.incumbent_logprobs(logits)
        == {**logits_launch.block_config(1003, 4), "num_stages": None, "loop_stages": 1, "l2_hints": True}
    )
    assert logprobs[0]["status"] == "ok"


def test_trls_triton_kernel_loads_without_importing_trl_and_agrees_with_ours():
    pytest.importorskip("trl")
    from cases import load_trl_kernel

    loaded_before = "trl" in sys.modules
    fused = load_trl_kernel()
    assert ("trl" in sys.modules) == loaded_before
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 33, generator=g)
    ids = torch.randint(0, 33, (2, 5), generator=g)
    theirs, _ = fused(logits, ids, temperature=0.7)
    torch.testing.assert_close(
        theirs, token_logprobs(logits, ids, temperature=0.7, backend="triton"), atol=1e-5, rtol=1e-5
    )


NCU_RAW = """==PROF== Connected to process 123
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC",\
"dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum","lts__t_sector_hit_rate.pct",\
"sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active","sm__inst_issued.avg.pct_of_peak_sustained_active",\
"sm__warps_active.avg.pct_of_peak_sustained_active"
"","","","","","","","","","","","byte","byte","nsecond","%","%","%","%"
"0","1","python3","h","grpo_forward_kernel","1","7","(512, 1, 1)","(132, 1, 1)","0","9.0",\
"5,000,000,000","4,980,000,000","2,200,000","50.0","40.0","70.0","45.0"
"1","1","python3","h","grpo_forward_kernel","1","7","(256, 1, 1)","(16384, 1, 1)","0","9.0",\
"5,100,000,000","4,980,000,000","2,400,000","51.2","30.1","62.0","88.0"
"2","1","python3","h","split_row_forward_kernel","1","7","(128, 1, 1)","(660, 1, 1)","0","9.0",\
"4,990,000,000","4,980,000,000","2,300,000","1.0","45.0","90.0","60.0"
"""


def test_ncu_summary_reads_the_raw_csv(tmp_path):
    path = tmp_path / "ncu.csv"
    path.write_text(NCU_RAW)
    summary = report.ncu_summary(str(path), logits_bytes=4_980_000_000)
    # the forward kernel's two launches are its two schedules, in the profile's order
    assert (
        "| one-pass, persistent within L2, L2 hints | grpo_forward_kernel | 2.200 | 1.00 | 1.00 | 50 | 45 | 70 | 40 |"
    ) in summary
    assert (
        "| one-pass forward (writes dlogits), a program a token | grpo_forward_kernel | 2.400 | 1.02 | 1.00 | 51 "
        "| 88 | 62 | 30 |"
    ) in summary
    assert "| split-row, a chunk held in registers | split_row_forward_kernel | 2.300 |" in summary


def test_ncu_profiles_the_sweeps_best_of_each_schedule(tmp_path):
    """The profile's configurations: each schedule's fastest exact sweep row at the profiled V (a persistent row is
    the read-once schedule's; a split-row row sorted into its variant by the chunk it resolves to, the streamed one
    not profiled), else the defaults."""
    import ncu_target

    V = ncu_target.SHAPE[2]

    def row(ms, **c):
        return {
            "mode": "one_pass",
            "V": V,
            "status": "ok",
            "exact": True,
            "median_ms": ms,
            "num_stages": 1,
            "loop_stages": 1,
            "l2_hints": False,
            "programs_per_sm": None,
            "split_row": None,
            **c,
        }

    rows = [
        row(3.0, BLOCK_V=4096, num_warps=8),
        row(2.6, BLOCK_V=4096, num_warps=8, split_row=8),
        row(2.4, BLOCK_V=4096, num_warps=4, split_row=16),
        row(2.5, BLOCK_V=8192, num_warps=8, split_row=64),
        row(2.1, BLOCK_V=4096, num_warps=4, split_row=64, exact=False),
        {**row(1.0, BLOCK_V=2048, num_warps=4), "V": 32000},
        row(2.7, BLOCK_V=8192, num_warps=16, l2_hints=True, programs_per_sm="l2"),
        row(2.8, BLOCK_V=4096, num_warps=16, l2_hints=True, programs_per_sm=2),
    ]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"logits": rows}))
    best = ncu_target.best_configs(str(path))
    assert set(best) == {"one_pass_l2", "one_pass", "split_row_held"}
    assert best["split_row_held"] == {
        "BLOCK_V": 8192,
        "num_warps": 8,
        "num_stages": 1,
        "loop_stages": 1,
        "l2_hints": False,
        "programs_per_sm": None,
        "split_row": 64,
    }  # the inexact one is never profiled
    assert best["one_pass"]["BLOCK_V"] == 4096 and best["one_pass"]["split_row"] is None
    assert best["one_pass_l2"]["programs_per_sm"] == "l2" and best["one_pass_l2"]["BLOCK_V"] == 8192
    defaults = ncu_target.best_configs(None)
    assert defaults["split_row_held"]["split_row"] == 64 and defaults["one_pass_l2"]["programs_per_sm"] == "l2"


def test_the_vocab_parallel_step_runs_on_two_ranks_and_matches_the_unsharded_one(tmp_path):
    """benchmarks/vocab_parallel.py as the suite runs it without CUDA: two gloo ranks, tiny shapes."""
    import subprocess

    out = tmp_path / "vocab_parallel.json"
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "vocab_parallel.py"), "--out", str(out), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    results = json.loads(out.read_text())
    assert "error" not in results and results["cases"]
    for case in results["cases"]:
        assert case["P"] == 2 and case["matches_unsharded"], case
        assert case["loss_difference"] < 1e-5 and case["grad_sum_relative_difference"] < 1e-5
        assert len(case["sharded_ms_per_rank"]) == 2
    table = report.vocab_parallel_table(str(out))
    assert "| 2 x 8 x 1004 | float32 | 2 |" in table


def test_the_packed_benchmark_path_times_the_padded_loss_on_its_own_logits():
    """The GPU suite's packed case: given its packed logits by ``path_input``, it computes the padded
    batch's loss, and its gradient is taken of those logits (only the active tokens')."""
    import cases

    x = cases.make_inputs(2, 8, 1003, device="cpu")
    leaf, given = cases.path_input("ours one-pass packed", x["full_logits"], x, requires_grad=True)
    assert given is leaf and tuple(leaf.shape) == (int((x["completion_mask"] != 0).sum()), 1003)
    loss = cases._ours_packed()(x, given)
    (grad,) = torch.autograd.grad(loss, leaf)
    padded_leaf, padded_given = cases.path_input("ours one-pass", x["full_logits"], x, requires_grad=True)
    padded = cases._ours(True)(x, padded_given)
    (padded_grad,) = torch.autograd.grad(padded, padded_leaf)
    torch.testing.assert_close(loss, padded, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, padded_grad[:, :-1][x["completion_mask"] != 0], atol=1e-7, rtol=1e-5)


def test_the_whole_step_benchmark_runs_every_path_and_reports_it(tmp_path):
    """benchmarks/train_step.py as the suite runs it without CUDA: a tiny Llama, a real optimizer step per loss
    path (the eager loss, ours on logits, ours from hidden states, stock TRL's fused head where TRL is installed),
    and its report table."""
    import subprocess

    out = tmp_path / "train_step.json"
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "train_step.py"), "--out", str(out), "--smoke"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    results = json.loads(out.read_text())
    import trl_head

    stock_trl = {"stock TRL"} if trl_head.available() else set()
    assert {c["path"] for c in results["cases"]} == {"eager", "ours logits", "ours hidden"} | stock_trl
    for case in results["cases"]:
        assert case["step_s"] > 0 and 0 < case["loss_share"] and case["tokens_per_s"] > 0, case
    table = report.train_step_table(str(out))
    assert "| tiny | 2 x 16 | ours hidden |" in table
    (tmp_path / "vocab_parallel.json").write_text(json.dumps({"cases": []}))
    report.merge_steps(str(tmp_path))  # the device run's 8-file limit: one steps.json for both step stages
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.json"]
    assert set(json.loads((tmp_path / "steps.json").read_text())) == {"train_step", "vocab_parallel"}


def test_the_longest_fit_search_doubles_then_bisects():
    """The length search on a fake step that runs out of memory past 3000 tokens: 1024, 2048 fit, 4096 does not,
    then bisection to within 256 tokens."""
    import train_step

    seen = []

    def fake_fits(path, model, optimizer, B, T, V, loss_fns, device):
        seen.append(T)
        return T <= 3000

    original = train_step.fits
    train_step.fits = fake_fits
    try:
        fit = train_step.longest_fit("ours hidden", None, None, 8, 1024, 1000, {}, torch.device("cpu"), float("inf"))
    finally:
        train_step.fits = original
    assert seen[:3] == [1024, 2048, 4096] and fit["first_oom"] - fit["longest"] <= 256
    assert 2048 <= fit["longest"] <= 3000 < fit["first_oom"] and not fit["capped"]


def test_the_sanitizer_report_counts_errors_per_kernel():
    import sanitize

    text = """========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 4 bytes
=========     at 0x1a0 in split_row_forward_kernel
=========     by thread (3,0,0) in block (7,0,0)
========= Invalid __global__ read of size 4 bytes
=========     at 0x1a0 in split_row_forward_kernel
========= Race reported between Write access at 0x2b0 in grpo_forward_kernel
========= ERROR SUMMARY: 3 errors
"""
    assert sanitize.errors_per_kernel(text) == {"split_row_forward_kernel": 2, "grpo_forward_kernel": 1}
    assert sanitize.errors_per_kernel("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n") == {}
    other_format = "========= Invalid __global__ write of size 2 bytes\n=========     at linear_dlogits_kernel+0x3f0\n"
    assert sanitize.errors_per_kernel(other_format) == {"linear_dlogits_kernel": 1}
    for tool in sanitize.TOOLS:
        assert sanitize.command(tool)[:3] == ["compute-sanitizer", "--tool", tool]
        assert sanitize.command(tool)[-1] == "benchmarks/sanitize_cases.py"


def test_the_sanitizers_cases_run_every_kernel_in_the_interpreter():
    """benchmarks/sanitize_cases.py, what compute-sanitizer runs on the device, runs each of its cases here (the
    kernels in Triton's interpreter): every case's calls are valid, so a sanitizer report is about the kernels."""
    import subprocess

    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "sanitize_cases.py")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=BENCHMARKS.parent,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    import sanitize_cases

    assert f"{len(sanitize_cases.CASES)} of {len(sanitize_cases.CASES)} cases ran" in run.stdout


def test_the_device_run_returns_at_most_eight_files():
    """The GPU mode's outputs, as gpu_suite.sh names them, fit the device tool's limit of 8 files."""
    suite = (BENCHMARKS / "gpu_suite.sh").read_text()
    outputs = {
        "tests.txt",
        "sweep.json",
        "bench.json",
        "bench_fused_linear.json",
        "steps.json",
        "ncu.csv",
        "report.md",
        "run.log",
    }
    for name in outputs:
        assert name in suite, name
    assert "--merge-steps" in suite and len(outputs) == 8


def test_a_sweep_candidate_runs_its_own_schedule_whatever_tuned_json_says(monkeypatch):
    """A plain candidate passes split_row and programs_per_sm as 0 (off), so that a measured default (a split-row
    winner in tuned.json, applied after a first run) never turns it into another schedule; a split-row one
    passes its K."""
    x = sweep.logits_inputs(1, 3, 301, "cpu")
    seen = []
    real = logits_launch.forward
    monkeypatch.setattr(
        logits_launch, "forward", lambda *a, config=None, **k: seen.append(dict(config)) or real(*a, config=config, **k)
    )
    sweep.run_logits(
        x,
        {
            "mode": "one_pass",
            "BLOCK_V": 256,
            "num_warps": 2,
            "num_stages": None,
            "programs_per_sm": None,
            "split_row": None,
        },
    )
    sweep.run_logits(
        x,
        {
            "mode": "one_pass",
            "BLOCK_V": 256,
            "num_warps": 2,
            "num_stages": None,
            "programs_per_sm": None,
            "split_row": 2,
        },
    )
    assert [(c["split_row"], c["programs_per_sm"]) for c in seen] == [(0, 0), (2, 0)]
    assert logits_launch.logits_launch_config(x["logits"], seen[0])["split_row"] == 0


def test_the_suite_holds_its_stages_to_nine_minutes(tmp_path):
    """gpu_suite.sh's stage limits (GPU defaults) plan under its SUITE_LIMIT of 9 minutes with every kill's grace
    and the set-up; and its ``stage`` clamps each limit to what the suite has left, skipping a stage that would get
    under 5 s (or whose limit is 0, off), so a run never exceeds the limit whatever a stage takes."""
    import re
    import subprocess

    suite = (BENCHMARKS / "gpu_suite.sh").read_text()
    limits = {name: int(value) for name, value in re.findall(r"(T_[A-Z]+)=\$\{T_[A-Z]+:-(\d+)\}", suite)}
    assert set(limits) >= {"T_TESTS", "T_SWEEP", "T_BENCH", "T_FUSED", "T_TRAIN", "T_PROFILE", "T_SAN", "T_NCU"}
    suite_limit = int(re.search(r"SUITE_LIMIT=\$\{SUITE_LIMIT:-(\d+)\}", suite).group(1))
    grace = int(re.search(r"^GRACE=(\d+)$", suite, re.MULTILINE).group(1))
    assert suite_limit <= 540
    assert sum(limits.values()) + grace * len(limits) + 40 <= suite_limit, limits  # 40 s: set-up and the report
    functions = suite[suite.index("# clamp SECONDS") : suite.index("\nFIRST_TESTS=")]
    script = f"""set -u; SUITE_LIMIT=60; GRACE=5; OUT={tmp_path}; LOG={tmp_path}/log; say() {{ echo "$*"; }}
{functions}
stage plenty 30 true; SECONDS=25; stage squeezed 30 true; SECONDS=40; stage spent 30 true; stage off 0 true"""
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60).stdout
    assert "stage plenty (limit 30 s)" in out and "stage squeezed (limit 15 s)" in out, out
    assert "stage spent: skipped (the suite's 60 s are spent)" in out and "stage off: skipped (off)" in out, out


def _loss_row(path, median_ms, pass_="fwd+bwd", N=16, V=1003, smoke=True):
    return {
        "smoke": smoke,
        "N": N,
        "V": V,
        "dtype": "fp32",
        "level": "token",
        "pass": pass_,
        "path": path,
        "median_ms": median_ms,
        "model_GBps": 1.0,
        "fraction_of_copy": 0.5,
        "device": "cpu",
        "torch": "2.13",
        "triton": "3.9",
    }


def test_the_report_says_smoke_times_are_host_cost_and_pairs_each_pass_with_its_own_baselines():
    """A smoke run's table says what its times carry; each row's speed-ups are against eager and the
    torch.compile'd loss of the same shape and pass (fwd against fwd, fwd+bwd against fwd+bwd), '-' where that
    shape has no compiled row."""
    rows = [
        _loss_row("eager", 2.0),
        _loss_row("ours (torch path)", 1.0),
        _loss_row("eager", 1.0, "fwd"),
        _loss_row("ours (torch path)", 0.5, "fwd"),
    ]
    table = report.table(rows)
    assert table.startswith("Smoke run (GRPO_BENCH_SMOKE=1): one small shape")
    assert "| fwd+bwd | ours (torch path) | 1.000 |" in table and "| 2.00x | - |" in table
    assert "| fwd | ours (torch path) | 0.500 |" in table  # against fwd eager (1.0), not fwd+bwd's
    assert table.count("| 2.00x | - |") == 2 and "4.00x" not in table and "1.00x" in table
    big = [
        _loss_row(path, ms, N=1024, V=32000, smoke=False)
        for path, ms in (("eager", 600.0), ("torch.compile", 240.0), ("ours (torch path)", 200.0))
    ]
    table = report.table(big)
    assert not table.startswith("Smoke") and "| ours (torch path) | 200.000 |" in table
    assert "| 3.00x | 1.20x |" in table  # eager 600 / 200, compiled 240 / 200
