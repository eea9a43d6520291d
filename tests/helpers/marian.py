"""A tiny OPUS-MT model folder as save_pretrained writes one, built here (no download): two small sentencepiece
models trained on Multi30k lines (source.spm, target.spm), a joint vocab.json in Marian's layout (</s> 0, <unk> 1,
both sides' pieces, language codes, <pad> last), and a random MarianMTModel with weights drawn wide enough that
different sources decode differently."""

import gzip
import json
from pathlib import Path

import sentencepiece as spm
import torch

from .corpora import MULTI30K
from .prerequisites import require, require_module

CODES = (">>fra<<", ">>deu<<")  # a multilingual model's target-language codes, in vocab.json


def lines(lang: str, split: str = "train", n: int = 400, skip: int = 0) -> list[str]:
    require(MULTI30K.is_dir(), f"the Multi30k corpus ({MULTI30K})", "link ../shared/data/multi30k as data/multi30k")
    with gzip.open(MULTI30K / f"{split}.{lang}.gz", "rt") as f:
        return [line.rstrip("\n") for _, line in zip(range(skip + n), f)][skip:]


def train_spm(texts: list[str], prefix: Path, vocab_size: int = 250) -> Path:
    """A unigram model with Marian's special ids (<unk> 0, <s> 1, </s> 2), as OPUS-MT's source.spm files have."""
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(prefix), vocab_size=vocab_size,
                                   model_type="unigram", character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, minloglevel=2)  # fmt: skip
    return prefix.with_suffix(".model")


def write_opus_mt(folder: Path, steps: int = 300, d_model: int = 32, **config):
    """(the folder, the MarianMTModel): the model trained for `steps` Adam steps on 400 Multi30k pairs (~5 s), then its
    output bias (final_logits_bias) moved by N(0, 0.5) so that it is not zero. Trained, not drawn: random weights,
    however wide, decode every source to one repeated token (the encoder's outputs collapse to one vector), where a
    few steps give translations that differ by source, mostly end with EOS, and never choose <pad> (never a label).
    `config`: MarianConfig fields over these."""
    transformers = require_module("transformers", 'pip install -e ".[dev]"')
    folder.mkdir(parents=True, exist_ok=True)
    work = folder / "spm-training"
    work.mkdir(exist_ok=True)
    source = train_spm(lines("de"), work / "source")
    target = train_spm(lines("en"), work / "target")
    (folder / "source.spm").write_bytes(source.read_bytes())
    (folder / "target.spm").write_bytes(target.read_bytes())
    vocab = {"</s>": 0, "<unk>": 1}
    for model in (source, target):
        sp = spm.SentencePieceProcessor(model_file=str(model))
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
    for code in CODES:
        vocab[code] = len(vocab)
    vocab["<pad>"] = pad = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps({"source_lang": "de", "target_lang": "en"}))
    settings = dict(
        vocab_size=len(vocab),
        decoder_vocab_size=len(vocab),
        d_model=d_model,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=2 * d_model,
        decoder_ffn_dim=2 * d_model,
        activation_function="swish",
        scale_embedding=True,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=0,
        max_position_embeddings=128,
        bad_words_ids=[[pad]],
        dropout=0.0,
    )  # fmt: skip  (as OPUS-MT's configs, but the sizes)
    torch.manual_seed(0)
    model = transformers.MarianMTModel(transformers.MarianConfig(**{**settings, **config}))
    tokenizer = transformers.MarianTokenizer.from_pretrained(str(folder))
    pairs = tokenizer(lines("de"), text_target=lines("en"), return_tensors="pt", padding=True, truncation=True,
                      max_length=40)  # fmt: skip
    labels = pairs["labels"].masked_fill(pairs["labels"].eq(pad), -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    draw = torch.Generator().manual_seed(0)
    for _ in range(steps):
        rows = torch.randint(0, len(labels), (32,), generator=draw)
        loss = model(input_ids=pairs["input_ids"][rows], attention_mask=pairs["attention_mask"][rows],
                     labels=labels[rows]).loss  # fmt: skip
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        model.final_logits_bias.add_(torch.randn(model.final_logits_bias.shape, generator=draw) * 0.5)
    model.save_pretrained(folder)
    return folder, model
