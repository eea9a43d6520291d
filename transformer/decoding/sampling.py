"""Sampling instead of searching (Edunov et al. 2018's back-translation sources): a next-token rule for
greedy_search that draws each token from the model's distribution, cut to its k most likely and sharpened or
flattened by a temperature, from a seeded generator."""

from collections.abc import Callable

import torch
from torch import Tensor


def sampled_token(topk: int, temperature: float, generator: torch.Generator,
                  never: tuple[int, ...] = ()) -> Callable[[Tensor], Tensor]:  # fmt: skip
    """logits (n, V) -> a token per row (n,), drawn from softmax(logits / temperature) over the row's `topk` most
    likely tokens (topk=-1: over all of them), never one of `never` (a translator's: the byte pieces, which drawn one at
    a time decode to U+FFFD; pad and BOS, which no translation holds, greedy_search's `barred` already excludes)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive")

    never_ids = torch.tensor(never, dtype=torch.long)  # moved to the logits' device once, not every step

    def draw(logits: Tensor) -> Tensor:
        nonlocal never_ids
        scaled = logits.float() / temperature  # (n, V)
        if never:
            never_ids = never_ids.to(scaled.device)
            scaled.index_fill_(1, never_ids, float("-inf"))
        if topk > 0:
            values, tokens = scaled.topk(min(topk, scaled.size(-1)), dim=-1)  # (n, k) each
            picked = torch.multinomial(torch.softmax(values, dim=-1), 1, generator=generator)  # (n, 1)
            return tokens.gather(1, picked).squeeze(1)  # (n,)
        return torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator).squeeze(1)  # (n,)

    return draw
