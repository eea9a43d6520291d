"""Subword sampling's cost on a corpus's training pairs: our seeded draw from n-best lists computed once (or loaded
from their cache, as a resumed run or a second rank does), against sentencepiece's own sampler run afresh each epoch
(what transformer did before, and what BPE-dropout and data.nbest_size=-1 still do).

    python tools/bench_subword.py                   # Multi30k de->en as the default data config prepares it
    python tools/bench_subword.py --epochs 5 --write

Needs the prepared cache with texts (`python -m transformer.prepare data.sampling_alpha=0.1`). Both sides of every
pair are segmented, as one epoch of training does. Run it alone.
"""

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from common.machine import machine
from common.memory import PeakGrowth
from common.report import record
from transformer.data import DataConfig, TranslationDataModule
from transformer.data.batching import TokenDataset
from transformer.data.subword import load_tables, nbest_table, save_tables


def seconds(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--nbest", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3, help="epochs timed per row (the median is reported)")
    parser.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    args = parser.parse_args()

    cfg = DataConfig(sampling_alpha=args.alpha, nbest_size=args.nbest)
    dm = TranslationDataModule(cfg)
    dm.setup()
    train = dm.dataset(cfg.train_split)
    stored = TokenDataset(train)
    sides = [(list(train["src"]), dm.src_tokenizer, stored.src), (list(train["tgt"]), dm.tgt_tokenizer, stored.tgt)]
    peak = PeakGrowth()
    start = time.perf_counter()
    tables = [nbest_table(texts, tok, args.nbest, flat, cfg.max_length) for texts, tok, flat in sides]
    build = time.perf_counter() - start
    table_mib = sum(t.values.nbytes + t.offsets.nbytes + t.first.nbytes + t.scores.nbytes for t in tables) / 2**20
    grown = peak.mib()
    epoch = itertools.count()  # a new epoch's draw each time
    ours = seconds(lambda: [t.draw(args.alpha, np.random.default_rng([1, next(epoch)])) for t in tables], args.epochs)
    now = (
        "seeded draw, n-best lists computed (now)",
        build,
        statistics.median(ours),
        f"{table_mib:,.0f}",
        f"{grown:,.0f}",
    )
    rows = [now]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "nbest"
        save_tables(tables, folder)

        def load_and_draw():  # mapped lazily: the first draw reads the pages
            for table in load_tables(folder, len(train), args.nbest):
                table.draw(args.alpha, np.random.default_rng([1, 0]))

        loaded = statistics.median(seconds(load_and_draw, args.epochs))
    rows.append(
        ("seeded draw, n-best lists loaded from their cache (a resume, another rank)", loaded, now[2], now[3], "")
    )
    for nbest in (args.nbest, -1):
        theirs = seconds(lambda n=nbest: [tok.sample(texts, args.alpha, n) for texts, tok, _ in sides], args.epochs)
        rows.append((f"sentencepiece's sampler, nbest_size={nbest}", 0.0, statistics.median(theirs), "0", ""))

    pairs = len(train)
    lines = ["| sampling | once per run s | per epoch s (median) | per epoch vs now | n-best MiB | peak RSS grew MiB |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, once, per_epoch, mib, grew in rows:
        lines.append(f"| {name} | {once:.1f} | {per_epoch:.2f} | {per_epoch / rows[0][2]:.0f}x | {mib} | {grew} |")
    table = "\n".join(lines)
    print(f"{pairs:,} training pairs ({cfg.src}->{cfg.tgt}), alpha {args.alpha}, {args.epochs} epochs per row\n")
    print(table)
    if args.write:
        command = f"python tools/bench_subword.py --epochs {args.epochs} --write"
        body = (f": {pairs:,} Multi30k training pairs, both sides, alpha {args.alpha}, n-best {args.nbest}; the "
                f"median of {args.epochs} epochs per row.\n\n{table}\n")  # fmt: skip
        record("subword", f"Subword sampling per epoch (`{command}`)", body)
    print(f"\n{machine()}")


if __name__ == "__main__":
    main()
