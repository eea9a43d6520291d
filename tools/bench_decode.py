"""Decoding speed of a trained checkpoint on a test split: greedy and beam 5, with the key/value cache
and without it (every step re-reading the whole prefix), fp32 and bf16 autocast; against Hugging Face's
MarianMTModel.generate (its own cache) of the same dimensions, when the optional `bench` extra is installed; and
CTranslate2 on folders `python -m transformer.export` wrote (--export, float32 and int8 say); on 1 and 2 threads.
A randomly initialised MarianMTModel would not stop where a trained model stops, so it is made to decode
exactly as many steps per batch as our search needed for that batch (min_new_tokens = max_new_tokens), on the
same batches: both do the same number of decoder steps on the same shapes. Each row runs in a fresh process, so
that its peak memory (resident growth from before the model is loaded to the end of its timed passes) is its own.

    python tools/bench_decode.py --ckpt outputs/RUN/checkpoints/last.ckpt            # print the table
    python tools/bench_decode.py --ckpt RUN/checkpoints/average.pt --export RUN/export/float32 RUN/export/int8 --write

Run it alone: another torch process on the same cores distorts every number.
"""

import argparse
import contextlib
import gc
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from sacrebleu.metrics import BLEU

from common.machine import machine
from common.memory import PeakGrowth, in_fresh_process, report
from common.report import BENCHMARKS, record
from transformer.data import DataConfig, load_corpus
from transformer.translators import CheckpointTranslator, SearchConfig


def timed(run, todo, warm_up, reps: int):
    """(median seconds of run(todo) over reps, its last result), after run(warm_up)."""
    run(warm_up)
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        found = run(todo)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), found


def marian_run(translator: CheckpointTranslator, sources: list[list[int]], beam: int, precision: str):
    """A function timing MarianMTModel.generate over the batches our search decodes, each for as many steps as
    our longest hypothesis (with EOS) there; None without transformers."""
    from common.peers import MarianPeer

    tok, cfg, search = translator.src_tokenizer, translator.model_config, SearchConfig(beam_size=beam)
    try:
        peer = MarianPeer(cfg, tok.bos_id, tok.eos_id).model.eval()
    except ImportError:
        return None
    found = translator.search(sources, search, precision)
    inputs = [
        (src, max(len(found[i][0].tokens) for i in batch) + 1) for batch, src in translator.batches(sources, search)
    ]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()

    def run(todo):
        with torch.inference_mode(), autocast:
            for src, steps in todo:
                peer.generate(input_ids=src, attention_mask=src.ne(cfg.pad_id), num_beams=beam, do_sample=False,
                              min_new_tokens=steps, max_new_tokens=steps, use_cache=True)  # fmt: skip
        return [h[0].tokens for h in found]

    return lambda todo: run(inputs if todo is sources else inputs[:1])


def measure(args) -> dict:
    """One row, in this process: decoder (ours, ours-no-cache, marian, or a CTranslate2 folder), beam, precision,
    threads. Seconds (median), target tokens with EOS, BLEU, peak memory growth (MiB; none for MarianMT)."""
    decoder, beam, precision, threads = args.row[0], int(args.row[1]), args.row[2], int(args.row[3])
    torch.set_num_threads(threads)
    translator = CheckpointTranslator.from_path(args.ckpt)  # its tokenizers and data config; its model when timed
    data = DataConfig.from_dict(translator.data)
    pairs = load_corpus(data)[0][args.split or data.test_split]
    texts, references = list(pairs["src"])[: args.sentences], list(pairs["tgt"])[: args.sentences]
    sources = translator.src_tokenizer.encode(texts)
    search, reps, tgt = SearchConfig(beam_size=beam), args.reps, translator.tgt_tokenizer
    if decoder != "marian":  # the model is loaded again below, inside the measured memory
        del translator
        gc.collect()
    peak = PeakGrowth()
    if decoder in ("ours", "ours-no-cache"):
        ours = CheckpointTranslator.from_path(args.ckpt)
        search = replace(search, use_cache=decoder == "ours")
        reps = reps if search.use_cache else 1

        def run(todo):
            return [h[0].tokens for h in ours.search(todo, search, precision)]
    elif decoder == "marian":
        run = marian_run(translator, sources, beam, precision)
        if run is None:
            return {}
    else:
        from transformer.translators.ctranslate2 import CTranslate2Translator

        exported = CTranslate2Translator(decoder, threads=threads)

        def run(todo):
            return exported.searcher.best(todo, search)  # a shortlisted folder decodes with its shortlist

    seconds, found = timed(run, sources, sources[:16], reps)
    return {
        "seconds": seconds, "sentences": len(sources), "tokens": sum(len(h) + 1 for h in found),
        "bleu": None if decoder == "marian" else BLEU().corpus_score(tgt.decode(found), [references]).score,
        "peak_mib": None if decoder == "marian" else peak.mib(),
    }  # fmt: skip


