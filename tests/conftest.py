"""Test set-up: without a GPU the Triton kernels run in Triton's interpreter.

TRITON_INTERPRET must be set before triton is imported, so it is set here, at collection.
On a machine with CUDA the kernels are compiled and run natively instead.
"""

import collections
import os
import sys
from pathlib import Path

# Torch's OpenMP threads wait passively: set before torch loads (OpenMP reads it once), so that a test run sharing
# the machine with another busy process does not spin against it (the CLI does the same: training.cli)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Each xdist worker its share of the cores (and the processes its tests start, which inherit it): with `-n 2` on two
# cores, two workers of two threads each wait on each other's descheduled threads (two learning runs side by side:
# 120 s at two threads each, 99 s at one, the same numbers)
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest
import torch

# Triton 3.9 warns that this default will change; keep today's (fused multiply-add on).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the developer tools the tests run (tools/aot.py: the ahead-of-time compile), importable as top-level modules
TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
# the benchmarks' eager baseline (benchmarks/eager_baseline.py), which some tests hold to the specification too
sys.path.insert(0, str(TOOLS.parent / "benchmarks"))


@pytest.fixture
def device():
    return DEVICE


# ---- The fast tier: `pytest -m fast -n 2` (docs/testing.md) ---------------------------------------------------------
#
# Each test function's first case, and its first on each backend (a "torch" or "triton" case), so that every module's
# core behaviour runs on both backends; but not the tests below, which train whole runs, start several processes or
# compile every kernel (what each checks stays in the full suite, which is what CI runs).
NOT_FAST = (
    "tests/test_aot_compile.py",
    "tests/test_deepspeed.py",
    "tests/test_two_processes.py",
    "tests/test_resume.py",
    "tests/test_openrlhf_ray.py",
    "tests/test_integration_examples.py",
    "tests/test_verl_megatron.py",
    "tests/test_distributed.py",
    "tests/test_gloo_ranks.py",
    "tests/test_trainer.py::test_a_short_default_run_learns",
    "tests/test_trainer.py::test_seeds_command_reports_the_spread",
    "tests/test_trainer.py::test_fused_lm_head_applies_the_models_head_transform",
    "tests/test_model_families.py::test_trl_adapter_default_matches_stock_trl",
    "tests/test_verl_integration.py::test_verls_ray_worker_imports_external_lib_and_calls_our_names",
    "tests/test_cli.py",
    "tests/test_vocab_parallel.py",
    "tests/test_methods.py::test_a_vocabulary_split_over_two_processes_equals_one",
    "tests/test_kept_set.py::test_a_vocabulary_split_over_two_processes",
    "tests/test_verl_integration.py::test_sum_pi_squared_over_a_vocabulary_split_is_verls_on_the_whole",
    "tests/test_fused_head_ops.py::test_a_vocabulary_parallel_head_is_the_whole_one",
    "tests/test_methods.py::test_reward_model_learns_preferences_and_scores_completions",
    "tests/test_distillation.py::test_a_vocabulary_split_over_two_processes_equals_one",
    "tests/test_collectives.py::test_every_collective_over_two_ranks",
    "tests/test_wrapped.py::test_fused_lm_head_under_fsdp2_matches_an_unsharded_run",
    "tests/test_trl_integration.py::test_fused_lm_head_under_fsdp2_through_the_adapter",
    "tests/test_trl_integration.py::test_fused_lm_head_trains_under_ddp_as_accelerate_launches_it",
    "tests/test_trl_integration.py::test_two_processes_match_one_process_on_the_trl_path",
    "tests/test_device_suite.py",
    "tests/test_compile.py::test_ten_values_of_every_float_option_add_no_graph",
    "tests/test_active_tokens.py::test_a_vocabulary_split_compacts_alike_on_every_rank",
    "tests/test_openrlhf_integration.py::test_the_openrlhf_advantage_preset_is_openrlhfs_group_norm_with_its_clip_range",
)


def pytest_collection_modifyitems(config, items):
    seen = set()
    for item in items:
        function = item.nodeid.split("[")[0]
        if function.split("::")[0] in NOT_FAST or function in NOT_FAST:
            continue
        case = item.nodeid[len(function) :]
        backend = "triton" if "triton" in case else "torch" if "torch" in case else ""
        if (function, backend) not in seen:
            seen.add((function, backend))
            item.add_marker(pytest.mark.fast)


def pytest_terminal_summary(terminalreporter):
    """Each test file's time (set-up, call and tear-down of its tests, summed over the workers), slowest first: what
    CI's log says of where its minutes go (docs/testing.md, "The budget")."""
    per_file = collections.Counter()
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call", "teardown"):
                per_file[report.nodeid.split("::")[0]] += report.duration
    if per_file:
        terminalreporter.write_sep("=", "test time per file (s, summed over the workers)")
        for path, seconds in per_file.most_common():
            terminalreporter.write_line(f"{seconds:8.1f}  {path}")
