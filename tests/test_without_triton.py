"""Where triton is not installed (macOS, Windows), the package imports and the CPU path runs."""

import subprocess
import sys
import textwrap


def test_import_and_cpu_path_without_triton():
    script = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # any import of triton now raises ImportError, as where it is absent
        import torch
        import grpo_kernels
        from grpo_kernels import GRPOLoss, fused_linear_grpo_loss, token_logprobs
        from grpo_kernels.training.trainer import GRPOTrainer  # the trainer and its imports too

        g = torch.Generator().manual_seed(0)
        logits = torch.randn(2, 3, 11, generator=g, requires_grad=True)
        ids, mask, adv = torch.randint(0, 11, (2, 3), generator=g), torch.ones(2, 3), torch.randn(2, generator=g)
        out = GRPOLoss(beta=0.0)(logits, ids, mask, adv)  # auto: the torch path
        out.loss.backward()
        assert logits.grad is not None and torch.isfinite(logits.grad).all()
        token_logprobs(logits.detach(), ids)
        fused_linear_grpo_loss(torch.randn(2, 3, 4), torch.randn(11, 4), ids, mask, adv).loss
        try:
            GRPOLoss(backend="triton")(logits, ids, mask, adv)
        except ImportError as e:
            assert "the Triton backend needs the triton package" in str(e), e
        else:
            raise AssertionError("backend='triton' without triton did not raise")
        from grpo_kernels.kernels import TritonMissing, logits_launch
        assert isinstance(logits_launch, TritonMissing)  # the launchers' stand-in: using it names what to install
        try:
            logits_launch.loss_forward
        except ImportError as e:
            assert "grpo_kernels.kernels.logits_launch.loss_forward" in str(e) and "pip install triton" in str(e), e
        else:
            raise AssertionError("the stand-in did not raise")
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
