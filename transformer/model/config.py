"""What the model is (ModelConfig, saved in a checkpoint's hyperparameters) and how it runs (RuntimeConfig, chosen
anew by every training, evaluation or translation): plain numbers and strings."""

import os
from dataclasses import dataclass, fields

import torch

from ..base.typecheck import check_field_types
from .kernels.backends import SDPA_BACKENDS

ACTIVATIONS = ("relu", "gelu", "swish")
POSITIONS = ("sinusoidal", "sinusoidal_concat", "learned")

# Named sizes; any field can still be overridden. base is the paper's, big its big model.
MODEL_SIZES = {
    "tiny": dict(d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2),
    "small": dict(d_model=256, n_heads=4, d_ff=1024, n_encoder_layers=3, n_decoder_layers=3),
    "base": dict(d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=6, n_decoder_layers=6),
    "big": dict(d_model=1024, n_heads=16, d_ff=4096, n_encoder_layers=6, n_decoder_layers=6, dropout=0.3),
    # a distillation student: small's width, 6 encoder layers (run once per sentence), 1 decoder layer (per token)
    "deep_shallow": dict(d_model=256, n_heads=4, d_ff=1024, n_encoder_layers=6, n_decoder_layers=1),
}


@dataclass(frozen=True)
class ModelConfig:
    src_vocab_size: int
    tgt_vocab_size: int
    pad_id: int
    d_model: int = 256  # width of the embeddings and of every layer's output
    n_heads: int = 4  # attention heads; d_model must divide by it
    d_ff: int = 1024  # the feed-forward block's inner width
    n_encoder_layers: int = 3  # encoder layers
    n_decoder_layers: int = 3  # decoder layers
    dropout: float = 0.1  # embeddings and residual branches
    attention_dropout: float = 0.0  # attention probabilities
    activation_dropout: float = 0.0  # inside the feed-forward block
    token_dropout: float = 0.0  # whole input tokens' embeddings, source and target (word dropout)
    activation: str = "relu"  # the feed-forward activation: relu, gelu or swish (x * sigmoid(x), Marian's)
    norm_first: bool = True  # pre-LayerNorm; False is the 2017 paper's post-LayerNorm
    # position embeddings: sinusoidal (the paper's, sines and cosines interleaved), sinusoidal_concat (the same
    # waves, all sines then all cosines: Marian's), or learned
    positions: str = "sinusoidal"
    max_positions: int = 1024  # the longest sequence the position table covers
    share_embeddings: bool = True  # one table for source and target tokens (joint vocabulary)
    tie_output: bool = True  # output projection = target embedding table
    output_bias: bool = False  # a bias on the output projection (Marian's final_logits_bias)
    window: int | None = None  # self-attention sees keys within this many positions

    def __post_init__(self):
        check_field_types(self, "model")
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; change one of them")
        for name, value, choices in (
            ("activation", self.activation, ACTIVATIONS),
            ("positions", self.positions, POSITIONS),
        ):
            if value not in choices:
                raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                f"share_embeddings needs one vocabulary, got src_vocab_size={self.src_vocab_size} and "
                f"tgt_vocab_size={self.tgt_vocab_size}; set share_embeddings=false or train a joint vocabulary"
            )
        for name in ("src_vocab_size", "tgt_vocab_size"):
            if not 0 <= self.pad_id < getattr(self, name):
                raise ValueError(f"pad_id={self.pad_id} is outside {name}={getattr(self, name)}")

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        """A checkpoint's saved model hyperparameters; those written before RuntimeConfig existed also hold its
        fields, which say nothing about the architecture and are dropped."""
        return cls(**{k: v for k, v in values.items() if k not in RUNTIME_FIELDS})

    @classmethod
    def from_size(cls, size: str, **overrides) -> "ModelConfig":
        """A named size (tiny, small, base, big) with any field overridden."""
        if size not in MODEL_SIZES:
            raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(MODEL_SIZES)}")
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown model config field(s) {', '.join(sorted(unknown))}")
        return cls(**{**MODEL_SIZES[size], **overrides})

    @classmethod
    def from_choice(cls, model: dict, **vocabulary: int) -> "ModelConfig":
        """The `model:` config group's choice: its `size` (small if none) with every non-null field over it."""
        overrides = {k: v for k, v in model.items() if k != "size" and v is not None}  # null: the size's value
        return cls.from_size(model.get("size", "small"), **overrides, **vocabulary)


@dataclass(frozen=True)
class RuntimeConfig:
    """How the model runs, not what it is: outputs are the same either way (to rounding), so any choice loads any
    checkpoint, and a model trained with one backend decodes with another."""

    attention_backend: str = "auto"  # SDPA kernel: auto, flash, efficient, cudnn, math
    padding_free_attention: bool = False  # encoder and cross attention over real tokens only (nested jagged SDPA)
    activation_checkpointing: bool = False  # training recomputes each layer's activations in backward: less memory
    deterministic: bool = False  # deterministic kernels (use_deterministic_algorithms): a GPU resumes exactly, slower

    def __post_init__(self):
        check_field_types(self, "runtime")
        if self.attention_backend not in SDPA_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} is not one of {', '.join(SDPA_BACKENDS)}")


RUNTIME_FIELDS = frozenset(f.name for f in fields(RuntimeConfig))


def use_deterministic_algorithms() -> None:
    """What runtime.deterministic does before anything runs, as Lightning's Trainer(deterministic=True) does:
    PyTorch's deterministic algorithms (index_select's and flash and efficient attention's backward among them; cuDNN's
    attention is passed over), cuBLAS's fixed workspace (read when it starts), no cuDNN autotuning."""
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
