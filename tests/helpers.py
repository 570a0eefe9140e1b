"""Shared test helpers: input builders and a closeness check that prints its errors."""

import torch

def assert_close(name, expected, actual, *, atol, rtol):
    """torch.testing.assert_close with the max abs / rel error in the message."""
    expected, actual = expected.detach().float().cpu(), actual.detach().float().cpu()
    diff = (expected - actual).abs()
    rel = diff / expected.abs().clamp(min=1e-12)
    torch.testing.assert_close(
        actual, expected, atol=atol, rtol=rtol,
        msg=lambda m: f"{name}: max abs err {diff.max():.3e}, max rel err {rel.max():.3e}\n{m}",
    )


def make_batch(B=3, T=5, V=1003, *, dtype=torch.float32, device="cpu", seed=0, per_token_adv=False,
               off_policy=True, clip_spread=0.4, strided=False, temperature=1.0):
    """Inputs with a partly masked row, a fully masked row and ratios on both sides of the clip range."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(B, T + 1, V, generator=g) * 2.0
    logits = full[:, :-1] if strided else full[:, :T].contiguous()
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    if B > 1:
        mask[0, T // 2 + 1:] = 0  # a partly masked row
    if B > 2:
        mask[-1] = 0  # a fully masked row
    true_lp = torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    old = true_lp + clip_spread * torch.randn(B, T, generator=g) if off_policy else None
    ref = true_lp + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn((B, T) if per_token_adv else (B,), generator=g)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    logits = logits.to(device=device, dtype=dtype) if not strided else full.to(device=device, dtype=dtype)[:, :-1]
    return dict(logits=logits, completion_ids=to(ids), completion_mask=to(mask), advantages=to(adv),
                old_logps=to(old), ref_logps=to(ref))
