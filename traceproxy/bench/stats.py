"""Bounded sample sets and order statistics for the benchmark."""

from __future__ import annotations

import math
import random
import statistics


class Samples:
    """At most ``cap`` values, by reservoir sampling once full, so memory stays bounded."""

    __slots__ = ("cap", "values", "seen", "_rng")

    def __init__(self, cap: int = 100_000, seed: int = 1) -> None:
        self.cap = cap
        self.values: list[float] = []
        self.seen = 0
        self._rng = random.Random(seed)

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.values) < self.cap:
            self.values.append(value)
            return
        slot = self._rng.randrange(self.seen)
        if slot < self.cap:
            self.values[slot] = value

    def export(self, digits: int = 7) -> list[float]:
        return [round(v, digits) for v in self.values]


def percentile(values: list[float], pct: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def merge_lists(parts: list[list[float]], cap: int = 400_000, seed: int = 7) -> list[float]:
    """Concatenate per-process sample lists, thinned uniformly if over ``cap``."""
    merged = [v for part in parts for v in part]
    if len(merged) <= cap:
        return merged
    return random.Random(seed).sample(merged, cap)
