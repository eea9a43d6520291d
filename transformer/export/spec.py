"""A model's weights as a CTranslate2 TransformerSpec, through CTranslate2's own spec API.

The fused in-projection maps onto CTranslate2's fused weights as they are: self-attention's [q; k; v] is its
linear[0], cross-attention's [q] and [k; v] its linear[0] and linear[1]. Positions are written as a table (ours,
sinusoidal or learned), so both engines add the same vectors.
"""

import numpy as np
from torch import Tensor

from ..model import ModelConfig

LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's, which every norm of the model uses


class UnsupportedModel(ValueError):
    """The model has a part CTranslate2 cannot represent."""


def supported(cfg: ModelConfig) -> None:
    """Raises UnsupportedModel, naming the setting, when CTranslate2 cannot run this architecture."""
    if cfg.window is not None:
        raise UnsupportedModel(
            f"model.window={cfg.window} (self-attention within a window) has no CTranslate2 equivalent for an "
            "encoder-decoder; export a model trained without it"
        )


def checkpoint_spec(translator):
    """The TransformerSpec of a loaded checkpoint (a CheckpointTranslator): its model, vocabularies and special pieces."""
    src, tgt = translator.src_tokenizer, translator.tgt_tokenizer
    special = {name: tgt.sp.id_to_piece(getattr(tgt, f"{name}_id")) for name in ("unk", "bos", "eos")}
    return ctranslate2_spec(translator.model_config, translator.model.state_dict(), src.pieces(), tgt.pieces(), special)


def ctranslate2_spec(cfg: ModelConfig, weights: dict[str, Tensor], src_pieces: list[str], tgt_pieces: list[str],
                     special: dict[str, str]):  # fmt: skip
    """The TransformerSpec of a model (`weights`: EncoderDecoder.state_dict()), with its vocabularies (one piece
    per id) and special tokens (unk, bos, eos pieces)."""
    from ctranslate2.specs import common_spec, transformer_spec

    supported(cfg)
    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU,
                  "swish": common_spec.Activation.SWISH}[cfg.activation]  # fmt: skip
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.n_encoder_layers, cfg.n_decoder_layers), cfg.n_heads, pre_norm=cfg.norm_first, activation=activation
    )
    # copies: quantizing works on the arrays in place, and the model must come out of an export unchanged
    w = {name: t.detach().float().cpu().numpy().copy() for name, t in weights.items()}
    positions = _positions(cfg, w)

    encoder, decoder = spec.encoder, spec.decoder
    encoder.embeddings[0].weight = w["src_embed.tokens.weight"]
    decoder.embeddings.weight = w["tgt_embed.tokens.weight"]
    for side, name in ((encoder, "src_embed"), (decoder, "tgt_embed")):
        side.scale_embeddings = True  # tokens x sqrt(d_model), then + positions, as Embeddings does
        side.position_encodings.encodings = positions[name]
    if cfg.norm_first:
        _norm(encoder.layer_norm, w, "encoder.norm")
        _norm(decoder.layer_norm, w, "decoder.norm")
    for i, layer in enumerate(encoder.layer):
        scope = f"encoder.layers.{i}"
        _self_attention(layer.self_attention, w, f"{scope}.self_attn", f"{scope}.attn_block.norm")
        _feed_forward(layer.ffn, w, scope, f"{scope}.ff_block.norm")
    for i, layer in enumerate(decoder.layer):
        scope = f"decoder.layers.{i}"
        _self_attention(layer.self_attention, w, f"{scope}.self_attn", f"{scope}.self_attn_block.norm")
        _cross_attention(layer.attention, w, f"{scope}.cross_attn", f"{scope}.cross_attn_block.norm")
        _feed_forward(layer.ffn, w, scope, f"{scope}.ff_block.norm")
    decoder.projection.weight = w["output.weight"]
    if cfg.output_bias:
        decoder.projection.bias = w["output.bias"]

    spec.config.layer_norm_epsilon = LAYER_NORM_EPS
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = special["unk"], special["bos"], special["eos"]
    spec.config.decoder_start_token = special["bos"]
    spec.config.add_source_eos = True  # sources end with EOS, as CheckpointTranslator.batches builds them
    spec.register_source_vocabulary(src_pieces)
    spec.register_target_vocabulary(tgt_pieces)
    return spec


def _positions(cfg: ModelConfig, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    if cfg.positions == "learned":
        return {name: w[f"{name}.positions"] for name in ("src_embed", "tgt_embed")}
    from ..model.embedding import sinusoidal_table

    table = sinusoidal_table(cfg.max_positions, cfg.d_model, concat=cfg.positions == "sinusoidal_concat").numpy()
    return {"src_embed": table, "tgt_embed": table}


def _norm(spec, w: dict, scope: str) -> None:
    spec.gamma, spec.beta = w[f"{scope}.weight"], w[f"{scope}.bias"]


def _linear(spec, weight: np.ndarray, bias: np.ndarray | None) -> None:
    spec.weight = weight
    if bias is not None:
        spec.bias = bias


def _self_attention(spec, w: dict, scope: str, norm: str) -> None:
    _linear(spec.linear[0], w[f"{scope}.in_proj_weight"], w.get(f"{scope}.in_proj_bias"))  # (3d, d): q, k, v
    _linear(spec.linear[1], w[f"{scope}.out_proj.weight"], w.get(f"{scope}.out_proj.bias"))
    _norm(spec.layer_norm, w, norm)


def _cross_attention(spec, w: dict, scope: str, norm: str) -> None:
    weight, bias = w[f"{scope}.in_proj_weight"], w.get(f"{scope}.in_proj_bias")
    d = weight.shape[1]
    _linear(spec.linear[0], weight[:d], None if bias is None else bias[:d])  # q (d, d)
    _linear(spec.linear[1], weight[d:], None if bias is None else bias[d:])  # k, v (2d, d)
    _linear(spec.linear[2], w[f"{scope}.out_proj.weight"], w.get(f"{scope}.out_proj.bias"))
    _norm(spec.layer_norm, w, norm)


def _feed_forward(spec, w: dict, scope: str, norm: str) -> None:
    _linear(spec.linear_0, w[f"{scope}.ff.fc1.weight"], w[f"{scope}.ff.fc1.bias"])
    _linear(spec.linear_1, w[f"{scope}.ff.fc2.weight"], w[f"{scope}.ff.fc2.bias"])
    _norm(spec.layer_norm, w, norm)
