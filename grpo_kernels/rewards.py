"""Rule-based rewards with TRL's interface: ``f(prompts, completions, **columns) -> list[float | None]``.

``columns`` are the dataset's other fields, one list each (for example ``answer``); a
function returns one score per completion, or None where it cannot score one (the
advantage then ignores it). They can be passed to TRL's GRPOTrainer unchanged.
"""

from __future__ import annotations

import re
from typing import List, Optional, Sequence

_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)$")


def parse_number(text: str) -> Optional[float]:
    """'0.50', '.5', ' 9.9 ' -> float; anything that is not one plain number -> None."""
    text = text.strip().replace(",", "")
    return float(text) if _NUMBER.match(text) else None


def numeric_match(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], *,
                  tolerance: float = 1e-9, **_) -> List[Optional[float]]:
    """1.0 if the completion is the gold number (within ``tolerance``), 0.0 if not; None without gold."""
    scores: List[Optional[float]] = []
    for completion, gold in zip(completions, answer):
        target = parse_number(str(gold)) if gold is not None else None
        if target is None:
            scores.append(None)
            continue
        value = parse_number(completion)
        scores.append(1.0 if value is not None and abs(value - target) <= tolerance * max(1.0, abs(target)) else 0.0)
    return scores
