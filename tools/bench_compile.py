"""A compile=true training step against eager on Multi30k batches: graph breaks and recompiles of the compiled model
(compile_dynamic, as `python -m transformer.train compile=true` does) and target tokens/s.

    python tools/bench_compile.py            # small model, fp32 and bf16, print the table
    python tools/bench_compile.py --write    # and record it in docs/benchmarks.md

The compiled model first trains on --warmup batches (the first compiles, with dynamic shapes for the rest), then
both models train on the same batches in interleaved windows. Run it alone.
"""

import argparse
import copy
import statistics
import time

import torch
from torch._dynamo.utils import counters

from common.machine import machine
from common.report import record
from common.training import multi30k_batches, train_steps
from transformer.model import ModelConfig, build_model
from transformer.model.compiling import compile_dynamic


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--warmup", type=int, default=8, help="batches the compiled model trains on before timing")
    parser.add_argument("--windows", type=int, default=5, help="timed windows (median reported)")
    parser.add_argument("--batches", type=int, default=4, help="batches per window")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    batches, tok = multi30k_batches(args.warmup + args.windows * args.batches)
    cfg = ModelConfig.from_size(args.size, src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size,
                                pad_id=tok.pad_id)  # fmt: skip
    print(machine())
    rows = []
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        eager = build_model(cfg).train()
        compiled = copy.deepcopy(eager)
        compile_dynamic(compiled)  # as compile=true does
        optimizers = {m: torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (eager, compiled)}
        train_steps(eager, optimizers[eager], batches[:2], precision, tok.pad_id)  # its loss kernel's graphs too
        counters.clear()
        start = time.perf_counter()
        train_steps(compiled, optimizers[compiled], batches[: args.warmup], precision, tok.pad_id)
        warmup_s = time.perf_counter() - start
        rates = {eager: [], compiled: []}
        for w in range(args.windows):  # interleaved, so that both see the same machine load
            window = batches[args.warmup + w * args.batches : args.warmup + (w + 1) * args.batches]
            for model, optimizer in optimizers.items():
                seconds, tokens = train_steps(model, optimizer, window, precision, tok.pad_id)
                rates[model].append(tokens / seconds)
        breaks = sum(counters["graph_break"].values())
        graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
        eager_rate, compiled_rate = statistics.median(rates[eager]), statistics.median(rates[compiled])
        rows.append(f"| {args.size} | {precision} | {eager_rate:,.0f} | {compiled_rate:,.0f} | "
                    f"{compiled_rate / eager_rate:.2f}x | {breaks} | {graphs} | {recompiles} | {warmup_s:.0f} s |")  # fmt: skip
        print(rows[-1], flush=True)
    table = ("| size | precision | eager tok/s | compiled tok/s | compiled vs eager | graph breaks | graphs | "
             "recompiles | warm-up |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows))  # fmt: skip
    print(table)
    if args.write:
        record(
            "bench_compile",
            "Compiled training step (`python tools/bench_compile.py --write`)",
            f": Multi30k de-en, the first epoch's token batches (max_tokens=4096); the {args.size} model compiled by "
            "`compile_dynamic` (inductor, default mode), as `compile=true` does, against the same model "
            "eager; forward, the project's loss, backward and AdamW step, the batches described by the collator's "
            f"host facts. Graph breaks, graphs and recompiles: dynamo's counters over the {args.warmup} warm-up "
            f"batches and the timed ones (warm-up: their wall time, compiling included). Median of {args.windows} "
            f"interleaved windows of {args.batches} batches.\n\n" + table,
        )


if __name__ == "__main__":
    main()
