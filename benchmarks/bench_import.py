"""An OPUS-MT-sized Marian model (opus-mt-de-en's config: d_model 512, 6+6 layers, 58,101 pieces; random weights, as
no hub is reached here) imported, loaded and checked against transformers at full size.

python benchmarks/bench_import.py [--repeats 3] [--write]

Rows: our import (read the Hugging Face folder, rewrite the tokenizers, write model.ckpt), our load
(CheckpointTranslator.from_path: what evaluate, translate and serve do), and transformers' load of the same folder
(MarianMTModel and MarianTokenizer .from_pretrained); medians of --repeats. Then the parity at this size:
teacher-forced logits' largest difference in float32, and greedy hypotheses against generate's.
"""

import argparse
import gzip
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import sentencepiece as spm
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import record  # noqa: E402
from transformer.import_model import main as import_model  # noqa: E402
from transformer.translators import CheckpointTranslator, SearchConfig  # noqa: E402

OPUS_MT_DE_EN = dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                     decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, activation_function="swish",
                     scale_embedding=True, max_position_embeddings=512, eos_token_id=0, forced_eos_token_id=0)  # fmt: skip
VOCAB = 58101  # opus-mt-de-en's pieces, <pad> the last


def lines(lang: str, n: int) -> list[str]:
    with gzip.open(ROOT / "data" / "multi30k" / f"train.{lang}.gz", "rt") as f:
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


def timed(run, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


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
            "import (ours: model.ckpt and tokenizers written)": timed(
                lambda: import_model([str(folder), f"output={out}"]), args.repeats),
            "load (ours: CheckpointTranslator.from_path)": timed(
                lambda: CheckpointTranslator.from_path(str(out / "model.ckpt")), args.repeats),
            "load (transformers: MarianMTModel + MarianTokenizer)": timed(
                lambda: (transformers.MarianMTModel.from_pretrained(str(folder)),
                         transformers.MarianTokenizer.from_pretrained(str(folder))), args.repeats),
        }  # fmt: skip
        ours = CheckpointTranslator.from_path(str(out / "model.ckpt"))
        tokenizer = transformers.MarianTokenizer.from_pretrained(str(folder))
        texts = lines("de", 16)
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        tgt = torch.randint(0, VOCAB - 1, (16, 12))
        tgt[:, 0] = VOCAB - 1
        with torch.no_grad():
            gap = (ours.model(batch["input_ids"], tgt) - theirs(**batch, decoder_input_ids=tgt).logits).abs().max()
            generated = theirs.generate(**batch, num_beams=1, max_new_tokens=20, forced_eos_token_id=None)
        found = ours.search(ours.src_tokenizer.encode(texts), SearchConfig(beam_size=1, max_len_a=0, max_len_b=20))
        want = [row[1:][: row[1:].index(0)] if 0 in row[1:] else row[1:] for row in generated.tolist()]
        same = sum(h[0].tokens == w for h, w in zip(found, want))
        size = (out / "model.ckpt").stat().st_size / 2**20
    table = ["| step | seconds (median) |", "|---|---|", *(f"| {name} | {s:.2f} |" for name, s in rows.items())]
    checks = (f"Parity at this size: teacher-forced logits within {gap:.1e} of transformers' (float32, 16 sentences "
              f"x 12 target tokens); greedy hypotheses identical to generate's on {same} of 16 sentences (20 "
              f"tokens). model.ckpt: {size:.0f} MiB.")  # fmt: skip
    print("\n".join(table) + "\n\n" + checks)
    if args.write:
        body = (f", transformers {transformers.__version__}: opus-mt-de-en's shape (74M parameters, random weights), "
                f"median of {args.repeats}.\n\n"
                + "\n".join(table) + "\n\n" + checks + "\n")  # fmt: skip
        record("import", "Importing an OPUS-MT-sized model (`python benchmarks/bench_import.py --write`)", body)


if __name__ == "__main__":
    main()
