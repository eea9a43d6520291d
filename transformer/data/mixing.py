"""Several corpora in one epoch: each corpus's share by weight or by temperature over sizes, drawn afresh each epoch.

A corpus whose share is above its size repeats (whole copies, then a random part), one below it gives a random
subset; both differ from epoch to epoch and are a pure function of the sampler's (seed, epoch) generator.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def mixture_shares(sizes: Sequence[int], weights: Sequence[float], temperature: float | None) -> np.ndarray:
    """Each corpus's probability: weight / sum of weights, or with a temperature T, ~ weight x size^(1/T)."""
    w = np.asarray(weights, dtype=np.float64)
    if temperature is not None:
        w = w * np.asarray(sizes, dtype=np.float64) ** (1.0 / temperature)
    return w / w.sum()


@dataclass(frozen=True)
class Mixture:
    """Corpora laid end to end (corpus c's pairs are indices offsets[c] .. offsets[c] + sizes[c] - 1)."""

    sizes: tuple[int, ...]
    shares: tuple[float, ...]
    epoch_pairs: int

    @classmethod
    def of(cls, sizes: Sequence[int], weights: Sequence[float], temperature: float | None,
           epoch_pairs: int | None) -> "Mixture":  # fmt: skip
        shares = mixture_shares(sizes, weights, temperature)
        return cls(tuple(int(n) for n in sizes), tuple(float(s) for s in shares), epoch_pairs or int(sum(sizes)))

    def counts(self) -> np.ndarray:
        """Pairs drawn from each corpus per epoch (largest remainders, so that they sum to epoch_pairs)."""
        exact = np.asarray(self.shares) * self.epoch_pairs
        counts = np.floor(exact).astype(np.int64)
        counts[np.argsort(counts - exact)[: self.epoch_pairs - counts.sum()]] += 1
        return np.where(np.asarray(self.sizes) > 0, counts, 0)

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        """One epoch's example indices, corpus by corpus (the sampler shuffles them)."""
        offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        parts = []
        for n, k, offset in zip(self.sizes, self.counts(), offsets):
            if n:
                whole, rest = divmod(int(k), n)
                parts += [offset + np.arange(n)] * whole
                if rest:  # only then is the generator drawn from: one corpus taken whole shuffles as without a mix
                    parts.append(offset + rng.permutation(n)[:rest])
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)
