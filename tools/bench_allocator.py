"""The Multi30k recipe's first training steps under glibc's malloc and under jemalloc (transformer.train restarts
itself with jemalloc when the machine has it), optionally with a larger oneDNN kernel cache.

    python tools/bench_allocator.py                              # 300 steps each: glibc, jemalloc
    python tools/bench_allocator.py --kernel-cache 8192 --write  # and each with 8192 cached kernels; record

Each setting is one `python -m transformer.train experiment=multi30k_de_en_cpu trainer.max_steps=N` (validation
loss only, no decoding) in a fresh process. Target tokens/s is the median of train/tokens_per_s over the steps
after the first 50; system time, page faults and peak memory are the process's. Run it alone.
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.machine import machine
from common.memory import in_fresh_process, report
from common.report import record
from transformer.machine.allocator import MALLOC_CONF, OPT_OUT, jemalloc_library

SKIPPED_STEPS = 50  # the first steps: warm-up, every kernel new


def train(allocator: str, kernel_cache: int | None, steps: int, folder: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF", OPT_OUT)}
    env[OPT_OUT] = "system" if allocator == "glibc" else "jemalloc"  # jemalloc: as if restarted, preloaded here
    if allocator == "jemalloc":
        env.update(LD_PRELOAD=jemalloc_library(), MALLOC_CONF=MALLOC_CONF)
    if kernel_cache:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(kernel_cache)
    command = [sys.executable, "-m", "transformer.train", "experiment=multi30k_de_en_cpu",
               f"trainer.max_steps={steps}", "validation.bleu_every=0", f"hydra.run.dir={folder}"]  # fmt: skip
    # through a process of its own, so that the resource usage of its children is this one training's
    wall, system, faults, rss_kib = in_fresh_process([__file__, "--measure", *command], env=env)
    events = EventAccumulator(str(next(folder.rglob("events.out.tfevents*"))), size_guidance={"scalars": 0})
    events.Reload()
    rates = [e.value for e in events.Scalars("train/tokens_per_s") if e.step >= SKIPPED_STEPS]
    return {
        "tok/s": statistics.median(rates),
        "wall": wall,
        "sys": system,
        "faults": faults,
        "rss_mib": rss_kib // 1024,
    }


def measure(command: list[str]) -> None:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    report([time.perf_counter() - start, usage.ru_stime, usage.ru_minflt, usage.ru_maxrss])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kernel-cache", type=int, help="also run each with ONEDNN_PRIMITIVE_CACHE_CAPACITY=N")
    parser.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    parser.add_argument("--measure", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        return measure(args.measure)
    if jemalloc_library() is None:
        sys.exit("error: no jemalloc on this machine; install it (apt install libjemalloc2) to compare")
    print(machine())
    caches = [None, args.kernel_cache] if args.kernel_cache else [None]
    settings = [(allocator, cache) for cache in caches for allocator in ("glibc", "jemalloc")]
    rows = ["| allocator | oneDNN kernels cached | target tok/s (median) | vs glibc | wall s | system CPU s "
            "| minor page faults | peak RSS MiB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    baseline = None
    with tempfile.TemporaryDirectory() as tmp:
        for i, (allocator, cache) in enumerate(settings):
            r = train(allocator, cache, args.steps, Path(tmp) / str(i))
            baseline = baseline or r["tok/s"]
            rows.append(f"| {allocator} | {cache or '1024 (default)'} | {r['tok/s']:,.0f} | "
                        f"{r['tok/s'] / baseline:.2f}x | {r['wall']:.0f} | {r['sys']:.0f} | {r['faults']:,} | "
                        f"{r['rss_mib']:,} |")  # fmt: skip
            print(rows[-1], flush=True)
    print("\n".join(rows))
    if args.write:
        command = " ".join(["python tools/bench_allocator.py", *sys.argv[1:]])
        body = (f": {args.steps} steps of `experiment=multi30k_de_en_cpu` per row, each in a fresh process "
                f"(jemalloc with MALLOC_CONF={MALLOC_CONF}); tokens/s after the first {SKIPPED_STEPS} steps; "
                "`vs glibc` against the first row.\n\n" + "\n".join(rows))  # fmt: skip
        record("allocator", f"Memory allocator (`{command}`)", body)


if __name__ == "__main__":
    main()
