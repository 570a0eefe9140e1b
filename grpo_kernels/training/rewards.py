"""Rule-based rewards (verifiable rewards) with TRL's interface.

Every function here is ``f(prompts, completions, **columns) -> list[float | None]``:
``columns`` are the dataset's other fields, one list each (for example ``answer``); the
function returns one score per completion, or None where it cannot score one (the
advantage then ignores it, as TRL does). They can be passed to TRL's GRPOTrainer unchanged.

- ``numeric_match``: the completion is the gold number (relative tolerance; "0.50", ".5",
  "1,000", "$3", "-3." and "1/2" or "\\frac{1}{2}" are read as numbers).
- ``boxed_match``: the last ``\\boxed{...}`` of the completion, compared numerically when
  both sides are numbers, else as normalized text.
- ``format_reward``: the completion matches a regular expression (default: one number).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)$")
_FORMAT_ONE_NUMBER = r"^\s*[+-]?(\d+\.?\d*|\.\d+)\s*$"


def parse_number(text: str) -> float | None:
    """'0.50', '.5', ' 9.9 ', '1,000', '$3' -> float; anything that is not one plain number -> None."""
    text = text.strip().replace(",", "").lstrip("$")
    return float(text) if _NUMBER.match(text) else None


def extract_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in ``text``, with nested braces; None if there is none."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced braces: no answer


def _normalize_text(text: str) -> str:
    text = re.sub(r"\\(text|mathrm|textbf)\{([^}]*)\}", r"\2", text)
    text = text.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("$", "")
    text = text.replace("dfrac", "frac").replace("tfrac", "frac")
    return re.sub(r"\s+", "", text).rstrip(".").lower()


def _fraction(text: str) -> float | None:
    m = re.fullmatch(r"\\frac\{([^{}]+)\}\{([^{}]+)\}|([+-]?\d+)/(\d+)", text)
    if not m:
        return None
    num, den = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
    a, b = parse_number(num), parse_number(den)
    return None if a is None or b in (None, 0.0) else a / b


def _as_number(text: str) -> float | None:
    value = parse_number(text)
    return value if value is not None else _fraction(_normalize_text(text))


def _same(answer: str, gold: str, tolerance: float) -> bool:
    a, g = _as_number(answer), _as_number(gold)
    if a is not None and g is not None:
        return abs(a - g) <= tolerance * max(1.0, abs(g))
    return _normalize_text(answer) == _normalize_text(gold)


def numeric_match(
    prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], *, tolerance: float = 1e-9, **_
) -> list[float | None]:
    """1.0 if the completion is the gold number (relative ``tolerance``), 0.0 if not; None without gold."""
    scores: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        target = None if gold is None else _as_number(str(gold))
        if target is None:
            scores.append(None)
            continue
        value = _as_number(completion.strip())
        scores.append(1.0 if value is not None and abs(value - target) <= tolerance * max(1.0, abs(target)) else 0.0)
    return scores


def boxed_match(
    prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], *, tolerance: float = 1e-9, **_
) -> list[float | None]:
    """1.0 if the last \\boxed{} answer equals the gold answer (numbers, fractions or text), 0.0 if
    not or if there is no boxed answer; None without gold."""
    scores: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        if gold is None:
            scores.append(None)
            continue
        gold_text = extract_boxed(str(gold)) or str(gold)
        boxed = extract_boxed(completion)
        scores.append(1.0 if boxed is not None and _same(boxed, gold_text, tolerance) else 0.0)
    return scores


def format_reward(
    prompts: Sequence[str], completions: Sequence[str], *, pattern: str = _FORMAT_ONE_NUMBER, **_
) -> list[float]:
    """1.0 if the whole completion matches ``pattern`` (default: one plain number), else 0.0."""
    regex = re.compile(pattern, re.S)
    return [1.0 if regex.fullmatch(c) else 0.0 for c in completions]
