"""Data at WMT size: prepare's time and memory, the training loader's throughput, the streaming loader's memory and
the time to the first training step, on a synthetic corpus of WMT14 en-de's size and shape
(tools/common/wmt_shaped.py: real pairs joined to WMT-like lengths; no WMT training set is reachable).

    python tools/bench_data.py prepare [--pairs 4500000] [--fresh] [--record]
    python tools/bench_data.py loader [--workers 0 1 2] [--batches 300] [--streaming] [--record]
    python tools/bench_data.py stream-rss [--stream-pairs 40000000 4500000] [--workers 0] [--batches 300] [--record]
    python tools/bench_data.py first-step [--model small] [--record]

Everything lives under --root (default /tmp/bench_data): the corpus in wmt-shaped-{pairs}-s{seed}/ (written once,
then reused), prepare's cache for it in cache/wmt-shaped-{pairs}-s{seed}/, encoded shards in
encoded-{pairs}-s{seed}/train/. loader and first-step need prepare's cache for the same --pairs, --seed and
--vocab-size. Each measurement runs in a fresh process. Peak memory, two ways: the process tree's proportional set
size (PSS: a page shared by n processes counts 1/n, so forked loader or map workers are not counted twice; shared
library pages are also shared with unrelated processes, which lowers it by up to their size), summed over the
process and all its descendants from /proc/*/smaps_rollup every 0.1 s; and, exactly, the largest single process's
peak resident set over its life (wait4's ru_maxrss). Run it alone.
"""

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytorch_lightning as pl

from common.report import record
from common.wmt_shaped import (
    SOURCES,
    format_length_stats,
    read_manifest,
    write_encoded_shards,
    write_wmt_shaped,
)

REPO = Path(__file__).resolve().parents[1]

FEED_TARGET = 300_000  # target tokens/s one H200 trains `base` at (docs/scaling.md's estimate)
CLOCK = "bench_data first step done at"  # FirstStepClock's line: seconds since the epoch


# Measuring a process tree


@dataclasses.dataclass
class Measured:
    wall_s: float
    peak_pss_mib: float  # the tree's, sampled
    peak_anon_mib: float  # the tree's anonymous part of it (not the memory-mapped Arrow pages the kernel can drop)
    max_rss_mib: float  # the largest single process's peak, exact
    output: str  # stdout and stderr, interleaved


def _tree(root: int) -> list[int]:
    """root and its descendants, from every process's parent id."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended meanwhile
            continue
        ppid = int(text[text.rindex(")") + 2 :].split()[1])  # after the command name, which may hold spaces
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _pss_kib(pid: int) -> tuple[int, int]:
    """(PSS, its anonymous part) of a process, KiB."""
    found = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(("Pss:", "Pss_Anon:")):
                found[line.split(":")[0]] = int(line.split()[1])
    except (OSError, ValueError):
        pass
    return found.get("Pss", 0), found.get("Pss_Anon", 0)


def run_measured(cmd: list[str], env: dict | None = None, echo: bool = False) -> Measured:
    """Run cmd to its end in a fresh process; its wall time and peak memory, its tree's included."""
    with tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **(env or {})})
        peak = peak_anon = 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # wait4, not poll(): it gives the child's rusage
            if pid:
                break
            sizes = [_pss_kib(p) for p in _tree(proc.pid)]
            peak, peak_anon = max(peak, sum(s[0] for s in sizes)), max(peak_anon, sum(s[1] for s in sizes))
            time.sleep(0.1)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        output = out.read()
    if echo or proc.returncode:
        print(output, end="")
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} ... exited with {proc.returncode}")
    return Measured(wall, peak / 1024, peak_anon / 1024, usage.ru_maxrss / 1024, output)


def _child_result(output: str) -> dict:
    """The JSON line a child of this script prints last."""
    return json.loads(next(line for line in reversed(output.splitlines()) if line.startswith("{")))


# What the measurements share


def corpus_folder(args) -> Path:
    """The WMT-shaped corpus for --pairs and --seed: written once, reused after."""
    folder = args.root / f"wmt-shaped-{args.pairs}-s{args.seed}"
    manifest = read_manifest(folder)
    if manifest is not None and (manifest["pairs"], manifest["seed"]) == (args.pairs, args.seed):
        print(f"corpus {folder} (reused): {format_length_stats(manifest['stats'])}")
        return folder
    start = time.perf_counter()
    stats = write_wmt_shaped(folder, args.pairs, args.seed, sources=args.sources)
    print(f"corpus {folder} written in {time.perf_counter() - start:.0f} s: {format_length_stats(stats)}")
    return folder


