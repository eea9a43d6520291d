"""The Transformer in plain PyTorch: no Lightning or Hydra here."""

from .attention import KVCache, MultiHeadAttention
from .config import MODEL_SIZES, ModelConfig, RuntimeConfig, use_deterministic_algorithms
from .layout import SequenceLayout
from .masks import AttentionMask, attention_mask
from .transformer import DecoderCache, EncoderDecoder, build_model

__all__ = [
    "MODEL_SIZES", "AttentionMask", "DecoderCache", "EncoderDecoder", "KVCache", "ModelConfig", "MultiHeadAttention",
    "RuntimeConfig", "SequenceLayout", "attention_mask", "build_model", "use_deterministic_algorithms",
]  # fmt: skip
