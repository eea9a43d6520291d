"""Encoder and decoder layers: attention and feed-forward blocks inside residual connections."""

from collections.abc import Callable

from torch import Tensor, nn

from .activation import ReLU
from .attention import KVCache, MultiHeadAttention
from .config import ModelConfig, RuntimeConfig
from .dropout import Dropout
from .masks import AttentionMask


class Residual(nn.Module):
    """x + dropout(f(norm(x))) with pre-LayerNorm, or norm(x + dropout(f(x))) with post-LayerNorm."""

    def __init__(self, d_model: int, dropout: float, norm_first: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.activation = {"relu": ReLU, "gelu": nn.GELU, "swish": nn.SiLU}[cfg.activation]()
        self.dropout = Dropout(cfg.activation_dropout)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(self.activation(self.fc1(x))))


def _attention(cfg: ModelConfig, runtime: RuntimeConfig | None, window: int | None) -> MultiHeadAttention:
    runtime = runtime or RuntimeConfig()
    return MultiHeadAttention(
        cfg.d_model, cfg.n_heads, dropout=cfg.attention_dropout, window=window, backend=runtime.attention_backend,
        padding_free=runtime.padding_free_attention,
    )  # fmt: skip


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, runtime: RuntimeConfig | None = None):
        super().__init__()
        self.self_attn = _attention(cfg, runtime, cfg.window)
        self.ff = FeedForward(cfg)
        self.attn_block = Residual(cfg.d_model, cfg.dropout, cfg.norm_first)
        self.ff_block = Residual(cfg.d_model, cfg.dropout, cfg.norm_first)

    def forward(self, x: Tensor, mask: AttentionMask) -> Tensor:
        x = self.attn_block(x, lambda h: self.self_attn(h, h, h, mask=mask)[0])
        return self.ff_block(x, self.ff)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, runtime: RuntimeConfig | None = None):
        super().__init__()
        self.self_attn = _attention(cfg, runtime, cfg.window)
        self.cross_attn = _attention(cfg, runtime, None)
        self.ff = FeedForward(cfg)
        self.self_attn_block = Residual(cfg.d_model, cfg.dropout, cfg.norm_first)
        self.cross_attn_block = Residual(cfg.d_model, cfg.dropout, cfg.norm_first)
        self.ff_block = Residual(cfg.d_model, cfg.dropout, cfg.norm_first)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        self_mask: AttentionMask,
        cross_mask: AttentionMask,
        self_cache: KVCache | None = None,
        cross_cache: KVCache | None = None,
    ) -> Tensor:
        """self_mask: causal over the targets (masks.causal); cross_mask: the source padding (masks.key_padding)."""
        x = self.self_attn_block(x, lambda h: self.self_attn(h, h, h, mask=self_mask, cache=self_cache)[0])
        x = self.cross_attn_block(
            x, lambda h: self.cross_attn(h, memory, memory, mask=cross_mask, cache=cross_cache)[0]
        )
        return self.ff_block(x, self.ff)
