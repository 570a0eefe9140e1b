"""The torch path's entropy on peaked rows with large logits, against fp64.

H = lse - sum(p x) computed from raw logits subtracts two numbers of the size of the largest logit, so fp32 loses
the entropy's low digits exactly where a policy is near-deterministic; the torch path works on rows shifted by
their maximum. Bound: 2e-5 absolute at a largest logit of 57.8 (the fp32 Triton kernel's error there is ~1e-5).
"""

import pytest
import torch

from grpo_kernels import torch_path


def _peaked_rows(largest: float, rows: int = 64, V: int = 4099) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, V, generator=g, dtype=torch.float64) * 3.0
    x[:, 0] = largest  # the top token, far above the rest: p ~ 1, entropy ~ 0
    x[: rows // 2, 1] = largest - torch.linspace(1, 12, rows // 2, dtype=torch.float64)  # a runner-up
    return x


def _exact(x64: torch.Tensor):
    logp = torch.log_softmax(x64, -1)
    return -(logp.exp() * logp).sum(-1), logp


@pytest.mark.parametrize("largest", [28.9, 57.8, 62.0])
def test_logits_path_entropy_on_peaked_rows(largest):
    x64 = _peaked_rows(largest)
    ids = torch.randint(0, x64.shape[1], (1, x64.shape[0]), generator=torch.Generator().manual_seed(1))
    x32 = x64.float()
    logp, entropy, lse, _ = torch_path.forward(x32.unsqueeze(0), ids, 1.0, True)
    exact_entropy, exact_logp = _exact(x32.double())  # the fp32 inputs, exactly
    assert (entropy[0].double() - exact_entropy).abs().max() <= 2e-5
    assert torch.allclose(logp[0].double(), exact_logp.gather(-1, ids[0].unsqueeze(-1)).squeeze(-1), atol=2e-5, rtol=0)
    assert torch.allclose(lse[0].double(), torch.logsumexp(x32.double(), -1), atol=1e-5, rtol=1e-7)


def test_lm_head_path_entropy_on_peaked_rows():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(48, 32, generator=g)
    weight = torch.randn(1031, 32, generator=g) * 0.3
    weight[7] = 0.0
    hidden[:, 0] = 2.0
    weight[7, 0] = 28.9  # token 7's logit ~ 57.8 on every row
    ids = torch.randint(0, 1031, (48,), generator=g)
    lse, logp, entropy, _ = torch_path.linear_forward(hidden, weight, None, ids, 1.0, True)
    x64 = hidden.double() @ weight.double().T
    assert x64.max() > 50
    exact_entropy, exact_logp = _exact(x64)
    assert (entropy.double() - exact_entropy).abs().max() <= 2e-5
    assert torch.allclose(logp.double(), exact_logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1), atol=5e-5, rtol=0)


def test_rows_of_minus_infinity_and_masked_vocabulary():
    x = torch.full((1, 3, 5), float("-inf"))
    x[0, 1] = torch.tensor([0.0, 1.0, float("-inf"), 2.0, float("-inf")])
    x[0, 2, 0] = 60.0
    logp, entropy, lse, _ = torch_path.forward(x, torch.tensor([[0, 3, 0]]), 1.0, True)
    ref = torch.log_softmax(x[0, 1].double(), -1)
    assert torch.isfinite(entropy[0, 1:]).all() and entropy[0, 2] == 0 and logp[0, 2] == 0
    assert torch.isclose(entropy[0, 1].double(), -(ref.exp() * torch.where(ref.isinf(), 0, ref)).sum(), atol=1e-6)
    assert lse[0, 2] == 60.0


def test_cpu_autocast_changes_no_row_statistic():
    """CPU autocast runs ``torch.linalg.vecdot`` in bf16: the torch path's row statistics (entropy, Σπ², the
    log-sum-exp and the log-probs) stay fp32 under it, eager and compiled alike (the entropy's error was 7.5e-3)."""
    from grpo_kernels import selective_log_softmax_and_entropy, token_logprobs

    x = _peaked_rows(6.0, rows=12, V=257).float().view(2, 6, -1)
    ids = torch.randint(0, x.shape[-1], (2, 6), generator=torch.Generator().manual_seed(2))

    def statistics(logits):
        logp, entropy = selective_log_softmax_and_entropy(logits, ids, backend="torch")
        _, _, squares = token_logprobs(logits, ids, return_entropy=True, return_sum_pi_squared=True, backend="torch")
        return logp, entropy, squares

    expected = statistics(x)
    compiled = torch.compile(statistics, fullgraph=True, backend="aot_eager")
    for run in (statistics, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for name, want, got in zip(("log-probs", "entropy", "sum of squares"), expected, run(x), strict=True):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
