"""Decoding a trained EncoderDecoder into target token ids, in plain PyTorch (no Lightning or Hydra)."""

from .beam import Hypothesis, beam_search
from .greedy import greedy_search

__all__ = ["Hypothesis", "beam_search", "greedy_search"]
