"""The optimizer step training takes (fused AdamW, one kernel per parameter group, step counts on the device) against
torch's default AdamW (for-each on a GPU; on a CPU one tensor at a time, reading each step count into Python), on
the same model and gradients.

    python tools/bench_optimizer.py            # the small and base models, print the table
    python tools/bench_optimizer.py --write    # and record it in docs/benchmarks.md
"""

import argparse
import statistics
import time

import torch

from common.machine import machine
from common.report import record
from transformer.model import ModelConfig, build_model


def step_ms(size: str, fused: bool | None, repeats: int) -> float:
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_size(size, src_vocab_size=8000, tgt_vocab_size=8000, pad_id=0))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    for _ in range(3):
        optimizer.step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    rows = []
    for size in ("small", "base"):
        default, fused = step_ms(size, None, args.repeats), step_ms(size, True, args.repeats)
        rows.append(f"| {size} | {default:.1f} | {fused:.1f} | {default / fused:.1f}x |")
        print(rows[-1], flush=True)
    table = "| model | AdamW default ms | fused ms | fused faster by |\n|---|---:|---:|---:|\n" + "\n".join(rows)
    print(machine())
    print(table)
    if args.write:
        record("bench_optimizer", "The optimizer step (`python tools/bench_optimizer.py --write`)",
               f": AdamW over the model's parameters with random gradients (8,000-token vocabulary), median of "
               f"{args.repeats} steps after 3, each configuration alone in turn.\n\n" + table)  # fmt: skip


if __name__ == "__main__":
    main()
