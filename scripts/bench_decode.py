"""Decoding speed of a trained checkpoint on a test split: greedy and beam 5, with the key/value cache
and without it (every step re-reading the whole prefix), fp32 and bf16 autocast; and against Hugging Face's
MarianMTModel.generate (its own cache) of the same dimensions, when the optional `bench` extra is installed; and
CTranslate2 on folders `python -m transformer.export` wrote (--export, float32 and int8 say), on the same threads.
A randomly initialised MarianMTModel would not stop where a trained model stops, so it is made to decode
exactly as many steps per batch as our search needed for that batch (min_new_tokens = max_new_tokens), on the
same batches: both do the same number of decoder steps on the same shapes.

    python scripts/bench_decode.py --ckpt outputs/RUN/checkpoints/last.ckpt            # print the table
    python scripts/bench_decode.py --ckpt outputs/RUN/checkpoints/last.ckpt --write    # and record it
    python scripts/bench_decode.py --ckpt RUN/checkpoints/average.pt --export RUN/export/float32 RUN/export/int8

Run it alone: another torch process on the same cores distorts every number.
"""

import argparse
import contextlib
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from sacrebleu.metrics import BLEU

from transformer.benchmarks.machine import machine
from transformer.benchmarks.peers import MarianPeer
from transformer.benchmarks.report import BENCHMARKS, record
from transformer.data import DataConfig, load_corpus
from transformer.inference import SearchConfig, Translator


def timed(run, todo, warm_up, reps: int):
    """(median seconds of run(todo) over reps, its last result), after run(warm_up)."""
    run(warm_up)
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        found = run(todo)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), found


def time_search(translator: Translator, sources: list[list[int]], search: SearchConfig, precision: str, reps: int):
    """(median seconds over reps, generated target tokens incl. EOS), after one warm-up batch."""
    seconds, found = timed(lambda todo: translator.search(todo, search, precision), sources, sources[:16], reps)
    return seconds, sum(len(h[0].tokens) + 1 for h in found)


def time_marian(translator: Translator, sources: list[list[int]], found, beam: int, precision: str, reps: int):
    """Median seconds of MarianMTModel.generate over the batches our search used, each decoding as many steps
    as our longest hypothesis (with EOS) in that batch; None without transformers."""
    tok, cfg = translator.src_tokenizer, translator.model_config
    try:
        peer = MarianPeer(cfg, tok.bos_id, tok.eos_id).model.eval()
    except ImportError:
        return None
    inputs = []  # the batches our search decodes, each with the steps it needed: the longest hypothesis + EOS
    for batch, src in translator.batches(sources, SearchConfig().max_tokens):
        inputs.append((src, max(len(found[i][0].tokens) for i in batch) + 1))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()

    def run(todo):
        with torch.inference_mode(), autocast:
            for src, steps in todo:
                peer.generate(input_ids=src, attention_mask=src.ne(cfg.pad_id), num_beams=beam, do_sample=False,
                              min_new_tokens=steps, max_new_tokens=steps, use_cache=True)  # fmt: skip

    return timed(run, inputs, inputs[:1], reps)[0]


def time_exported(folder: str, sources: list[list[int]], search: SearchConfig, reps: int):
    """(median seconds over reps, generated target tokens incl. EOS, hypotheses) of an exported folder's
    CTranslate2 decoding, with our search settings and max-length rule, after one warm-up batch."""
    from transformer.export.engine import ExportedTranslator, ctranslate2_search

    exported = ExportedTranslator(folder, threads=torch.get_num_threads())
    run = lambda todo: ctranslate2_search(exported.engine, *exported.pieces, todo, search)  # noqa: E731
    seconds, found = timed(run, sources, sources[:16], reps)
    return seconds, sum(len(h) + 1 for h in found), found


def bleu(tokenizer, hypotheses: list[list[int]], references: list[str]) -> str:
    return f"{BLEU().corpus_score(tokenizer.decode(hypotheses), [references]).score:.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--split", default=None, help="default: the checkpoint's test split")
    parser.add_argument("--sentences", type=int, default=1000, help="first N sentences of the split")
    parser.add_argument("--reps", type=int, default=3, help="timed passes with the cache (median reported)")
    parser.add_argument("--export", nargs="*", default=[], help="CTranslate2 folders from transformer.export")
    parser.add_argument("--write", action="store_true", help=f"record the table in {BENCHMARKS}")
    args = parser.parse_args()

    translator = Translator.from_path(args.ckpt)
    data = DataConfig.from_dict(translator.data)
    split = args.split or data.test_split
    pairs = load_corpus(data)[0][split]
    texts, references = list(pairs["src"])[: args.sentences], list(pairs["tgt"])[: args.sentences]
    sources = translator.src_tokenizer.encode(texts)
    rows = [
        "| search | precision | decoder | sentences/s | target tokens/s | ours (cache) faster by | BLEU |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    tgt = translator.tgt_tokenizer
    print(machine())
    for beam in (1, 5):
        for precision in ("32", "bf16"):
            search = SearchConfig(beam_size=beam)
            cached, tokens = time_search(translator, sources, search, precision, args.reps)
            uncached, _ = time_search(translator, sources, replace(search, use_cache=False), precision, 1)
            found = translator.search(sources, search, precision)
            marian = time_marian(translator, sources, found, beam, precision, args.reps)
            name = "greedy" if beam == 1 else f"beam {beam}"
            ours_bleu = bleu(tgt, [h[0].tokens for h in found], references)
            timings = [("ours, cache", cached, tokens, ours_bleu), ("ours, no cache", uncached, tokens, ours_bleu)]
            timings += [("MarianMT generate", marian, tokens, "")] if marian is not None else []
            if precision == "32":  # CTranslate2's compute type is the folder's own
                for folder in args.export:
                    seconds, n, hyps = time_exported(folder, sources, search, args.reps)
                    timings.append((f"CTranslate2 {Path(folder).name}", seconds, n, bleu(tgt, hyps, references)))
            for decoder, seconds, n, score in timings:
                ratio = f"{seconds / cached:.2f}x" if decoder != "ours, cache" else ""
                rows.append(f"| {name} | {precision} | {decoder} | {len(sources) / seconds:.1f} | "
                            f"{n / seconds:.0f} | {ratio} | {score} |")  # fmt: skip
                print(rows[-1], flush=True)
    if args.write:
        record(
            "bench_decode",
            "Decoding (`python scripts/bench_decode.py --ckpt CKPT --write`)",
            f": the first {len(sources)} sentences of `{split}` "
            f"({data.src}->{data.tgt}), checkpoint `{args.ckpt}` (model {translator.model_config.d_model}-d, "
            f"{translator.model_config.n_encoder_layers}+{translator.model_config.n_decoder_layers} layers), "
            f"length-sorted batches of up to 8,192 source tokens; median of {args.reps} passes with the cache "
            "(and of MarianMT generate, randomly initialised with the same dimensions, decoding as many steps per "
            "batch as ours), one without; CTranslate2 on exported folders (the same search settings and max-length "
            "rule, as many threads), under precision 32 whatever the folder's compute type. Target tokens: each "
            "decoder's hypotheses', with EOS (MarianMT: ours). BLEU: sacreBLEU, cased, 13a.\n\n" + "\n".join(rows),
        )


if __name__ == "__main__":
    main()
