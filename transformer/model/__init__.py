"""The Transformer in plain PyTorch: no Lightning or Hydra here."""

from .attention import KVCache, MultiHeadAttention, attention_mask
from .config import MODEL_SIZES, ModelConfig
from .transformer import DecoderCache, EncoderDecoder, build_model

__all__ = [
    "MODEL_SIZES", "DecoderCache", "EncoderDecoder", "KVCache", "ModelConfig", "MultiHeadAttention",
    "attention_mask", "build_model",
]  # fmt: skip
