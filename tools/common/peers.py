"""The models the benchmarks compare ours against, each built with our dimensions from a ModelConfig."""

import math

import torch
from torch import nn

from transformer.model import ModelConfig
from transformer.model.embedding import sinusoidal_table


class TorchTransformer(nn.Module):
    """The peer: torch.nn.Transformer (pre-LN, batch-first) with scaled embeddings, sinusoidal positions and a
    tied output layer, masks as PyTorch's translation tutorial builds them."""

    def __init__(self, cfg: ModelConfig, our_dropout: bool = False):
        super().__init__()
        self.d, self.pad = cfg.d_model, cfg.pad_id
        self.embed = nn.Embedding(cfg.src_vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.transformer = nn.Transformer(
            cfg.d_model, cfg.n_heads, cfg.n_encoder_layers, cfg.n_decoder_layers, cfg.d_ff, cfg.dropout,
            batch_first=True, norm_first=True,
        )  # fmt: skip
        if our_dropout:  # nn.Transformer's one rate also drops attention probabilities and FF activations
            for layer in [*self.transformer.encoder.layers, *self.transformer.decoder.layers]:
                layer.dropout.p = cfg.activation_dropout
                for attention in (m for m in layer.modules() if isinstance(m, nn.MultiheadAttention)):
                    attention.dropout = cfg.attention_dropout
        self.register_buffer("pe", sinusoidal_table(cfg.max_positions, cfg.d_model))
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, src, tgt):
        def embed(x):
            return self.dropout(self.embed(x) * math.sqrt(self.d) + self.pe[: x.size(1)])

        causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), dtype=torch.bool)
        out = self.transformer(
            embed(src), embed(tgt), tgt_mask=causal, src_key_padding_mask=src.eq(self.pad),
            tgt_key_padding_mask=tgt.eq(self.pad), memory_key_padding_mask=src.eq(self.pad),
        )  # fmt: skip
        return out @ self.embed.weight.T  # (B, T, V)


class MarianPeer(nn.Module):
    """Hugging Face's MarianMTModel (post-LN, sinusoidal positions, shared tied embeddings), randomly initialised
    with our dimensions; its SDPA attention."""

    def __init__(self, cfg: ModelConfig, bos: int, eos: int):
        super().__init__()
        from transformers import MarianConfig, MarianMTModel

        config = MarianConfig(
            vocab_size=cfg.src_vocab_size, d_model=cfg.d_model, encoder_layers=cfg.n_encoder_layers,
            decoder_layers=cfg.n_decoder_layers, encoder_attention_heads=cfg.n_heads,
            decoder_attention_heads=cfg.n_heads, encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
            dropout=cfg.dropout, attention_dropout=cfg.attention_dropout, activation_dropout=cfg.activation_dropout,
            activation_function="relu", max_position_embeddings=cfg.max_positions, pad_token_id=cfg.pad_id,
            eos_token_id=eos, bos_token_id=bos, decoder_start_token_id=bos, scale_embedding=True,
            share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
        )  # fmt: skip
        self.model, self.pad = MarianMTModel(config), cfg.pad_id

    def forward(self, src, tgt):
        return self.model(input_ids=src, attention_mask=src.ne(self.pad), decoder_input_ids=tgt,
                          decoder_attention_mask=tgt.ne(self.pad)).logits  # fmt: skip


class TutorialTransformer(nn.Module):
    """PyTorch's translation tutorial's Seq2SeqTransformer: sequence-first nn.Transformer (post-LN), d=512,
    8 heads, ff=512, 3+3 layers, separate source and target embeddings and output layer."""

    def __init__(self, vocab_size: int, pad: int, d: int = 512):
        super().__init__()
        self.d, self.pad = d, pad
        self.transformer = nn.Transformer(d, 8, 3, 3, 512, 0.1)
        self.src_embed, self.tgt_embed = nn.Embedding(vocab_size, d), nn.Embedding(vocab_size, d)
        self.generator = nn.Linear(d, vocab_size)
        self.register_buffer("pe", sinusoidal_table(5000, d)[:, None])  # (5000, 1, d): sequence-first
        self.dropout = nn.Dropout(0.1)

    def forward(self, src, tgt):
        src, tgt = src.T, tgt.T  # (S, B), (T, B): the tutorial's sequence-first layout

        def embed(table, x):
            return self.dropout(table(x) * math.sqrt(self.d) + self.pe[: x.size(0)])

        t = tgt.size(0)
        tgt_mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        src_mask = torch.zeros((src.size(0), src.size(0)), dtype=torch.bool)
        out = self.transformer(
            embed(self.src_embed, src), embed(self.tgt_embed, tgt), src_mask, tgt_mask, None,
            src.T.eq(self.pad), tgt.T.eq(self.pad), src.T.eq(self.pad),
        )  # fmt: skip
        return self.generator(out).transpose(0, 1)  # (B, T, V)
