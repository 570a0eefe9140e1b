"""Every kernel and schedule once, at small shapes, for compute-sanitizer (``benchmarks/sanitize.py`` runs this
script under each tool): what a sanitized pytest selection did in several times the time.

    python benchmarks/sanitize_cases.py [--list]

The cases: the one-pass forward a program a token, on the persistent schedule within L2 with the eviction hints,
pipelined, and over 16 warps (128-bit loads, the masked remainder); the two-pass backward (also in place and
pipelined); the log-prob pass; a whole loss through the token-weights and loss-metrics kernels with a scaled
backward (the in-place scale); a packed batch; the split-row kernel's cooperative launch; the fused lm_head's
recomputing forward and tiled backward, its 3-product mode with a gradient, and without one (the tile-state and
combine kernels). Rows of V = 1003 (odd: unaligned, a masked remainder) and V = 4104 (aligned, a remainder) in
bf16 on a GPU, fp32 in Triton's interpreter on a CPU (CI runs it there: the calls stay valid). Each case prints
"ok" or its error; the exit status counts the errors.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback

import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
BACKEND = "triton"  # the kernels on a GPU; on a CPU the interpreter (TRITON_INTERPRET=1), not the torch path


def _batch(B=3, T=7, V=1003, seed=0):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(B, T + 1, V, generator=g).to(DEVICE, DTYPE)
    ids = torch.randint(0, V, (B, T), generator=g).to(DEVICE)
    mask = torch.ones(B, T)
    mask[0, T - 2 :] = 0
    mask[2] = 0  # an all-padding row: never read
    lp = torch.randn(B, T, generator=g) - 7.0
    return dict(
        full=full,
        ids=ids,
        mask=mask.to(DEVICE),
        adv=torch.randn(B, generator=g).to(DEVICE),
        old=(lp + 0.1).to(DEVICE),
        ref=(lp - 0.1).to(DEVICE),
    )


def _one_pass(config, V=1003):
    from grpo_kernels import GRPOOptions
    from grpo_kernels.kernels import logits_launch
    from grpo_kernels.kernels.contracts import OnePassGradient, TokenInputs

    x = _batch(V=V)
    B, T = x["ids"].shape
    flat = lambda t: t.reshape(-1).float().contiguous()  # noqa: E731
    tokens = TokenInputs(flat(x["mask"]), flat(x["adv"][:, None].expand(B, T)), flat(x["old"]), flat(x["ref"]))
    logits_launch.forward(
        x["full"][:, :-1],
        x["ids"],
        kernel_loss=GRPOOptions(beta=0.04).kernel_loss,
        tokens=tokens,
        compute_entropy=True,
        gradient=OnePassGradient(torch.full((B * T,), 0.1, device=DEVICE)),
        config=config,
    )


def _backward(config, in_place=False, V=4104):
    from grpo_kernels.kernels import logits_launch

    x = _batch(V=V)
    logits = x["full"][:, :-1].contiguous()
    r = logits_launch.forward(logits, x["ids"])
    g = torch.linspace(-1, 1, r.lse.numel(), device=DEVICE)
    logits_launch.backward(logits, x["ids"], r.lse, g, 0.9, in_place=in_place, config=config)


def _loss(**options):
    from grpo_kernels import grpo_loss

    x = _batch(V=4104)
    leaf = x["full"].detach().requires_grad_()
    out = grpo_loss(
        leaf,
        x["ids"],
        x["mask"],
        x["adv"],
        x["old"],
        x["ref"],
        beta=0.04,
        drop_last_position=True,
        backend=BACKEND,
        **options,
    )
    (3.0 * out.loss).backward()


def _packed():
    from grpo_kernels import grpo_loss

    x = _batch(V=1003)
    rows = x["mask"] != 0
    cu = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    cu[1:] = rows.sum(-1).cumsum(0)
    leaf = x["full"][:, :-1][rows].detach().contiguous().requires_grad_()
    grpo_loss(
        leaf,
        x["ids"][rows],
        torch.ones_like(x["old"][rows]),
        x["adv"],
        x["old"][rows],
        x["ref"][rows],
        beta=0.04,
        cu_seqlens=cu,
        backend=BACKEND,
    ).loss.backward()


def _split_row():
    from grpo_kernels.kernels import split_row_launch

    with split_row_launch.split_row_schedule(4, 256):
        _loss()


@contextlib.contextmanager
def _tiled(budget):
    """The lm_head's tiled workspaces made small enough that a small head runs in several tiles each way."""
    from grpo_kernels.kernels import fused_linear_launch

    saved = fused_linear_launch.LINEAR_TILED_WORKSPACE_BYTES, fused_linear_launch.MIN_VOCAB_TILE
    fused_linear_launch.LINEAR_TILED_WORKSPACE_BYTES, fused_linear_launch.MIN_VOCAB_TILE = budget, 128
    try:
        yield
    finally:
        fused_linear_launch.LINEAR_TILED_WORKSPACE_BYTES, fused_linear_launch.MIN_VOCAB_TILE = saved