def data_fields(args, folder: Path) -> dict:
    """The data config every measurement uses (prepare's, so that they all find the same cache)."""
    return {"path": str(folder), "cache_dir": str(cache_dir(args, folder)), "vocab_size": args.vocab_size,
            "valid_split": "val", "test_split": "test"}  # fmt: skip


def overrides(fields: dict) -> list[str]:
    return [f"data.{k}={v}" for k, v in fields.items()]


def cache_dir(args, folder: Path) -> Path:
    """The corpus's own cache folder (its text tables, tokenizers and encoded splits): --fresh empties it."""
    return args.root / "cache" / folder.name


def require_cache(args, folder: Path) -> None:
    if not cache_dir(args, folder).is_dir():
        raise SystemExit(f"no prepared cache {cache_dir(args, folder)}; run "
                         f"`python tools/bench_data.py prepare --pairs {args.pairs}` first")  # fmt: skip


def mib(x: float) -> str:
    return f"{x:,.0f}"


def secs(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:,.0f}"


def report(args, name: str, heading: str, description: str, header: str, rows: list[str]) -> None:
    cells = [row.strip("| ").split(" | ") for row in rows]

    def numeric(cell: str) -> bool:
        return cell.replace(",", "").replace(".", "").removesuffix("x").isdigit()

    align = "|".join("---:" if all(numeric(c[i]) for c in cells) else "---" for i in range(len(cells[0])))
    table = f"{header}\n|{align}|\n" + "\n".join(rows)
    print("\n" + table)
    if args.record:
        command = " ".join(["python tools/bench_data.py", *sys.argv[1:]])
        record(f"bench_data_{name}", f"{heading} (`{command}`)", f": {description}\n\n{table}")


# prepare


def bench_prepare(args) -> None:
    """With --fresh: a cold prepare from an empty cache, then one that finds it all; without: the latter only."""
    folder = corpus_folder(args)
    fields = data_fields(args, folder)
    if args.fresh:
        shutil.rmtree(cache_dir(args, folder), ignore_errors=True)
    shape = format_length_stats(read_manifest(folder)["stats"])
    rows = []
    for _ in range(2 if args.fresh else 1):
        run = run_measured([sys.executable, "-m", "transformer.prepare", *overrides(fields)], echo=True)
        state = "reused" if "(reused)" in run.output else "built"  # prepare's report says which
        rows.append(f"| {args.pairs:,} | {args.vocab_size} | {state} | {secs(run.wall_s)} | {mib(run.peak_pss_mib)} | "
                    f"{mib(run.peak_anon_mib)} | {mib(run.max_rss_mib)} | {os.cpu_count()} |")  # fmt: skip
    report(
        args, "prepare", "Preparing a WMT-sized corpus",
        f"`python -m transformer.prepare` on the synthetic WMT14-shaped corpus ({shape}), gzipped text; built: "
        "tokenizer trained and every split encoded (with --fresh from an empty cache), reused: all of it found in "
        "the cache. Wall time of the whole process; peak memory of its process tree (PSS, worker processes "
        "included) and of its largest process (peak RSS).",
        "| pairs | vocabulary | cache | wall s | peak tree PSS MiB | of it anonymous MiB | largest process peak RSS MiB "
        "| CPUs |",
        rows,
    )  # fmt: skip


# loader


def loader_child(spec: dict) -> None:
    """In a fresh process: set up the data module from the cache, then time its training loader."""
    from transformer.data import DataConfig, TranslationDataModule
    from transformer.machine.allocator import status_kib

    start = time.perf_counter()
    data = TranslationDataModule(DataConfig(**spec["data"]))
    data.setup()
    setup_s, setup_rss = time.perf_counter() - start, status_kib("VmRSS")
    start = time.perf_counter()
    loader = data.train_dataloader()
    if spec["data"].get("streaming") and type(loader.dataset).__name__ != "StreamingBatches":  # not the other one
        raise SystemExit("data.streaming=true, but the data module's training loader does not stream yet")

    def forever():  # a small corpus's epoch may end before the count
        while True:
            yield from loader

    batches = forever()
    next(batches)
    first_s = time.perf_counter() - start
    for _ in range(spec["warmup"]):
        next(batches)
    start, tokens = time.perf_counter(), 0
    for _ in range(spec["batches"]):
        tokens += next(batches)["tgt_tokens"]
    seconds = time.perf_counter() - start
    print(json.dumps({"setup_s": setup_s, "first_batch_s": first_s, "batches_per_s": spec["batches"] / seconds,
                      "tokens_per_s": tokens / seconds, "setup_rss_mib": setup_rss / 1024}))  # fmt: skip


