"""Decoding a trained EncoderDecoder into target token ids, in plain PyTorch (no Lightning or Hydra)."""

from .greedy import greedy_search

__all__ = ["greedy_search"]
