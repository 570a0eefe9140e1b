"""The built-in task: "Which is bigger? 9.11 or 9.9", and its family of decimal comparisons.

Everything is made here, with no download: the prompts (a train set and a disjoint
held-out set), a character-level Hugging Face tokenizer, a tiny Llama model, a short
supervised warm-up that teaches the answer *format* but not the answer (it is trained on
a randomly chosen one of the two numbers), and the rule-based rewards.
"""

from __future__ import annotations

import random
import sys
import time

import torch

from .. import progress_bar, rewards
from ..rollout import left_padded_positions

NAME = "compare"
PROMPT = "Which is bigger? {a:<4} or {b:<4}\nAnswer: "  # fixed-width fields: every prompt is 38 characters
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
SAME_INTEGER_SHARE = 1.0  # the 9.11 vs 9.9 trap: the fractional parts decide
CHARACTERS = "0123456789.-/ ?:\nWhichsbgeronwA"
# The warm-up's cap in steps of 32 examples, and its learning-rate schedule's length: it ends earlier, at a check
# (every WARMUP_CHECK_EVERY steps), once the sampled answers are well-formed at WARMUP_FORMAT_TARGET. A fixed 1200
# steps over a 1200-step schedule left seed 7 with 70 % well-formed sampled answers, which 200 GRPO steps hardly
# moved; the same seed reaches 93 % at step 1200 of a 2400-step schedule (the longer schedule keeps its learning rate
# up).
WARMUP_STEPS = 2400
WARMUP_CHECK_EVERY = 200
WARMUP_FORMAT_TARGET = 0.9
WARMUP_CHECK_PROMPTS = 256  # training prompts of their own (never the evaluation set's), one sample each
# A seed that reaches the cap below the target goes on with larger batches: its malformed answers mix the two
# numbers' digits (3.66 vs 3.9 -> "3.6"), and at 32 examples a step the gradient noise of the 50 / 50 targets keeps
# it from learning to finish the number it started (seed 18 sat at 0.72 - 0.77 from step 1400 to the cap, and
# 1200 more such steps reached 0.82). 256 examples a step at half the learning rate took the four capped seeds of
# twenty (0.76 to 0.90 at the cap) to 0.90 - 0.93 in 100 to 600 steps. The cap of this stage is a third of the first
# stage's (800 steps by default), its checks twice as frequent; a seed that reaches the target in the first stage
# never enters it, so its run is unchanged.
WARMUP_LARGE_BATCH_SIZE = 256
WARMUP_LARGE_BATCH_LR_SCALE = 0.5


def _number(rng: random.Random, integer: int) -> str:
    digits = rng.choice((1, 2))
    frac = rng.randrange(1, 10) if digits == 1 else rng.randrange(1, 100)
    text = f"{integer}.{frac:0{digits}d}"
    return text.rstrip("0") if text.endswith("0") and digits == 2 else text


def _held_out(a: str, b: str) -> bool:
    """A fixed tenth of all unordered pairs is held out, so no evaluation prompt is trained on."""
    key = "|".join(sorted((a, b)))
    return sum(ord(c) * (i + 1) for i, c in enumerate(key)) % 10 == 0


def make_rows(n: int, *, held_out: bool, seed: int) -> list[dict[str, str]]:
    """n rows {"prompt", "answer", "a", "b"}; half share the integer part (the 9.11 vs 9.9 trap)."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        i = rng.randrange(0, 10)
        j = i if rng.random() < SAME_INTEGER_SHARE else rng.randrange(0, 10)
        a, b = _number(rng, i), _number(rng, j)
        if float(a) == float(b) or _held_out(a, b) != held_out:
            continue
        rows.append({"prompt": PROMPT.format(a=a, b=b), "answer": a if float(a) > float(b) else b, "a": a, "b": b})
    return rows


def build_tokenizer():
    """A character-level tokenizer with the Hugging Face interface (save_pretrained, decode, pad)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))  # no merges: one token a character
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    tokenizer.padding_side = "left"
    return tokenizer


