"""A Marian (OPUS-MT) checkpoint in the Hugging Face format as this project's EncoderDecoder: its config.json as a
ModelConfig, its weights as our state dict. Marian's transformer is ours with four options: post-LayerNorm with no
final norm, swish, a bias on the output layer (final_logits_bias) and sinusoidal positions laid out as all sines then
all cosines. What OPUS-MT configs hold that the model cannot represent is refused in one line naming the field.
Plain PyTorch and JSON: `transformers` is not needed."""

import json
import re
from pathlib import Path

import torch
from torch import Tensor

from ..base.errors import first_line
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


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # save_pretrained's, in the order its loader reads them


def read_folder(folder: Path) -> tuple[dict, dict[str, Tensor]]:
    """(config.json, the weights) of a folder save_pretrained wrote: model.safetensors, or pytorch_model.bin."""
    config = _json(folder / "config.json")
    if config.get("model_type", "marian") != "marian":
        raise UnsupportedMarian(f"model_type={config['model_type']!r} in {folder}/config.json: only Marian (OPUS-MT) "
                                "models are imported")  # fmt: skip
    for name in WEIGHT_FILES:
        if not (folder / name).exists():
            continue
        try:
            if name == "model.safetensors":
                from safetensors.torch import load_file  # the Hugging Face format's own reader, as its loader does

                return config, load_file(str(folder / name))
            return config, torch.load(folder / name, map_location="cpu", weights_only=True)
        except Exception as e:  # truncated, corrupt, or not weights: its reader's first line
            reason = first_line(e, 200)
            raise UnsupportedMarian(f"{folder / name} cannot be read ({reason}); download it again") from None
    raise FileNotFoundError(f"{folder} holds neither model.safetensors nor pytorch_model.bin; give the folder "
                            "save_pretrained wrote (config.json beside the weights)")  # fmt: skip


LANGUAGE_CODE = re.compile(r">>\S+<<")  # a multilingual model's target language, first in the source: >>fra<<
SPECIAL = {"</s>": "CONTROL", "<pad>": "CONTROL", "<unk>": "UNKNOWN"}


def sentencepiece_with_ids(spm: bytes, vocab: dict[str, int], size: int, side: str) -> bytes:
    """One side's sentencepiece model (source.spm or target.spm) rewritten so that its ids are vocab.json's (the ids
    the model's embeddings are indexed by): piece i of the result is vocab.json's id i. This side's own pieces keep
    their scores (the same segmentation); vocab.json's other pieces (the other language's) are unused, never
    produced, but for single characters, which stand where this side's <unk> would; </s> is EOS, <pad> both pad
    and BOS (Marian's decoder starts from <pad>), <unk> unknown; the language codes (>>fra<<) are reserved pieces,
    this project's tags. Ids from len(vocab) to `size` (the embeddings' rows) are unused pieces. A piece of this side that vocab.json lacks cannot be produced (Marian's tokenizer produces
    it and looks up <unk>)."""
    from google.protobuf.message import DecodeError
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    for token in SPECIAL:
        if token not in vocab:
            raise UnsupportedMarian(
                f"vocab.json has no {token}: this tokenizer is not Marian's; give an OPUS-MT folder"
            )
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise UnsupportedMarian("vocab.json's ids are not 0..N-1 without gaps; this tokenizer is not Marian's")
    if len(vocab) > size:
        raise UnsupportedMarian(f"vocab.json holds {len(vocab)} pieces but {side} vocab_size={size}")
    original = model_pb2.ModelProto()
    try:
        original.ParseFromString(spm)
    except DecodeError:
        raise UnsupportedMarian(f"{side}.spm is not a sentencepiece model; give the folder as save_pretrained wrote "
                                "it") from None  # fmt: skip
    Piece = model_pb2.ModelProto.SentencePiece
    own = {p.piece: p for p in original.pieces if p.type in (Piece.NORMAL, Piece.USER_DEFINED)}
    if not own:
        raise UnsupportedMarian(f"{side}.spm holds no pieces; give the folder as save_pretrained wrote it")
    lowest = min((p.score for p in own.values()), default=0.0)
    proto = model_pb2.ModelProto()
    proto.CopyFrom(original)
    del proto.pieces[:]
    codes = []
    for piece, _ in sorted(vocab.items(), key=lambda item: item[1]):
        if piece in SPECIAL:
            proto.pieces.add(piece=piece, score=0.0, type=getattr(Piece, SPECIAL[piece]))
        elif LANGUAGE_CODE.fullmatch(piece) and side == "source":
            proto.pieces.add(piece=piece, score=0.0, type=Piece.USER_DEFINED)
            codes.append(piece)
        elif piece in own:
            proto.pieces.add(piece=piece, score=own[piece].score, type=own[piece].type)
        elif len(piece) == 1:  # a character this side's model does not know: Marian's tokenizer looks its surface
            # up in vocab.json; as a piece scored below all others it stands where <unk> would (only it covers it)
            proto.pieces.add(piece=piece, score=lowest - 10, type=Piece.NORMAL)
        else:  # the other language's piece (or a control piece of Marian's own, e.g. <s>)
            proto.pieces.add(piece=piece, score=0.0, type=Piece.UNUSED)
    for i in range(len(vocab), size):
        proto.pieces.add(piece=f"<unused{i}>", score=0.0, type=Piece.UNUSED)
    spec = proto.trainer_spec
    spec.unk_id, spec.eos_id, spec.pad_id, spec.bos_id = (vocab[t] for t in ("<unk>", "</s>", "<pad>", "<pad>"))
    spec.unk_piece, spec.eos_piece, spec.pad_piece, spec.bos_piece = "<unk>", "</s>", "<pad>", "<pad>"
    spec.byte_fallback = False  # OPUS-MT's models have no byte pieces: unknown characters are <unk>
    del spec.user_defined_symbols[:]
    spec.user_defined_symbols.extend(codes)
    return proto.SerializeToString()


