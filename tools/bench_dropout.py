"""The CPU dropout: ours (transformer/model/dropout.py: the mask drawn from the global generator) against a candidate
that hashes each element's index with a seed per call (tools/common/hashed_dropout.py) and torch's own, alone and in
the training step of each model size, eager and compiled: the step's time and a compiled model's cold warm-up.

    python tools/bench_dropout.py            # print the tables
    python tools/bench_dropout.py --write    # and record them in docs/benchmarks.md
    python tools/bench_dropout.py --sizes base   # the step of one size (default: small and base)

Alone: forward and backward at the recipe's shapes in bf16, on one thread and on all. The step: forward, the project's
loss, backward and AdamW step on Multi30k batches with the recipe's dropout (0.2), bf16 autocast; each pair of models
trains on the same batches in interleaved windows, after --warmup batches (a compiled model's graphs). Run it alone,
under jemalloc as training runs (the script restarts itself under it as training does).
"""

import argparse
import copy
import gc

import torch
import torch._inductor.config

from common.hashed_dropout import HashedDropout, with_hashed_dropout
from common.machine import machine, median_seconds
from common.report import record
from common.training import interleaved_rates, multi30k_batches, settled, train_steps
from transformer.machine.allocator import restart_with_jemalloc
from transformer.model import ModelConfig, build_model
from transformer.model.compiling import compile_dynamic
from transformer.model.dropout import Dropout

P = 0.2


def alone_rows(repeats: int, threads: int) -> list[str]:
    """Each shape on 1 thread and on `threads`: our mask is one serial generator's whatever the threads."""
    rows = ["| threads | shape | ours (ms) | hashed (ms) | torch's (ms) | hashed vs ours | ours vs torch's |",
            "|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        for shape in ((4096, 256), (4096, 1024)):
            x = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
            grad = torch.randn(shape, dtype=torch.bfloat16)
            seconds = {}
            for name, dropout in (("ours", Dropout(P)), ("hashed", HashedDropout(P)), ("torch's", torch.nn.Dropout(P))):
                dropout.train()
                seconds[name] = median_seconds(lambda: dropout(x).backward(grad), repeats, warmup=2)  # noqa: B023
            ours, hashed, torchs = seconds["ours"], seconds["hashed"], seconds["torch's"]
            rows.append(f"| {n} | {shape[0]} x {shape[1]} | {1e3 * ours:.2f} | {1e3 * hashed:.2f} | "
                        f"{1e3 * torchs:.2f} | {ours / hashed:.2f}x | {torchs / ours:.2f}x |")  # fmt: skip
    torch.set_num_threads(threads)
    return rows


def step_rows(sizes: list[str], warmup: int, windows: int, per_window: int) -> list[str]:
    batches, tok = multi30k_batches(warmup + windows * per_window)
    rows = ["| size | mode | ours tok/s | hashed tok/s | hashed vs ours | warm-up, ours | warm-up, hashed |",
            "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    torch._inductor.config.force_disable_caches = True  # the warm-up compiles from nothing, as a first run does
    for size, mode in ((size, mode) for size in sizes for mode in ("eager", "compiled")):
        torch._dynamo.reset()  # the last pair's graphs and the memory they hold
        gc.collect()
        cfg = ModelConfig.from_size(size, src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size,
                                    pad_id=tok.pad_id, dropout=P)  # fmt: skip
        torch.manual_seed(0)
        ours = build_model(cfg).train()
        hashed = with_hashed_dropout(copy.deepcopy(ours))
        if mode == "eager":  # the loss kernel's own compilation, which both models then share: on a throwaway copy
            throwaway = copy.deepcopy(ours)
            train_steps(throwaway, torch.optim.AdamW(throwaway.parameters()), batches[:1], "bf16", tok.pad_id)
        else:
            compile_dynamic(ours)
            compile_dynamic(hashed)
        runners = {name: settled(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), "bf16", tok.pad_id)
                   for name, model in (("ours", ours), ("hashed", hashed))}  # fmt: skip
        warmup_s, rates = interleaved_rates(runners, batches, warmup, windows, per_window)
        rate, candidate = rates["ours"], rates["hashed"]
        rows.append(f"| {size} | {mode} | {rate:,.0f} | {candidate:,.0f} | {candidate / rate:.2f}x | "
                    f"{warmup_s['ours']:.0f} s | {warmup_s['hashed']:.0f} s |")  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    restart_with_jemalloc()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "base"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=8, help="batches each model trains on before timing")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--batches", type=int, default=4, help="batches per window")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    print(machine())
    alone = alone_rows(args.repeats, torch.get_num_threads())
    print("\n".join(alone), flush=True)
    step = step_rows(args.sizes, args.warmup, args.windows, args.batches)
    print("\n".join(step))
    if args.write:
        sizes = " ".join(args.sizes)
        record("bench_dropout", f"The CPU dropout (`python tools/bench_dropout.py --sizes {sizes} --write`)",
               f": p = {P}, bf16. Alone: forward and backward on 1 thread and on all, median of {args.repeats} after two "
               "warm-up calls. "
               "Ours: 15-bit chunks of the global generator's serial draws, stored and saved; hashed: the candidate "
               "(each element's index hashed with a seed per call, in the kernel that applies the mask, again in "
               "backward); torch's: nn.Dropout. The training step of each size (Multi30k batches, forward, loss, "
               f"backward, fused AdamW, bf16 autocast), median of {args.windows} interleaved windows of "
               f"{args.batches} batches after {args.warmup} warm-up ones, whose seconds (inductor's caches off: "
               "compiling from nothing) are the warm-up columns; before each window, jemalloc's freed pages purged "
               "and one untimed step.\n\n" + "\n".join(alone) + "\n\n"
               + "\n".join(step))  # fmt: skip


if __name__ == "__main__":
    main()