def row_in_fresh_process(args, decoder: str, beam: int, precision: str, threads: int) -> dict:
    command = [__file__, "--ckpt", args.ckpt, "--sentences", str(args.sentences), "--reps", str(args.reps), "--row",
               decoder, str(beam), precision, str(threads)]  # fmt: skip
    if args.split:
        command += ["--split", args.split]
    return in_fresh_process(command)


def disk_mib(path: Path) -> float:
    return (path / "model.bin" if path.is_dir() else path).stat().st_size / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--split", default=None, help="default: the checkpoint's test split")
    parser.add_argument("--sentences", type=int, default=1000, help="first N sentences of the split")
    parser.add_argument("--reps", type=int, default=3, help="timed passes with the cache (median reported)")
    parser.add_argument("--export", nargs="*", default=[], help="CTranslate2 folders from transformer.export")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--write", action="store_true", help=f"record the table in {BENCHMARKS}")
    parser.add_argument("--row", nargs=4, help=argparse.SUPPRESS)  # internal: measure one row in this process
    args = parser.parse_args()
    if args.row:
        report(measure(args))
        return

    rows = [
        "| threads | search | precision | decoder | sentences/s | target tokens/s | ours (cache) faster by | BLEU "
        "| peak memory (MiB) | model on disk (MiB) |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    print(machine())
    for threads in args.threads:
        for beam in (1, 5):
            for precision in ("32", "bf16"):
                decoders = ["ours", "ours-no-cache", "marian"] + (args.export if precision == "32" else [])
                ours = None
                for decoder in decoders:
                    got = row_in_fresh_process(args, decoder, beam, precision, threads)
                    if not got:
                        continue
                    ours = ours or got["seconds"]
                    name = {"ours": "ours, cache", "ours-no-cache": "ours, no cache", "marian": "MarianMT generate"}
                    size = (
                        ""
                        if decoder == "marian"
                        else f"{disk_mib(Path(args.ckpt if 'ours' in decoder else decoder)):.1f}"
                    )
                    ratio = "" if decoder == "ours" else f"{got['seconds'] / ours:.2f}x"
                    bleu = "" if got["bleu"] is None else f"{got['bleu']:.2f}"
                    peak = "" if got["peak_mib"] is None else f"{got['peak_mib']:.0f}"
                    search = "greedy" if beam == 1 else f"beam {beam}"
                    rows.append(
                        f"| {threads} | {search} | {precision} | {name.get(decoder, f'CTranslate2 {Path(decoder).name}')} | "
                        f"{got['sentences'] / got['seconds']:.1f} | {got['tokens'] / got['seconds']:.0f} | {ratio} | "
                        f"{bleu} | {peak} | {size} |"
                    )
                    print(rows[-1], flush=True)
    if args.write:
        record(
            "bench_decode",
            "Decoding (`python tools/bench_decode.py --ckpt CKPT --export FOLDERS --write`)",
            f" (threads as in each row): the first {args.sentences} sentences of the checkpoint's test split, "
            f"checkpoint `{args.ckpt}`; length-sorted batches of up to 8,192 tokens (source tokens x beam size); "
            f"median of {args.reps} passes with the cache (and of MarianMT generate, randomly initialised with the "
            "same dimensions, decoding as many steps per batch as ours), one without; CTranslate2 on exported "
            "folders with the same search settings and max-length rule (its compute type is the folder's; it stops "
            "a sentence at beam_size finished hypotheses, ours searches on while a live one can still win, hence "
            "their beam BLEU differ; with early_stopping=true both decode alike). Target tokens: each decoder's "
            "hypotheses', with EOS (MarianMT: ours). BLEU: sacreBLEU, cased, 13a. Peak memory: resident growth "
            "from before the model is loaded to the end of the timed passes, each row in a fresh process. Model "
            "on disk: the checkpoint file (ours), model.bin (CTranslate2).\n\n" + "\n".join(rows),
        )


if __name__ == "__main__":
    main()
