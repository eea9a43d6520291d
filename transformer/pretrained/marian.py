"""A Marian (OPUS-MT) checkpoint in the Hugging Face format as this project's EncoderDecoder: its config.json as a
ModelConfig, its weights as our state dict. Marian's transformer is ours with four options: post-LayerNorm with no
final norm, swish, a bias on the output layer (final_logits_bias) and sinusoidal positions laid out as all sines then
all cosines. What OPUS-MT configs hold that the model cannot represent is refused in one line naming the field.
Plain PyTorch and JSON: `transformers` is not needed."""

import json
from pathlib import Path

import torch
from torch import Tensor

from ..model import ModelConfig

ACTIVATIONS = {"swish": "swish", "silu": "swish", "gelu": "gelu", "relu": "relu"}


class UnsupportedMarian(ValueError):
    """A Marian config that this model cannot represent: the message names the field."""


def model_config(hf: dict) -> ModelConfig:
    """The ModelConfig of a Hugging Face MarianConfig (config.json as a dict)."""

    def same(field: str, other: str) -> int:
        if hf[field] != hf[other]:
            raise UnsupportedMarian(f"{field}={hf[field]} but {other}={hf[other]}: encoder and decoder must be alike "
                                    f"here; this Marian model cannot be imported")  # fmt: skip
        return hf[field]

    activation = ACTIVATIONS.get(hf.get("activation_function", "swish"))
    if activation is None:
        raise UnsupportedMarian(f"activation_function={hf['activation_function']!r}: only {', '.join(ACTIVATIONS)}")
    if not hf.get("scale_embedding", False):
        raise UnsupportedMarian("scale_embedding=false: embeddings here are always scaled by sqrt(d_model)")
    if hf.get("normalize_before", False):
        raise UnsupportedMarian("normalize_before=true (pre-LayerNorm Marian): only post-LayerNorm is imported")
    vocab, decoder_vocab = hf["vocab_size"], hf.get("decoder_vocab_size") or hf["vocab_size"]
    shared = hf.get("share_encoder_decoder_embeddings", True)
    if shared and vocab != decoder_vocab:
        raise UnsupportedMarian(f"share_encoder_decoder_embeddings=true with vocab_size={vocab} but "
                                f"decoder_vocab_size={decoder_vocab}")  # fmt: skip
    return ModelConfig(
        src_vocab_size=vocab, tgt_vocab_size=decoder_vocab, pad_id=hf["pad_token_id"], d_model=hf["d_model"],
        n_heads=same("encoder_attention_heads", "decoder_attention_heads"),
        d_ff=same("encoder_ffn_dim", "decoder_ffn_dim"), n_encoder_layers=hf["encoder_layers"],
        n_decoder_layers=hf["decoder_layers"], dropout=hf.get("dropout", 0.1),
        attention_dropout=hf.get("attention_dropout", 0.0), activation_dropout=hf.get("activation_dropout", 0.0),
        activation=activation, norm_first=False, positions="sinusoidal_concat",
        max_positions=hf.get("max_position_embeddings", 512), share_embeddings=shared,
        tie_output=hf.get("tie_word_embeddings", True), output_bias=True,
    )  # fmt: skip


def state_dict(hf: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Our EncoderDecoder's weights from a MarianMTModel state dict: q, k, v projections fused into one in-projection
    ([q; k; v], as ours), layer norms by their place in the layer, the shared (or each side's) embedding table."""
    hf = {name.removeprefix("model."): tensor for name, tensor in hf.items()}
    ours = {}

    def attention(dst: str, src: str) -> None:
        ours[f"{dst}.in_proj_weight"] = torch.cat([hf[f"{src}.{x}_proj.weight"] for x in "qkv"])  # (3d, d)
        ours[f"{dst}.in_proj_bias"] = torch.cat([hf[f"{src}.{x}_proj.bias"] for x in "qkv"])  # (3d,)
        for part in ("weight", "bias"):
            ours[f"{dst}.out_proj.{part}"] = hf[f"{src}.out_proj.{part}"]

    def copy(dst: str, src: str) -> None:
        for part in ("weight", "bias"):
            ours[f"{dst}.{part}"] = hf[f"{src}.{part}"]

    for side, count in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        for i in range(count):
            layer = f"{side}.layers.{i}"  # the same name in both
            attention(f"{layer}.self_attn", f"{layer}.self_attn")
            copy(
                f"{layer}.{'attn_block' if side == 'encoder' else 'self_attn_block'}.norm",
                f"{layer}.self_attn_layer_norm",
            )
            if side == "decoder":
                attention(f"{layer}.cross_attn", f"{layer}.encoder_attn")
                copy(f"{layer}.cross_attn_block.norm", f"{layer}.encoder_attn_layer_norm")
            copy(f"{layer}.ff.fc1", f"{layer}.fc1")
            copy(f"{layer}.ff.fc2", f"{layer}.fc2")
            copy(f"{layer}.ff_block.norm", f"{layer}.final_layer_norm")
    source = hf["shared.weight"] if cfg.share_embeddings else hf["encoder.embed_tokens.weight"]
    target = hf["shared.weight"] if cfg.share_embeddings else hf["decoder.embed_tokens.weight"]
    ours["src_embed.tokens.weight"], ours["tgt_embed.tokens.weight"] = source, target
    ours["output.weight"] = target if cfg.tie_output else hf["lm_head.weight"]
    ours["output.bias"] = hf["final_logits_bias"].reshape(-1)  # (1, V) there
    return ours


def read_folder(folder: Path) -> tuple[dict, dict[str, Tensor]]:
    """(config.json, the weights) of a folder save_pretrained wrote: model.safetensors, or pytorch_model.bin."""
    config = json.loads((folder / "config.json").read_text())
    if (folder / "model.safetensors").exists():
        from safetensors.torch import load_file  # the Hugging Face format's own reader, as its loader does

        return config, load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").exists():
        return config, torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{folder} holds neither model.safetensors nor pytorch_model.bin; give the folder "
                            "save_pretrained wrote (config.json beside the weights)")  # fmt: skip
