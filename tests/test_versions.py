"""Versions the package cannot run with are refused with a message naming them, not deep inside a kernel."""

import numpy
import pytest
import torch
import triton
from helpers import make_batch

from grpo_kernels import grpo_loss, validation


@pytest.fixture
def fresh_interpreter_check():
    validation.check_interpreter_versions.cache_clear()
    yield validation.check_interpreter_versions
    validation.check_interpreter_versions.cache_clear()


@pytest.mark.parametrize(
    "triton_version, numpy_version, refused",
    [("3.6.0", "2.4.1", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.5.0", False), ("3.3.1", "2.4.0", True)],
)
def test_the_interpreter_names_triton_and_numpy_it_cannot_run_with(
    monkeypatch, fresh_interpreter_check, triton_version, numpy_version, refused
):
    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    if refused:
        with pytest.raises(RuntimeError, match=rf"triton {triton_version} and numpy {numpy_version}.*numpy<2.4"):
            fresh_interpreter_check()
    else:
        fresh_interpreter_check()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's check (CPU tensors)")
def test_the_loss_call_on_cpu_runs_the_interpreter_check(monkeypatch, fresh_interpreter_check):
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.0")
    with pytest.raises(RuntimeError, match="numpy >= 2.4"):
        grpo_loss(**make_batch(), backend="triton")
    grpo_loss(**make_batch(), backend="torch")  # the torch path needs no interpreter


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's check (CPU tensors)")
def test_the_split_row_interpreter_run_names_the_triton_it_needs(monkeypatch, fresh_interpreter_check):
    monkeypatch.setattr(triton, "__version__", "3.3.1")
    monkeypatch.setattr(numpy, "__version__", "2.3.5")  # (with numpy >= 2.4 the interpreter check refuses first)
    batch = make_batch()
    batch["logits"].requires_grad_()  # the one-pass schedule writes the gradient in its forward
    from grpo_kernels.kernels import split_row_launch

    # the schedule itself, not tests/helpers.split_row, which skips where the real triton is older than 3.4
    with split_row_launch.split_row_schedule(2, 256), pytest.raises(RuntimeError, match="needs triton >= 3.4"):
        grpo_loss(**batch, backend="triton", one_pass=True)


def test_the_trl_adapter_refuses_trl_older_than_it_matches():
    pytest.importorskip("trl", reason="the trl extra is not installed (pip install 'grpo-kernels[trl]')")
    from grpo_kernels.integration import trl as trl_adapter

    for version in ("1.0.0", "1.8.2", "1.9.0"):
        with pytest.raises(ImportError, match=rf"TRL >= 1\.10, got trl {version}"):
            trl_adapter.check_trl_version(version)
    for version in ("1.10.0", "1.16.0", "1.17.0.dev0", "2.0.0"):
        trl_adapter.check_trl_version(version)
