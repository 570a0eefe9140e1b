"""The package's hard dependencies are torch, triton and transformers: the thin trainer's progress bars and figures
(tqdm, matplotlib) come with the ``train`` extra. ``import grpo_kernels`` and a loss call import neither, and the
trainer's commands without them name the extra (scripts/wheel_check.sh does the same on the installed wheel)."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_the_hard_dependencies_are_torch_triton_and_transformers():
    text = PYPROJECT.read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)\]", text, re.S | re.M).group(1)
    names = [re.match(r'\s*"([A-Za-z0-9_-]+)', line).group(1) for line in dependencies.strip().splitlines()]
    assert names == ["torch", "triton", "transformers"]
    assert re.search(r'^train = \["tqdm", "matplotlib"\]$', text, re.M)


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300)


def test_a_loss_call_imports_no_trainer_package():
    proc = _run("""
        import sys
        import torch  # (torch.hub imports tqdm where it is installed: torch's, not the package's)
        for name in ("tqdm", "tqdm.auto", "matplotlib", "matplotlib.figure"):
            sys.modules[name] = None  # from here on, an import of either raises
        import grpo_kernels
        from grpo_kernels import GRPOLoss, fused_linear_grpo_loss, sft_loss, token_logprobs
        logits = torch.randn(2, 3, 11, requires_grad=True)
        ids, mask, adv = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), torch.tensor([1.0, -1.0])
        GRPOLoss(beta=0.0)(logits, ids, mask, adv).loss.backward()
        token_logprobs(logits.detach(), ids)
        sft_loss(logits, ids, mask).loss.backward()
        hidden = torch.randn(2, 3, 4, requires_grad=True)
        fused_linear_grpo_loss(hidden, torch.randn(11, 4), ids, mask, adv).loss.backward()
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok"


def test_the_trainer_without_its_extra_names_it():
    proc = _run("""
        import sys
        sys.modules["matplotlib"] = None  # as where the train extra is not installed
        import importlib.util
        real = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name == "matplotlib" else real(name, *a)
        from grpo_kernels.training import cli
        code = cli.main(["train", "--steps", "1"])
        print("exit", code)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("exit 1")
    assert 'grpo-kernels train needs matplotlib, which the train extra installs: pip install "grpo-kernels[train]"' in (
        proc.stderr
    )