def build_model(tokenizer, *, seed: int = 0, hidden_size: int = 128, layers: int = 2):
    """A tiny Llama from a config (about 0.3M parameters)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def well_formed_share(
    model,
    tokenizer,
    rows,
    *,
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    seed: int = 0,
    device: str = "cpu",
    batch_size: int = 128,
) -> float:
    """The share of ``rows`` whose answer, sampled as the GRPO phase samples (``temperature``, no top-k / top-p,
    ``max_new_tokens``), is exactly one of the prompt's two numbers (``choice_format``). Its own random generator:
    the run's is left as it was."""
    was_training = model.training
    model.eval()
    ok = 0.0
    with torch.random.fork_rng(devices=[] if device == "cpu" else [torch.device(device)]), torch.no_grad():
        torch.manual_seed(seed)
        for i in range(0, len(rows), batch_size):
            batch = rows[i : i + batch_size]
            enc = tokenizer(
                [r["prompt"] for r in batch], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(device)
            out = model.generate(
                input_ids=enc.input_ids,
                attention_mask=enc.attention_mask,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
            ok += sum(choice_format(None, texts, [r["a"] for r in batch], [r["b"] for r in batch]))
    model.train(was_training)
    return ok / len(rows)


def warmup(
    model,
    tokenizer,
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 2e-3,
    seed: int = 0,
    device: str = "cpu",
    progress: bool = False,
    format_target: float = WARMUP_FORMAT_TARGET,
    check_every: int = WARMUP_CHECK_EVERY,
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    large_batch_steps: int | None = None,
    phase: str = "",
) -> dict[str, float]:
    """Supervised warm-up on the format only: the target is one of the two numbers at random. It ends when what it is
    for is learned: at a check every ``check_every`` steps, the sampled answers (the GRPO phase's sampling:
    ``temperature``, ``max_new_tokens``) of ``WARMUP_CHECK_PROMPTS`` training prompts of its own are well-formed at
    ``format_target``. If ``steps``, the cap, comes first, a second stage of ``WARMUP_LARGE_BATCH_SIZE`` examples a
    step goes on (at ``lr * WARMUP_LARGE_BATCH_LR_SCALE``, a check every ``check_every // 2`` steps) until the target
    or its own cap, ``large_batch_steps`` (default: ``steps // 3``; 0: no second stage); ``phase`` prefixes the
    progress bars' labels. Returns ``{"warmup_steps", "warmup_large_batch_steps", "warmup_well_formed",
    "warmup_seconds"}``: each stage's steps, the rate of the last check (one is made at a cap that falls between
    checks) and the time of both.

    After it the model answers with one of the two numbers but picks either about equally often. In each stage the
    learning rate warms up over the first 5 % of its cap and then decays along a cosine over the cap to a tenth:
    at a constant rate the 50 / 50 targets keep the weights moving, and the digits of the two numbers get mixed.
    """
    if large_batch_steps is None:
        large_batch_steps = steps // 3
    if large_batch_steps < 0:
        raise ValueError(f"large_batch_steps must be >= 0 (0: no second stage), got {large_batch_steps}")
    started = time.time()
    check_rows = make_rows(WARMUP_CHECK_PROMPTS, held_out=False, seed=seed + 3)

    def check() -> float:
        return well_formed_share(
            model,
            tokenizer,
            check_rows,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            seed=seed,
            device=device,
        )

    with progress_bar(
        total=steps, desc=f"{phase}warm-up (format)", unit="step", disable=not progress, file=sys.stderr
    ) as bar:
        first_steps, well_formed = _format_stage(
            model,
            tokenizer,
            rows=make_rows(steps * batch_size, held_out=False, seed=seed + 2),
            target_rng=random.Random(seed + 1),
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            check=check,
            check_every=check_every,
            format_target=format_target,
            device=device,
            bar=bar,
        )
    second_steps = 0
    if not well_formed >= format_target and large_batch_steps > 0:  # the cap came first (NaN: no check ran)
        with progress_bar(
            total=large_batch_steps,
            desc=f"{phase}warm-up (format, large batches)",
            unit="step",
            disable=not progress,
            file=sys.stderr,
        ) as bar:
            second_steps, well_formed = _format_stage(
                model,
                tokenizer,
                rows=make_rows(large_batch_steps * WARMUP_LARGE_BATCH_SIZE, held_out=False, seed=seed + 12),
                target_rng=random.Random(seed + 11),
                steps=large_batch_steps,
                batch_size=WARMUP_LARGE_BATCH_SIZE,
                lr=lr * WARMUP_LARGE_BATCH_LR_SCALE,
                check=check,
                check_every=max(1, check_every // 2) if check_every else 0,
                format_target=format_target,
                device=device,
                bar=bar,
            )
    model.train()
    return {
        "warmup_steps": first_steps,
        "warmup_large_batch_steps": second_steps,
        "warmup_well_formed": well_formed,
        "warmup_seconds": round(time.time() - started, 1),
    }


def _format_stage(
    model,
    tokenizer,
    *,
    rows,
    target_rng: random.Random,
    steps: int,
    batch_size: int,
    lr: float,
    check,
    check_every: int,
    format_target: float,
    device: str,
    bar,
) -> tuple[int, float]:
    """One stage of the warm-up: ``steps`` steps at most of ``batch_size`` of ``rows`` (each one's target drawn
    by ``target_rng``), a fresh AdamW and cosine schedule; ``check()`` every ``check_every`` steps and at the cap.
    Returns (steps run, the last check's rate)."""
    # from transformers.optimization: 4.46 - 4.56 export it only there
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=max(1, steps // 20), num_training_steps=max(1, steps), min_lr_rate=0.1
    )
    well_formed, done = float("nan"), 0
    for step in range(steps):
        model.train()
        batch = rows[step * batch_size : (step + 1) * batch_size]
        texts = [r["prompt"] + target_rng.choice((r["a"], r["b"])) + tokenizer.eos_token for r in batch]
        enc = tokenizer(texts, return_tensors="pt", padding=True).to(device)
        prompt_lens = [len(tokenizer(r["prompt"]).input_ids) for r in batch]
        labels = enc.input_ids.clone()
        pad = enc.attention_mask.shape[1] - enc.attention_mask.sum(1)
        for i, (p, n) in enumerate(zip(prompt_lens, pad.tolist(), strict=True)):
            labels[i, : n + p] = -100  # learn the completion only
        loss = model(
            input_ids=enc.input_ids,
            attention_mask=enc.attention_mask,
            position_ids=left_padded_positions(enc.attention_mask),
            labels=labels,
        ).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        done = step + 1
        bar.update(1)
        if check_every and done % check_every == 0 or done == steps:
            well_formed = check()
            bar.set_postfix(well_formed=f"{well_formed:.2f}")
            if well_formed >= format_target:
                break
    return done, well_formed


def reward_functions():
    """(functions, weights): correctness (1 for the larger number) and format (a number of the prompt)."""
    return [rewards.numeric_match, format_reward()], [1.0, 0.2]


def format_reward():
    """Whether an answer is well-formed (``choice_format``): the trainer logs the malformed share with it."""
    return choice_format


def choice_format(prompts, completions, a, b, **_) -> list[float]:
    """1 if the completion is exactly one of the prompt's two numbers, else 0."""
    return [1.0 if c.strip() in (x, y) else 0.0 for c, x, y in zip(completions, a, b, strict=True)]
