"""The adaptive entropy controller (TRL's ``use_adaptive_entropy`` rule), outside the kernels.

The loss takes a coefficient (``entropy_coef``); this decides it between optimizer steps. Every
micro-batch of an accumulation window adds its entropy sum and token count; at the window's
end the totals are summed over the processes, and the coefficient moves by ``delta`` within
[``coef_min``, ``coef_max``]: up when the window-global mean entropy is at or below ``target``,
down when above. The coefficient applied in a window is the one set at the end of the previous
window, and only while that window's entropy was at or below the target (0 otherwise), so every
micro-batch of a window applies the same bonus. The state is two numbers, checkpointed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch


@dataclasses.dataclass
class AdaptiveEntropy:
    """TRL 1.16's controller: ``coef`` starts at ``entropy_coef``; the other fields are its config names."""

    coef: float
    target: float = 0.2  # entropy_target
    coef_min: float = 0.0  # entropy_coef_min
    coef_max: float = 1.0  # entropy_coef_max
    delta: float = 0.005  # entropy_coef_delta
    last_world_entropy: float = math.inf
    _window: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("coef", "target", "coef_min", "coef_max", "delta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"AdaptiveEntropy.{name} must be a finite number, got {value!r}")
        if not self.coef_min <= self.coef_max or self.delta < 0:
            raise ValueError(
                f"AdaptiveEntropy needs coef_min <= coef_max and delta >= 0, got {self.coef_min}, "
                f"{self.coef_max}, {self.delta}"
            )

    def applied_coef(self) -> float:
        """The coefficient for this window's micro-batches: gated off while the last window's entropy
        was above the target (the first window, with no measurement, is gated off as in TRL)."""
        return self.coef if self.last_world_entropy <= self.target else 0.0

    def observe(self, entropy_sum: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add one micro-batch: the entropy summed over the tokens the bonus acts on, and their count."""
        stats = torch.stack([entropy_sum.detach().reshape(()).float(), tokens.detach().reshape(()).float()])
        self._window = stats if self._window is None else self._window + stats

    def end_window(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
        """At an optimizer-step boundary: the window-global mean entropy (its totals summed over the
        processes by ``reduce_sum``), the coefficient moved for the next window. Returns that entropy."""
        if self._window is None:
            raise RuntimeError("AdaptiveEntropy.end_window() before any observe(): no entropy in the window")
        totals = self._window if reduce_sum is None else reduce_sum(self._window)
        world_entropy = float(totals[0] / totals[1].clamp(min=1.0))
        if world_entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_world_entropy = world_entropy
        self._window = None
        return world_entropy

    def state_dict(self) -> dict[str, float]:
        """TRL's checkpointed state (its ``entropy_ctrl_state.json`` keys)."""
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_world_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["entropy_coef"])
        self.last_world_entropy = float(state["last_world_entropy"])
        self._window = None