def bench_loader(args) -> None:
    from transformer.data import DataConfig

    if args.streaming:
        if "streaming" not in {f.name for f in dataclasses.fields(DataConfig)}:
            raise SystemExit("--streaming: DataConfig has no `streaming` field yet (the lead is adding it)")
    folder = corpus_folder(args)
    require_cache(args, folder)
    rows, rates = [], {}
    for workers in args.workers:
        fields = {**data_fields(args, folder), "num_workers": workers, "max_tokens": args.max_tokens}
        if args.streaming:
            fields["streaming"] = True
        spec = {"data": fields, "warmup": args.warmup, "batches": args.batches}
        run = run_measured([sys.executable, __file__, "--loader-child", json.dumps(spec)])
        r = _child_result(run.output)
        rates[workers] = r["tokens_per_s"]
        rows.append(
            f"| {'streaming' if args.streaming else 'in memory'} | {workers} | {secs(r['setup_s'])} | "
            f"{secs(r['first_batch_s'])} | {r['batches_per_s']:,.1f} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s'] / FEED_TARGET:.2f}x | {mib(r['setup_rss_mib'])} | {mib(run.peak_pss_mib)} | "
            f"{mib(run.peak_anon_mib)} | {mib(run.max_rss_mib)} |"
        )
        print(rows[-1], flush=True)
    best = max(rates, key=rates.get)
    verdict = "feeds" if rates[best] >= FEED_TARGET else "does not feed"
    print(f"one H200 training base at {FEED_TARGET:,} target tok/s: the loader makes {rates[best] / FEED_TARGET:.2f}x"
          f" that with {best} workers, so it {verdict} it")  # fmt: skip
    report(
        args, "loader" + ("_streaming" if args.streaming else ""), "Training loader at WMT size",
        f"the data module's training loader alone over the prepared {args.pairs:,}-pair WMT14-shaped corpus "
        f"(max_tokens={args.max_tokens}), each worker count in a fresh process: setup (cache found, splits "
        "loaded), the first batch (from there: the loader built, the epoch's batch list, workers started), then "
        f"{args.batches} batches timed after {args.warmup} more. Target tokens exclude padding. The ratio is "
        f"against {FEED_TARGET:,} target tokens/s, what one H200 trains `base` at (docs/scaling.md's estimate): "
        "1x or more keeps it fed; with 0 workers the batches are built in the training process between steps, "
        "which then spends 1/ratio of its time on them. Memory: resident after setup; the peak of the process "
        "tree (PSS, workers included); the largest process's peak RSS.",
        "| loader | workers | setup s | first batch s | batches/s | target tok/s | vs 300k tok/s | "
        "RSS after setup MiB | peak tree PSS MiB | of it anonymous MiB | largest process peak RSS MiB |",
        rows,
    )  # fmt: skip


# stream-rss


def streaming_batches(split: Path, spec: dict):
    """The streaming loader over one encoded split's shards, as training builds it for one corpus, read through a
    DataLoader with spec["workers"] workers (0: in this process). The one place to adapt when its interface moves."""
    from torch.utils.data import DataLoader

    from transformer.data.batching import Collate
    from transformer.data.streaming import StreamingBatches

    stream = StreamingBatches(
        [sorted(split.glob("data-*.arrow"))], [1.0], max_tokens=spec["max_tokens"], buffer_pairs=spec["buffer_pairs"],
        batches_per_worker=spec["batches"] + 1, collate=Collate(pad_id=0, bos_id=2, eos_id=3), seed=spec["seed"],
    )  # fmt: skip
    return DataLoader(stream, batch_size=None, num_workers=spec["workers"])


