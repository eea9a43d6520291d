"""Keys and values kept between decoding steps."""

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class KVCache:
    """Projected keys and values so far, each (B, nh, S, hs).

    By default each step's keys and values are appended (self-attention). A static cache (cross-attention) is
    filled from the encoder output on the first step and reused after. Appending by concatenation and reordering
    by index_select, contiguous, measured faster on CPU than writing into preallocated buffers (whose strided
    views slow attention and the reorder's copy).
    """

    static: bool = False
    k: Tensor | None = None
    v: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.size(2)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values so far with these new ones (B, nh, L, hs) after them; static: these alone."""
        if self.k is not None and not self.static:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)  # (B, nh, S + L, hs)
        self.k, self.v = k, v
        return k, v

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index` (beam search: the surviving hypotheses)."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)
