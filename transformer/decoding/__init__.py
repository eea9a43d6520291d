"""Decoding a trained EncoderDecoder into target token ids, in plain PyTorch (no Lightning or Hydra)."""

from .beam import Hypothesis, beam_search
from .ensemble import Ensemble
from .greedy import greedy_search
from .sampling import sampled_token
from .source import MAX_LEN_A, MAX_LEN_B

__all__ = ["MAX_LEN_A", "MAX_LEN_B", "Ensemble", "Hypothesis", "beam_search", "greedy_search", "sampled_token"]