def stream_child(spec: dict) -> None:
    from transformer.machine.allocator import status_kib

    before = status_kib("VmRSS")
    start = time.perf_counter()
    batches = iter(streaming_batches(Path(spec["split"]), spec))
    next(batches)
    first_s = time.perf_counter() - start
    start, tokens = time.perf_counter(), 0
    for _ in range(spec["batches"]):
        tokens += next(batches)["tgt_tokens"]
    seconds = time.perf_counter() - start
    print(json.dumps({"first_batch_s": first_s, "tokens_per_s": tokens / seconds, "before_mib": before / 1024,
                      "hwm_mib": status_kib("VmHWM") / 1024}))  # fmt: skip


def encoded_split(args, pairs: int) -> Path:
    """Encoded shards of `pairs` WMT-shaped pairs, ROOT/encoded-{pairs}-s{seed}/train: written once, reused after."""
    split = args.root / f"encoded-{pairs}-s{args.seed}" / "train"
    manifest = read_manifest(split)
    wanted = {"pairs": pairs, "shard_pairs": args.shard_pairs, "seed": args.seed, "vocab_size": args.vocab_size,
              "tokens_per_word": args.tokens_per_word}  # fmt: skip
    if manifest is not None and all(manifest.get(k) == v for k, v in wanted.items()):
        print(f"shards {split} (reused): {format_length_stats(manifest['stats'], 'tokens')}")
        return split
    start = time.perf_counter()
    stats = write_encoded_shards(split, pairs, args.shard_pairs, args.seed, args.vocab_size, args.tokens_per_word,
                                 args.sources)  # fmt: skip
    (split.parent / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))  # load_from_disk(parent)
    print(f"shards {split} written in {time.perf_counter() - start:.0f} s: {format_length_stats(stats, 'tokens')}")
    return split


def bench_stream_rss(args) -> None:
    rows = []
    for pairs in args.stream_pairs:
        split = encoded_split(args, pairs)
        spec = {"split": str(split), "max_tokens": args.max_tokens, "buffer_pairs": args.buffer_pairs,
                "seed": args.seed, "batches": args.batches, "workers": args.workers}  # fmt: skip
        run = run_measured([sys.executable, __file__, "--stream-child", json.dumps(spec)])
        r = _child_result(run.output)
        shards = len(list(split.glob("data-*.arrow")))
        rows.append(
            f"| {pairs:,} | {shards} | {args.buffer_pairs:,} | {args.workers} | {secs(r['first_batch_s'])} | "
            f"{r['tokens_per_s']:,.0f} | {mib(r['before_mib'])} | {mib(r['hwm_mib'])} | {mib(run.peak_pss_mib)} | "
            f"{mib(run.peak_anon_mib)} | {mib(run.max_rss_mib)} |"
        )
        print(rows[-1], flush=True)
    report(
        args, "stream_rss", "Streaming loader memory at WMT size and beyond",
        "the streaming loader (transformer/data/streaming.py) over synthetic encoded shards (random ids, "
        f"WMT14-shaped lengths: the text's words x {args.tokens_per_word}, {args.shard_pairs:,} pairs a shard), each "
        "size in a fresh process: the first batch (the shards' index read, the first buffer filled), "
        f"then {args.batches} batches (max_tokens={args.max_tokens}), read through a DataLoader. Memory should not "
        "grow with the corpus: resident before the loader, the main process's peak, the tree's peak PSS (workers "
        "included) and the largest process's peak RSS.",
        "| pairs | shards | buffer pairs | workers | first batch s | target tok/s | RSS before MiB | peak RSS MiB | "
        "peak tree PSS MiB | of it anonymous MiB | largest process peak RSS MiB |",
        rows,
    )  # fmt: skip


# first-step


class FirstStepClock(pl.Callback):
    """Added to the timed training run (+callbacks.first_step_clock._target_=bench_data.FirstStepClock): prints when
    the first training step has ended."""

    def __init__(self):
        self.done = False

    def on_train_batch_end(self, trainer, *args) -> None:
        if not self.done:
            self.done = True
            print(f"\n{CLOCK} {time.time():.3f}", flush=True)  # a new line: the progress bar's has no end