def tokenizers(folder: Path, hf: dict, cfg: ModelConfig) -> tuple[bytes, bytes]:
    """(source, target) sentencepiece models with vocab.json's ids (target_vocab.json's for a model with separate
    vocabularies): source.spm and target.spm rewritten by sentencepiece_with_ids."""
    settings = _tokenizer_settings(folder)
    source_vocab = _json(folder / "vocab.json")
    target_vocab = _json(folder / "target_vocab.json") if settings.get("separate_vocabs") else source_vocab
    for name, vocab in (("vocab.json", source_vocab), ("target_vocab.json", target_vocab)):
        if vocab.get("<pad>") != hf["pad_token_id"]:
            raise UnsupportedMarian(f"pad_token_id={hf['pad_token_id']} but {name} has <pad> at {vocab.get('<pad>')}; "
                                    "the tokenizer and the model disagree")  # fmt: skip
    start = hf.get("decoder_start_token_id", hf["pad_token_id"])
    if start != hf["pad_token_id"]:
        raise UnsupportedMarian(f"decoder_start_token_id={start} is not pad_token_id={hf['pad_token_id']}: only "
                                "Marian's decoder start (<pad>) is imported")  # fmt: skip
    return (
        sentencepiece_with_ids(_read(folder / "source.spm"), source_vocab, cfg.src_vocab_size, "source"),
        sentencepiece_with_ids(_read(folder / "target.spm"), target_vocab, cfg.tgt_vocab_size, "target"),
    )


def languages(folder: Path, name: str) -> tuple[str | None, str | None]:
    """(source, target) language as the model names them: tokenizer_config.json's source_lang and target_lang, or
    an OPUS-MT name's (opus-mt-de-en, opus-mt-en-ROMANCE); None where neither says."""
    settings = _tokenizer_settings(folder)
    named = re.search(r"opus-mt-(?:tc-(?:big-)?)?([A-Za-z_]+)-([A-Za-z_]+)$", name.rstrip("/"))
    return (settings.get("source_lang") or (named and named.group(1)) or None,
            settings.get("target_lang") or (named and named.group(2)) or None)  # fmt: skip


def _tokenizer_settings(folder: Path) -> dict:
    """tokenizer_config.json (separate_vocabs, source_lang, target_lang), or {} where the folder has none."""
    return _json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}


def _json(path: Path) -> dict:
    try:
        found = json.loads(_read(path))
    except json.JSONDecodeError as e:
        raise UnsupportedMarian(f"{path} is not JSON ({e}); give the folder as save_pretrained wrote it") from None
    if not isinstance(found, dict):
        raise UnsupportedMarian(f"{path} holds a {type(found).__name__}, not an object; give the folder as "
                                "save_pretrained wrote it")  # fmt: skip
    return found


def _read(path: Path) -> bytes:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: an OPUS-MT folder holds config.json, the weights, source.spm, "
                                "target.spm and vocab.json")  # fmt: skip
    return path.read_bytes()
