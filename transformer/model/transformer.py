"""The encoder-decoder, its decoding cache, and the factory that builds it from a ModelConfig."""

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .attention import KVCache, MultiHeadAttention
from .config import ModelConfig
from .embedding import Embeddings
from .layers import DecoderLayer, EncoderLayer


@dataclass
class DecoderCache:
    """Per decoder layer: self-attention keys/values so far, and the projected encoder output."""

    self_attn: list[KVCache]
    cross_attn: list[KVCache]

    @classmethod
    def empty(cls, n_layers: int) -> "DecoderCache":
        return cls([KVCache() for _ in range(n_layers)], [KVCache(static=True) for _ in range(n_layers)])

    def __len__(self) -> int:
        """Target tokens decoded so far."""
        return len(self.self_attn[0]) if self.self_attn else 0

    def reorder(self, index: Tensor) -> None:
        for cache in self.self_attn + self.cross_attn:
            cache.reorder(index)


def _run(layer: nn.Module, checkpointed: bool, *args) -> Tensor:
    """A layer's forward; with activation checkpointing (training only) its activations are recomputed in backward."""
    if checkpointed and layer.training and torch.is_grad_enabled():
        return checkpoint(layer, *args, use_reentrant=False)
    return layer(*args)


class Encoder(nn.Module):
    def __init__(self, layers: list[EncoderLayer], final_norm: nn.Module, checkpointed: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = final_norm
        self.checkpointed = checkpointed

    def forward(self, x: Tensor, src_padding: Tensor | None) -> Tensor:
        for layer in self.layers:
            x = _run(layer, self.checkpointed, x, src_padding)
        return self.norm(x)


class Decoder(nn.Module):
    def __init__(self, layers: list[DecoderLayer], final_norm: nn.Module, checkpointed: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = final_norm
        self.checkpointed = checkpointed

    def forward(
        self, x: Tensor, memory: Tensor, src_padding: Tensor | None, cache: DecoderCache | None = None
    ) -> Tensor:
        for i, layer in enumerate(self.layers):
            self_cache, cross_cache = (None, None) if cache is None else (cache.self_attn[i], cache.cross_attn[i])
            x = _run(layer, self.checkpointed and cache is None, x, memory, src_padding, self_cache, cross_cache)
        return self.norm(x)


class EncoderDecoder(nn.Module):
    """src (B, S) and tgt (B, T) token ids -> logits (B, T, V); no softmax (the loss takes logits)."""

    def __init__(self, encoder: Encoder, decoder: Decoder, src_embed: Embeddings, tgt_embed: Embeddings,
                 output: nn.Linear, pad_id: int):  # fmt: skip
        super().__init__()
        self.encoder, self.decoder = encoder, decoder
        self.src_embed, self.tgt_embed = src_embed, tgt_embed
        self.output = output
        self.pad_id = pad_id

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor | None]:
        """Returns memory (B, S, d) and the source padding mask (B, S), True = padding; None when
        nothing is padded, so that attention can use its unmasked kernels."""
        src_padding = src.eq(self.pad_id)
        if not src_padding.any():
            src_padding = None
        return self.encoder(self.src_embed(src), src_padding), src_padding

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        src_padding: Tensor | None,
        cache: DecoderCache | None = None,
        where: Tensor | None = None,
    ) -> Tensor:
        """Logits for each position of tgt, (B, T, V); with a cache, tgt holds only the new tokens. With `where`
        (B, T, bool), logits only at its True positions, (N, V): training needs none at padding."""
        offset = 0 if cache is None else len(cache)
        x = self.decoder(self.tgt_embed(tgt, offset), memory, src_padding, cache)  # (B, T, d)
        return self.output(x if where is None else x[where])

    def forward(self, src: Tensor, tgt: Tensor, where: Tensor | None = None) -> Tensor:
        memory, src_padding = self.encode(src)
        return self.decode(tgt, memory, src_padding, where=where)

    def new_cache(self) -> DecoderCache:
        return DecoderCache.empty(len(self.decoder.layers))


def build_model(cfg: ModelConfig) -> EncoderDecoder:
    learned = cfg.positions == "learned"
    checkpointed = cfg.activation_checkpointing
    src_tokens = nn.Embedding(cfg.src_vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
    tgt_tokens = (
        src_tokens if cfg.share_embeddings else nn.Embedding(cfg.tgt_vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
    )

    def final_norm() -> nn.Module:  # pre-LN stacks end with a LayerNorm; post-LN layers already end with one
        return nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()

    model = EncoderDecoder(
        encoder=Encoder([EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers)], final_norm(), checkpointed),
        decoder=Decoder([DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers)], final_norm(), checkpointed),
        src_embed=Embeddings(src_tokens, cfg.max_positions, learned, cfg.dropout),
        tgt_embed=Embeddings(tgt_tokens, cfg.max_positions, learned, cfg.dropout),
        output=nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=False),
        pad_id=cfg.pad_id,
    )
    _init_weights(model, cfg)
    if cfg.tie_output:
        model.output.weight = model.tgt_embed.tokens.weight
    return model


def _init_weights(model: EncoderDecoder, cfg: ModelConfig) -> None:
    """Xavier-uniform projections with zero biases; embeddings N(0, d^-1/2), so that after the
    sqrt(d) scaling tokens have unit variance and tied output logits start small."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, MultiHeadAttention):
            nn.init.xavier_uniform_(module.in_proj_weight)
            if module.in_proj_bias is not None:
                nn.init.zeros_(module.in_proj_bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=cfg.d_model**-0.5)
            nn.init.zeros_(module.weight[cfg.pad_id])
    for embed in (model.src_embed, model.tgt_embed):
        if isinstance(embed.positions, nn.Parameter):
            nn.init.normal_(embed.positions, std=cfg.d_model**-0.5)
