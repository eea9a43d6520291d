"""The encoder-decoder, its decoding cache, and the factory that builds it from a ModelConfig."""

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .attention import KVCache
from .casting import cast_once, compute_dtype
from .config import ModelConfig, RuntimeConfig
from .cross_entropy import linear_cross_entropy
from .embedding import Embeddings
from .kernels.backends import sdpa_backend
from .layers import DecoderLayer, EncoderLayer
from .layout import SequenceLayout
from .masks import AttentionMask, attention_mask, causal, future_table, key_padding


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


def _run(layer: nn.Module, checkpointed: bool, kernels: Callable[[], AbstractContextManager], *args) -> Tensor:
    """A layer's forward; with activation checkpointing (training only) its activations are recomputed in backward,
    inside `kernels` (the forward's kernel order, which backward has left) so that they are computed alike. A compiled
    graph has its kernels fixed already, and dynamo takes no such context."""
    if checkpointed and layer.training and torch.is_grad_enabled():
        if torch.compiler.is_compiling():
            return checkpoint(layer, *args, use_reentrant=False)
        return checkpoint(layer, *args, use_reentrant=False, context_fn=lambda: (nullcontext(), kernels()))
    return layer(*args)


class Encoder(nn.Module):
    def __init__(self, layers: list[EncoderLayer], final_norm: nn.Module, checkpointed: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = final_norm
        self.checkpointed = checkpointed

    def forward(self, x: Tensor, mask: AttentionMask, kernels: Callable[[], AbstractContextManager]) -> Tensor:
        for layer in self.layers:
            x = _run(layer, self.checkpointed, kernels, x, mask)
        return self.norm(x)


class Decoder(nn.Module):
    def __init__(self, layers: list[DecoderLayer], final_norm: nn.Module, checkpointed: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = final_norm
        self.checkpointed = checkpointed

    def forward(self, x: Tensor, memory: Tensor, self_mask: AttentionMask, cross_mask: AttentionMask,
                kernels: Callable[[], AbstractContextManager], cache: DecoderCache | None = None) -> Tensor:  # fmt: skip
        if cache is None or not len(cache.cross_attn[0]):  # every layer projects memory: cast it once, not per layer
            memory = cast_once(memory)
        for i, layer in enumerate(self.layers):
            self_cache, cross_cache = (None, None) if cache is None else (cache.self_attn[i], cache.cross_attn[i])
            x = _run(layer, self.checkpointed and cache is None, kernels, x, memory, self_mask, cross_mask,
                     self_cache, cross_cache)  # fmt: skip
        return self.norm(x)


class EncoderDecoder(nn.Module):
    """src (B, S) and tgt (B, T) token ids -> logits (B, T, V); no softmax (the loss takes logits).

    What the source padding means (a SequenceLayout) is worked out once per batch, and from it each kind of attention
    gets its mask once (encoder self-attention, cross-attention; the decoder's is causal), shared by all layers, in
    the dtype attention computes in. The attention kernels' order (`backend`) is set once around the encoder and
    once around the decoder, not around every attention call.
    """

    def __init__(self, encoder: Encoder, decoder: Decoder, src_embed: Embeddings, tgt_embed: Embeddings,
                 output: nn.Linear, pad_id: int, window: int | None = None, padding_free: bool = False,
                 backend: str = "auto"):  # fmt: skip
        super().__init__()
        self.encoder, self.decoder = encoder, decoder
        self.src_embed, self.tgt_embed = src_embed, tgt_embed
        self.output = output
        self.pad_id, self.window, self.padding_free, self.backend = pad_id, window, padding_free, backend
        # causal masks are views of it (not saved: rebuilt with the model)
        self.register_buffer("future", future_table(tgt_embed.max_positions), persistent=False)

    def __getstate__(self) -> dict:
        """A copy or pickle leaves out compile_dynamic's compiled loss, bound to this model (as nn.Module leaves out
        its compiled forward): the copy's loss is its own, eager."""
        state = super().__getstate__()
        state.pop("loss", None)
        return state

    def init_buffers(self) -> None:
        """The buffers no checkpoint holds (the causal mask table, sinusoidal positions), computed: after a build on
        the meta device, which computes nothing."""
        self.future = future_table(self.tgt_embed.max_positions)
        for embed in (self.src_embed, self.tgt_embed):
            embed.init_buffers()

    def _kernels(self, device_type: str) -> Callable[[], AbstractContextManager]:
        return lambda: sdpa_backend(self.backend, device_type)

    def _attention_dtype(self, device_type: str) -> torch.dtype:
        return compute_dtype(device_type, self.output.weight.dtype)

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
        return self._encode(src, self._encoder_mask(layout, src)), layout

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
        # packs where the layout does: decoding steps too, for GPU flash
        cross_mask = key_padding(src_layout, dtype=self._attention_dtype(tgt.device.type))
        return self.output(self._decoder_states(tgt, memory, cross_mask, cache, where))

    def forward(self, src: Tensor, tgt: Tensor, where: Tensor | None = None,
                src_layout: SequenceLayout | None = None) -> Tensor:  # fmt: skip
        """Logits (B, T, V), or (N, V) at `where` (decode's)."""
        return self.output(self._pair_states(src, tgt, where, src_layout))

    def loss(self, src: Tensor, tgt: Tensor, labels: Tensor, where: Tensor | None = None,
             src_layout: SequenceLayout | None = None, label_smoothing: float = 0.0,
             rdrop_alpha: float | None = None) -> Tensor:  # fmt: skip
        """The label-smoothed cross-entropy summed over the labelled rows: `labels` has one entry per row of forward's
        logits, pad_id where a row has none. The output layer and the loss are one piece (linear_cross_entropy), so
        that no (N, V) logits are kept; compile_dynamic compiles this method, the training step's graph. With
        rdrop_alpha, src and tgt hold a batch twice (two dropout masks, one pass), `where` picks the same rows of
        each copy, and labels has one entry per pair of rows: R-Drop's loss."""
        x = self._pair_states(src, tgt, where, src_layout)
        return linear_cross_entropy(x.flatten(0, -2), self.output.weight, labels, label_smoothing, self.pad_id,
                                    self.output.bias, rdrop_alpha)  # fmt: skip

    def _pair_states(self, src: Tensor, tgt: Tensor, where: Tensor | None,
                     src_layout: SequenceLayout | None) -> Tensor:  # fmt: skip
        """The decoder's output states for a whole source and target, (B, T, d) or (N, d) at `where`. Unlike
        encode and decode, the encoder's padding mask serves cross-attention too."""
        layout = self.source_layout(src) if src_layout is None else src_layout
        mask = self._encoder_mask(layout, src)
        memory = self._encode(src, mask)
        if self.window is None:
            cross_mask = replace(mask, queries=None)  # the same keys, queries not packed
        else:
            cross_mask = key_padding(layout, dtype=self._attention_dtype(src.device.type))
        return self._decoder_states(tgt, memory, cross_mask, where=where)

    def _encoder_mask(self, layout: SequenceLayout, src: Tensor) -> AttentionMask:
        if self.window is None:
            return key_padding(layout, self_attention=True, dtype=self._attention_dtype(src.device.type))
        # each query's window of keys, less padding: padded queries far from any real key have none
        B, S = src.shape
        return attention_mask(layout.padding, None, batch=B, heads=1, q_len=S, k_len=S, window=self.window,
                              device=src.device, every_query_has_a_key=not layout.padded)  # fmt: skip

    def _encode(self, src: Tensor, mask: AttentionMask) -> Tensor:
        kernels = self._kernels(src.device.type)
        with kernels():
            return self.encoder(self.src_embed(src), mask, kernels)  # (B, S, d)

    def _decoder_states(self, tgt: Tensor, memory: Tensor, cross_mask: AttentionMask,
                        cache: DecoderCache | None = None, where: Tensor | None = None) -> Tensor:  # fmt: skip
        """The decoder's output states: (B, T, d), or (N, d) with `where`."""
        offset = 0 if cache is None else len(cache)
        T = tgt.size(1)
        self_mask = causal(T, offset + T, self.window, self.future)
        kernels = self._kernels(tgt.device.type)
        with kernels():
            x = self.decoder(self.tgt_embed(tgt, offset), memory, self_mask, cross_mask, kernels, cache)  # (B, T, d)
        if where is not None:
            x = x[where] if where.dtype == torch.bool else x.flatten(0, 1).index_select(0, where)  # (N, d)
        return x

    def new_cache(self) -> DecoderCache:
        return DecoderCache.empty(len(self.decoder.layers))


def build_model(cfg: ModelConfig, runtime: RuntimeConfig | None = None,
                weights: dict[str, Tensor] | None = None) -> EncoderDecoder:  # fmt: skip
    """The model `cfg` describes, run as `runtime` says (default RuntimeConfig()). With `weights` (a state dict, every
    parameter in it), built on the meta device and given those tensors: no random initialisation to throw away (at
    OPUS-MT's size, 0.75 s of a 0.95 s load)."""
    runtime = runtime or RuntimeConfig()
    with torch.device("meta") if weights is not None else nullcontext():
        model = _modules(cfg, runtime)
    if weights is None:
        _init_weights(model, cfg)
    else:
        model.load_state_dict(weights, assign=True)  # strict: every parameter given, none left over
        model.init_buffers()
    if cfg.tie_output:
        model.output.weight = model.tgt_embed.tokens.weight
    return model


def _modules(cfg: ModelConfig, runtime: RuntimeConfig) -> EncoderDecoder:
    """The whole model tree, untied and as its constructors initialise it."""
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
        src_embed=Embeddings(src_tokens, cfg.max_positions, cfg.positions, cfg.dropout, cfg.token_dropout),
        tgt_embed=Embeddings(tgt_tokens, cfg.max_positions, cfg.positions, cfg.dropout, cfg.token_dropout),
        output=nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=cfg.output_bias),
        pad_id=cfg.pad_id,
        window=cfg.window,
        padding_free=runtime.padding_free_attention,
        backend=runtime.attention_backend,
    )
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
