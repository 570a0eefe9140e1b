"""The built-in task: "Which is bigger? 9.11 or 9.9", and its family of decimal comparisons.

Everything is made here, with no download: the prompts (a train set and a disjoint
held-out set), a character-level Hugging Face tokenizer, a tiny Llama model, a short
supervised warm-up that teaches the answer *format* but not the answer (it is trained on
a randomly chosen one of the two numbers), and the rule-based rewards.
"""

from __future__ import annotations

import random
import sys
from typing import Dict, List

import torch

from .. import rewards
from ..trainer import left_padded_positions

NAME = "compare"
PROMPT = "Which is bigger? {a:<4} or {b:<4}\nAnswer: "  # fixed-width fields: every prompt is 38 characters
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
SAME_INTEGER_SHARE = 1.0  # the 9.11 vs 9.9 trap: the fractional parts decide
CHARACTERS = "0123456789.-/ ?:\nWhichsbgeronwA"
# The warm-up's length in steps of 32 examples: short of it, some seeds' models still mix the digits of the
# two numbers in a tenth to a half of their sampled answers (more steps of fewer examples beat fewer of more)
WARMUP_STEPS = 1200


def _number(rng: random.Random, integer: int) -> str:
    digits = rng.choice((1, 2))
    frac = rng.randrange(1, 10) if digits == 1 else rng.randrange(1, 100)
    text = f"{integer}.{frac:0{digits}d}"
    return text.rstrip("0") if text.endswith("0") and digits == 2 else text


def _held_out(a: str, b: str) -> bool:
    """A fixed tenth of all unordered pairs is held out, so no evaluation prompt is trained on."""
    key = "|".join(sorted((a, b)))
    return sum(ord(c) * (i + 1) for i, c in enumerate(key)) % 10 == 0


def make_rows(n: int, *, held_out: bool, seed: int) -> List[Dict[str, str]]:
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
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                        eos_token="<eos>")
    tokenizer.padding_side = "left"
    return tokenizer


def build_model(tokenizer, *, seed: int = 0, hidden_size: int = 128, layers: int = 2):
    """A tiny Llama from a config (about 0.3M parameters)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def warmup(model, tokenizer, *, steps: int, batch_size: int = 32, lr: float = 2e-3, seed: int = 0,
           device: str = "cpu", progress: bool = False) -> float:
    """Supervised warm-up on the format only: the target is one of the two numbers at random.

    Returns the last batch's loss. After it the model answers with one of the two numbers
    (the format reward is high) but picks either about equally often.

    The learning rate warms up over the first 5 % of the steps and then decays along a cosine to
    a tenth of ``lr``: at a constant rate the 50 / 50 targets keep the weights moving, and greedy
    decoding after 600 steps mixed the digits of the two numbers in about a third of the answers
    (sampling in half of them), which GRPO then had to unlearn before it could learn the choice.
    """
    # from transformers.optimization: 4.46 - 4.56 export it only there
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    rng = random.Random(seed + 1)
    rows = make_rows(steps * batch_size, held_out=False, seed=seed + 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = get_cosine_with_min_lr_schedule_with_warmup(optimizer, num_warmup_steps=max(1, steps // 20),
                                                           num_training_steps=max(1, steps), min_lr_rate=0.1)
    model.train()
    loss = torch.tensor(0.0)
    from tqdm.auto import tqdm

    for step in tqdm(range(steps), desc="warm-up (format)", unit="step", disable=not progress, file=sys.stderr):
        batch = rows[step * batch_size:(step + 1) * batch_size]
        texts = [r["prompt"] + rng.choice((r["a"], r["b"])) + tokenizer.eos_token for r in batch]
        enc = tokenizer(texts, return_tensors="pt", padding=True).to(device)
        prompt_lens = [len(tokenizer(r["prompt"]).input_ids) for r in batch]
        labels = enc.input_ids.clone()
        pad = enc.attention_mask.shape[1] - enc.attention_mask.sum(1)
        for i, (p, n) in enumerate(zip(prompt_lens, pad.tolist())):
            labels[i, : n + p] = -100  # learn the completion only
        loss = model(input_ids=enc.input_ids, attention_mask=enc.attention_mask,
                     position_ids=left_padded_positions(enc.attention_mask), labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    return loss.item()


def reward_functions():
    """(functions, weights): correctness (1 for the larger number) and format (a number of the prompt)."""
    return [rewards.numeric_match, choice_format], [1.0, 0.2]


def choice_format(prompts, completions, a, b, **_) -> List[float]:
    """1 if the completion is exactly one of the prompt's two numbers, else 0."""
    return [1.0 if c.strip() in (x, y) else 0.0 for c, x, y in zip(completions, a, b)]
