"""Decoding speed of a trained checkpoint on a test split: greedy and beam 5, with the key/value cache
and without it (every step re-reading the whole prefix), fp32 and bf16 autocast.

    python scripts/bench_decode.py --ckpt outputs/RUN/checkpoints/last.ckpt            # print the table
    python scripts/bench_decode.py --ckpt outputs/RUN/checkpoints/last.ckpt --write    # and record it

Run it alone: another torch process on the same cores distorts every number.
"""

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_attention import DOC, machine, record  # noqa: E402

from transformer.data import DataConfig, load_corpus  # noqa: E402
from transformer.inference import SearchConfig, Translator  # noqa: E402


def time_search(translator: Translator, sources: list[list[int]], search: SearchConfig, precision: str, reps: int):
    """(median seconds over reps, generated target tokens incl. EOS), after one warm-up batch."""
    translator.search(sources[:16], search, precision)
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        found = translator.search(sources, search, precision)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), sum(len(h[0].tokens) + 1 for h in found)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--split", default=None, help="default: the checkpoint's test split")
    parser.add_argument("--sentences", type=int, default=1000, help="first N sentences of the split")
    parser.add_argument("--reps", type=int, default=3, help="timed passes with the cache (median reported)")
    parser.add_argument("--write", action="store_true", help=f"record the table in {DOC}")
    args = parser.parse_args()

    translator = Translator.from_path(args.ckpt)
    data = DataConfig.from_dict(translator.data)
    split = args.split or data.test_split
    texts = list(load_corpus(data)[0][split]["src"])[: args.sentences]
    sources = translator.src_tokenizer.encode(texts)
    rows = [
        "| search | precision | cache | sentences/s | target tokens/s | cache speed-up |",
        "|---|---|---|---:|---:|---:|",
    ]
    print(machine())
    for beam in (1, 5):
        for precision in ("32", "bf16"):
            search = SearchConfig(beam_size=beam)
            cached, tokens = time_search(translator, sources, search, precision, args.reps)
            uncached, _ = time_search(translator, sources, replace(search, use_cache=False), precision, 1)
            name = "greedy" if beam == 1 else f"beam {beam}"
            for cache, seconds in (("yes", cached), ("no", uncached)):
                speedup = f"{uncached / cached:.2f}x" if cache == "yes" else ""
                rows.append(
                    f"| {name} | {precision} | {cache} | {len(sources) / seconds:.1f} | {tokens / seconds:.0f} | {speedup} |"
                )
                print(rows[-1], flush=True)
    if args.write:
        record(
            "bench_decode",
            "Decoding (`python scripts/bench_decode.py --ckpt CKPT --write`)",
            f": the first {len(sources)} sentences of `{split}` "
            f"({data.src}->{data.tgt}), checkpoint `{args.ckpt}` (model {translator.model_config.d_model}-d, "
            f"{translator.model_config.n_encoder_layers}+{translator.model_config.n_decoder_layers} layers), "
            f"length-sorted batches of up to 8,192 source tokens; median of {args.reps} passes with the cache, "
            "one without. Target tokens count the EOS.\n\n" + "\n".join(rows),
        )


if __name__ == "__main__":
    main()
