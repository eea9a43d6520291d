"""An OPUS-MT-sized Marian model (opus-mt-de-en's config: d_model 512, 6+6 layers, 58,101 pieces; random weights, as
no hub is reached here) imported, loaded and checked against transformers at full size.

python tools/bench_import.py [--repeats 3] [--write]

Rows: our import (read the Hugging Face folder, rewrite the tokenizers, write model.ckpt), our load
(CheckpointTranslator.from_path: what evaluate, translate and serve do), and transformers' load of the same folder
(MarianMTModel and MarianTokenizer .from_pretrained); medians of --repeats. Then the parity at this size: our
tokenizers' ids against MarianTokenizer's on Multi30k's validation lines, and the teacher-forced logits' largest
difference in float32, each model given its own tokenizer's ids. (Greedy search is not compared here: random
weights decode every source alike; tests/test_marian.py compares searches on a trained tiny model.)
"""

import argparse
import gzip
import json
import tempfile
from pathlib import Path

import sentencepiece as spm
import torch

from common.machine import median_seconds
from common.report import record
from transformer.import_model import main as import_model
from transformer.translators import CheckpointTranslator

ROOT = Path(__file__).resolve().parents[1]

OPUS_MT_DE_EN = dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                     decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, activation_function="swish",
                     scale_embedding=True, max_position_embeddings=512, eos_token_id=0, forced_eos_token_id=0)  # fmt: skip
VOCAB = 58101  # opus-mt-de-en's pieces, <pad> the last


def lines(lang: str, n: int, split: str = "train") -> list[str]:
    with gzip.open(ROOT / "data" / "multi30k" / f"{split}.{lang}.gz", "rt") as f:
        return [line.rstrip("\n") for _, line in zip(range(n), f)]


def opus_mt_folder(folder: Path):
    """source.spm and target.spm (6,000 pieces each, from Multi30k), a vocab.json of both padded to 58,101 entries,
    and a MarianMTModel of opus-mt-de-en's shape with transformers' own random initialisation."""
    import transformers

    vocab = {"</s>": 0, "<unk>": 1}
    for side, lang in (("source", "de"), ("target", "en")):
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines(lang, 29000)), model_prefix=str(folder / side),
                                       vocab_size=6000, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)  # fmt: skip
        (folder / f"{side}.spm").write_bytes((folder / f"{side}.model").read_bytes())
        sp = spm.SentencePieceProcessor(model_file=str(folder / f"{side}.model"))
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
    for i in range(len(vocab), VOCAB - 1):
        vocab[f"▁unused{i}"] = i  # the rest of a real joint vocabulary
    vocab["<pad>"] = VOCAB - 1
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps({"source_lang": "de", "target_lang": "en"}))
    config = transformers.MarianConfig(vocab_size=VOCAB, decoder_vocab_size=VOCAB, pad_token_id=VOCAB - 1,
                                       decoder_start_token_id=VOCAB - 1, **OPUS_MT_DE_EN)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config).eval()
    model.save_pretrained(folder)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    args = parser.parse_args()
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        folder, out = Path(tmp) / "opus-mt-de-en", Path(tmp) / "imported"
        folder.mkdir()
        theirs = opus_mt_folder(folder)
        rows = {
            "import (ours: model.ckpt and tokenizers written)": median_seconds(
                lambda: import_model([str(folder), f"output={out}"]), args.repeats),
            "load (ours: CheckpointTranslator.from_path)": median_seconds(
                lambda: CheckpointTranslator.from_path(str(out / "model.ckpt")), args.repeats),
            "load (transformers: MarianMTModel + MarianTokenizer)": median_seconds(
                lambda: (transformers.MarianMTModel.from_pretrained(str(folder)),
                         transformers.MarianTokenizer.from_pretrained(str(folder))), args.repeats),
        }  # fmt: skip
        ours = CheckpointTranslator.from_path(str(out / "model.ckpt"))
        tokenizer = transformers.MarianTokenizer.from_pretrained(str(folder))
        texts = {side: lines(lang, 1014, "val") for side, lang in (("src", "de"), ("tgt", "en"))}
        want = {"src": tokenizer(texts["src"])["input_ids"], "tgt": tokenizer(text_target=texts["tgt"])["input_ids"]}
        got = {side: getattr(ours, f"{side}_tokenizer").encode(texts[side]) for side in texts}
        same = {side: sum(a + [0] == b for a, b in zip(got[side], want[side])) for side in texts}  # theirs end in </s>
        pad = torch.nn.utils.rnn.pad_sequence
        src = [
            pad([torch.tensor(ids) for ids in side[:16]], True, VOCAB - 1)
            for side in ([g + [0] for g in got["src"]], want["src"])
        ]  # (16, S) each: ours, theirs
        tgt = pad([torch.tensor([VOCAB - 1, *t[:-1]]) for t in want["tgt"][:16]], True, VOCAB - 1)  # (16, T)
        real = tgt.ne(VOCAB - 1)
        real[:, 0] = True  # the decoder's start, <pad>
        with torch.no_grad():
            logits = ours.model(src[0], tgt), theirs(input_ids=src[1], attention_mask=src[1].ne(VOCAB - 1),
                                                     decoder_input_ids=tgt).logits  # fmt: skip
        gap = (logits[0] - logits[1])[real].abs().max()
        size = (out / "model.ckpt").stat().st_size / 2**20
        parameters = sum(p.numel() for p in theirs.parameters()) / 1e6
    table = ["| step | seconds (median) |", "|---|---|", *(f"| {name} | {s:.2f} |" for name, s in rows.items())]
    checks = (f"Parity at this size: ids equal to MarianTokenizer's on {same['src']} of {len(texts['src'])} source "
              f"and {same['tgt']} of {len(texts['tgt'])} target lines (Multi30k val); teacher-forced logits within "
              f"{gap:.1e} of transformers' (float32, 16 pairs, each model given its own tokenizer's ids). "
              f"model.ckpt: {size:.0f} MiB.")  # fmt: skip
    print("\n".join(table) + "\n\n" + checks)
    if args.write:
        body = (f", transformers {transformers.__version__}: opus-mt-de-en's shape ({parameters:.0f}M parameters, "
                f"random weights), median of {args.repeats}.\n\n"
                + "\n".join(table) + "\n\n" + checks + "\n")  # fmt: skip
        record("import", "Importing an OPUS-MT-sized model (`python tools/bench_import.py --write`)", body)


if __name__ == "__main__":
    main()