def _lm_head(mode, with_grad=True):
    from grpo_kernels import fused_linear_grpo_loss

    x = _batch(V=1003)
    g = torch.Generator().manual_seed(1)
    B, T = x["ids"].shape
    hidden = torch.randn(B, T, 64, generator=g).to(DEVICE, DTYPE).requires_grad_(with_grad)
    weight = (0.1 * torch.randn(1003, 64, generator=g)).to(DEVICE, DTYPE).requires_grad_(with_grad)
    with _tiled(8 * 128 * hidden.element_size()), torch.set_grad_enabled(with_grad):
        out = fused_linear_grpo_loss(
            hidden,
            weight,
            x["ids"],
            x["mask"],
            x["adv"],
            x["old"],
            x["ref"],
            beta=0.04,
            lm_head_mode=mode,
            backend=BACKEND,
        )
        if with_grad:
            out.loss.backward()


def _logprobs():
    from grpo_kernels import token_logprobs

    x = _batch(V=4104)
    token_logprobs(x["full"], x["ids"], 0.7, drop_last_position=True, backend=BACKEND)


CASES = {
    "one-pass, a program a token": lambda: _one_pass(None),
    "one-pass, persistent within L2, L2 hints": lambda: _one_pass({"programs_per_sm": "l2", "l2_hints": True}),
    "one-pass, pipelined": lambda: _one_pass({"loop_stages": 3}, V=4104),
    "one-pass, 16 warps over 1024-logit blocks": lambda: _one_pass({"BLOCK_V": 1024, "num_warps": 16}, V=4104),
    "backward (two-pass)": lambda: _backward(None),
    "backward, in place, pipelined": lambda: _backward({"loop_stages": 3}, in_place=True),
    "log-prob pass": _logprobs,
    "loss end to end, scaled backward": lambda: _loss(),
    "loss end to end, two-pass, entropy bonus": lambda: _loss(one_pass=False, entropy_coef=0.01),
    "packed batch": _packed,
    "split-row (cooperative launch)": _split_row,
    "lm_head recompute, tiled backward": lambda: _lm_head("recompute"),
    "lm_head 3-product": lambda: _lm_head("three_products"),
    "lm_head 3-product without a gradient (tiles)": lambda: _lm_head("three_products", with_grad=False),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the cases' names")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(CASES))
        return 0
    errors = 0
    for name, case in CASES.items():
        try:
            case()
            if ON_GPU:
                torch.cuda.synchronize()
            print(f"{name}: ok", flush=True)
        except Exception:  # a case's failure is a result: the others still run under the sanitizer
            errors += 1
            print(f"{name}: FAILED\n{traceback.format_exc(limit=3)}", flush=True)
    print(f"{len(CASES) - errors} of {len(CASES)} cases ran")
    return errors


if __name__ == "__main__":
    sys.exit(main())