def bench_first_step(args) -> None:
    folder = corpus_folder(args)
    require_cache(args, folder)
    fields = {**data_fields(args, folder), "max_tokens": args.max_tokens}
    run_dir = args.root / "runs" / f"first-step-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = [sys.executable, "-m", "transformer.train", *overrides(fields), f"model={args.model}",
           "trainer.max_steps=1", "trainer.num_sanity_val_steps=0", "trainer.limit_val_batches=0", "~logger",
           "+callbacks.first_step_clock._target_=bench_data.FirstStepClock", f"hydra.run.dir={run_dir}",
           *args.train_overrides]  # fmt: skip
    path = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")])
    )  # the callback's
    started = time.time()
    run = run_measured(cmd, env={"PYTHONPATH": path})
    clock = re.search(re.escape(CLOCK) + r" ([\d.]+)", run.output)
    first = secs(float(clock.group(1)) - started) if clock else "n/a"
    row = (f"| {args.pairs:,} | {args.model} | {args.max_tokens} | {first} | {secs(run.wall_s)} | "
           f"{mib(run.peak_pss_mib)} | {mib(run.peak_anon_mib)} | {mib(run.max_rss_mib)} |")  # fmt: skip
    print(row)
    report(
        args, "first_step", "Time to the first training step at WMT size",
        f"`python -m transformer.train` on the prepared {args.pairs:,}-pair WMT14-shaped corpus (cache built), "
        f"model {args.model}, one training step (trainer.max_steps=1, no sanity validation, no validation, no "
        "logger): seconds from starting the process to the end of the first step (a callback's clock), and to "
        "the process's exit (the last checkpoint written); peak memory of the process tree (PSS) and its largest "
        "process (peak RSS).",
        "| pairs | model | max_tokens | first step s | exit s | peak tree PSS MiB | of it anonymous MiB | "
        "largest process peak RSS MiB |",
        [row],
    )  # fmt: skip


# Command line


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] in ("--loader-child", "--stream-child"):  # a measured child process
        return (loader_child if sys.argv[1] == "--loader-child" else stream_child)(json.loads(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", type=Path, default=Path("/tmp/bench_data"), help="corpora, cache and runs")
    common.add_argument("--pairs", type=int, default=4_500_000, help="training pairs of the text corpus")
    common.add_argument("--seed", type=int, default=0, help="the corpus's seed")
    common.add_argument("--sources", type=Path, default=SOURCES, help="the real corpora the pieces come from")
    common.add_argument("--vocab-size", type=int, default=32000)
    common.add_argument("--max-tokens", type=int, default=8192, help="padded tokens a batch (the GPU recipe's)")
    common.add_argument("--record", "--write", action="store_true", help="record the table in docs/benchmarks.md")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", parents=[common], help="time python -m transformer.prepare")
    p.add_argument("--fresh", action="store_true", help="delete this corpus's caches first: a cold prepare")
    p = sub.add_parser("loader", parents=[common], help="the training loader's target tokens/s")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--batches", type=int, default=300, help="timed batches")
    p.add_argument("--warmup", type=int, default=20, help="batches after the first, before timing")
    p.add_argument("--streaming", action="store_true", help="data.streaming=true")
    p = sub.add_parser("stream-rss", parents=[common], help="the streaming loader's peak memory")
    p.add_argument("--stream-pairs", type=int, nargs="+", default=[40_000_000, 4_500_000])
    p.add_argument("--shard-pairs", type=int, default=1_000_000, help="pairs an encoded shard")
    p.add_argument("--buffer-pairs", type=int, default=100_000, help="the streaming loader's buffer")
    p.add_argument("--workers", type=int, default=0, help="loader worker processes")
    p.add_argument(
        "--tokens-per-word",
        type=float,
        default=1.0,
        help="shard lengths: the text's words times this (prepare's report: its token mean / word mean)",
    )
    p.add_argument("--batches", type=int, default=300)
    p = sub.add_parser("first-step", parents=[common], help="process start to the first training step")
    p.add_argument("--model", default="small")
    p.add_argument("train_overrides", nargs="*", help="more overrides for transformer.train, e.g. trainer.precision=32")
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    bench = {"prepare": bench_prepare, "loader": bench_loader, "stream-rss": bench_stream_rss,
             "first-step": bench_first_step}[args.command]  # fmt: skip
    try:
        bench(args)
    except ValueError as e:  # a folder in the way, a bad size: the message says what to do
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
