"""The encoder-decoder, its decoding cache, and the factory that builds it from a ModelConfig."""

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .attention import KVCache
from .config import ModelConfig, RuntimeConfig
from .embedding import Embeddings
from .layers import DecoderLayer, EncoderLayer
from .layout import SequenceLayout
from .masks import AttentionMask, attention_mask, causal, key_padding


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
        """Keep rows `index` of every cache: one target row per source row (greedy search)."""
        self.reorder_targets(index)
        self.select_sources(index)

    def reorder_targets(self, index: Tensor) -> None:
        """Keep target rows `index` of the self-attention caches (beam search: the surviving hypotheses); the
        cross-attention caches hold one row per source, shared by its beams."""
        for cache in self.self_attn:
            cache.reorder(index)

    def select_sources(self, index: Tensor) -> None:
        """Keep source rows `index` of the cross-attention caches (sentences still decoding)."""
        for cache in self.cross_attn:
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

    def forward(self, x: Tensor, mask: AttentionMask) -> Tensor:
        for layer in self.layers:
            x = _run(layer, self.checkpointed, x, mask)
        return self.norm(x)


class Decoder(nn.Module):
    def __init__(self, layers: list[DecoderLayer], final_norm: nn.Module, checkpointed: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = final_norm
        self.checkpointed = checkpointed

    def forward(self, x: Tensor, memory: Tensor, self_mask: AttentionMask, cross_mask: AttentionMask,
                cache: DecoderCache | None = None) -> Tensor:  # fmt: skip
        for i, layer in enumerate(self.layers):
            self_cache, cross_cache = (None, None) if cache is None else (cache.self_attn[i], cache.cross_attn[i])
            x = _run(layer, self.checkpointed and cache is None, x, memory, self_mask, cross_mask, self_cache,
                     cross_cache)  # fmt: skip
        return self.norm(x)


class EncoderDecoder(nn.Module):
    """src (B, S) and tgt (B, T) token ids -> logits (B, T, V); no softmax (the loss takes logits).

    What the source padding means (a SequenceLayout) is worked out once per batch, and from it each kind of attention
    gets its mask once (encoder self-attention, cross-attention; the decoder's is causal), shared by all layers.
    """

    def __init__(self, encoder: Encoder, decoder: Decoder, src_embed: Embeddings, tgt_embed: Embeddings,
                 output: nn.Linear, pad_id: int, window: int | None = None, padding_free: bool = False):  # fmt: skip
        super().__init__()
        self.encoder, self.decoder = encoder, decoder
        self.src_embed, self.tgt_embed = src_embed, tgt_embed
        self.output = output
        self.pad_id, self.window, self.padding_free = pad_id, window, padding_free

    @property
    def tgt_vocab_size(self) -> int:
        return self.output.out_features

    @property
    def max_target_positions(self) -> int:
        return self.tgt_embed.max_positions

    def source_layout(self, src: Tensor) -> SequenceLayout:
        """The layout of source ids (B, S), padding where they are pad_id: one sync, for its host facts."""
        return SequenceLayout.of(src, self.pad_id, packed=self.padding_free)

    def encode(self, src: Tensor, src_layout: SequenceLayout | None = None) -> tuple[Tensor, SequenceLayout]:
        """Returns memory (B, S, d) and the source's layout, which decode takes (`layout[rows]` selects rows).
        Training passes the collator's layout (SequenceLayout.right_padded), so that nothing waits on the device."""
        layout = self.source_layout(src) if src_layout is None else src_layout
        if self.window is None:
            mask = key_padding(layout, self_attention=True)
        else:  # each query's window of keys, less padding: padded queries far from any real key have none
            B, S = src.shape
            mask = attention_mask(layout.padding, None, batch=B, heads=1, q_len=S, k_len=S, window=self.window,
                                  device=src.device, every_query_has_a_key=not layout.padded)  # fmt: skip
        return self.encoder(self.src_embed(src), mask), layout

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        src_layout: SequenceLayout,
        cache: DecoderCache | None = None,
        where: Tensor | None = None,
    ) -> Tensor:
        """Logits for each position of tgt, (B, T, V); with a cache, tgt holds only the new tokens. memory (and
        src_layout) may hold one row per g consecutive rows of tgt (beam search: a sentence's g beams). With `where`,
        logits only at its True positions, (N, V): training needs none at padding. `where` is a (B, T) bool mask, or
        the (N,) flat positions b * T + t of its True entries, which select without a sync."""
        offset = 0 if cache is None else len(cache)
        T = tgt.size(1)
        self_mask = causal(T, offset + T, self.window, tgt.device)
        cross_mask = key_padding(src_layout)  # packs where the layout does: decoding steps too, for GPU flash
        x = self.decoder(self.tgt_embed(tgt, offset), memory, self_mask, cross_mask, cache)  # (B, T, d)
        if where is not None:
            x = x[where] if where.dtype == torch.bool else x.flatten(0, 1).index_select(0, where)  # (N, d)
        return self.output(x)

    def forward(self, src: Tensor, tgt: Tensor, where: Tensor | None = None,
                src_layout: SequenceLayout | None = None) -> Tensor:  # fmt: skip
        memory, layout = self.encode(src, src_layout)
        return self.decode(tgt, memory, layout, where=where)

    def new_cache(self) -> DecoderCache:
        return DecoderCache.empty(len(self.decoder.layers))


def build_model(cfg: ModelConfig, runtime: RuntimeConfig | None = None) -> EncoderDecoder:
    """The model `cfg` describes, run as `runtime` says (default RuntimeConfig())."""
    runtime = runtime or RuntimeConfig()
    learned = cfg.positions == "learned"
    checkpointed = runtime.activation_checkpointing
    src_tokens = nn.Embedding(cfg.src_vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
    tgt_tokens = (
        src_tokens if cfg.share_embeddings else nn.Embedding(cfg.tgt_vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
    )

    def final_norm() -> nn.Module:  # pre-LN stacks end with a LayerNorm; post-LN layers already end with one
        return nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()

    model = EncoderDecoder(
        encoder=Encoder([EncoderLayer(cfg, runtime) for _ in range(cfg.n_encoder_layers)], final_norm(), checkpointed),
        decoder=Decoder([DecoderLayer(cfg, runtime) for _ in range(cfg.n_decoder_layers)], final_norm(), checkpointed),
        src_embed=Embeddings(src_tokens, cfg.max_positions, learned, cfg.dropout, cfg.token_dropout),
        tgt_embed=Embeddings(tgt_tokens, cfg.max_positions, learned, cfg.dropout, cfg.token_dropout),
        output=nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=False),
        pad_id=cfg.pad_id,
        window=cfg.window,
        padding_free=runtime.padding_free_attention,
    )
    _init_weights(model, cfg)
    if cfg.tie_output:
        model.output.weight = model.tgt_embed.tokens.weight
    return model


def _init_weights(model: EncoderDecoder, cfg: ModelConfig) -> None:
    """Xavier-uniform projections with zero biases (attention in-projections are so already, from
    MultiHeadAttention); embeddings N(0, d^-1/2), so that after the sqrt(d) scaling tokens have unit variance and tied
    output logits start small."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=cfg.d_model**-0.5)
            nn.init.zeros_(module.weight[cfg.pad_id])
    for embed in (model.src_embed, model.tgt_embed):
        if isinstance(embed.positions, nn.Parameter):
            nn.init.normal_(embed.positions, std=cfg.d_model**-0.5)
