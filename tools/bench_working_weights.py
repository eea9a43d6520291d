"""bf16 working weights before building them (issue 55, point 2): the training step as it runs today (float32
parameters under bf16 autocast, which casts each weight once per forward and each activation where a bf16 matmul
reads a float32 one) against the scheme's upper bound: a bf16 copy of the model whose forward and backward run in
bf16 with no autocast (weights, activations, residual stream and layer norms' outputs all bf16; the loss and the
layer norms sum in float32 inside their kernels), float32 master weights stepped by the same fused AdamW from the
gradients cast up once per step, then copied into the bf16 weights.

    python tools/bench_working_weights.py            # small and base, eager and compiled: print the table
    python tools/bench_working_weights.py --write    # and record it in docs/benchmarks.md

Each pair of models trains on the same Multi30k batches in interleaved windows, after --warmup batches; before each
window (and the warm-up) the allocator's freed pages are purged and one untimed step trains (settled). What it
measures is speed only: whether bf16 activations train as well is a loss curve's question, asked once the speed
pays. Run it alone, under jemalloc as training runs (the script restarts itself under it as training does).
"""

import argparse
import copy
import gc

import torch

from common.machine import machine
from common.report import record
from common.training import interleaved_rates, multi30k_batches, settled
from transformer.data import SentencePiece
from transformer.machine.allocator import restart_with_jemalloc
from transformer.model import ModelConfig, build_model
from transformer.model.compiling import compile_dynamic

DROPOUT = 0.2  # the CPU recipe's


class MasterWeights:
    """An optimizer for a bf16 model: fused AdamW steps float32 master weights (copies of the float32 model it was
    made from), from the gradients cast up once per step, then copies them into the bf16 weights."""

    def __init__(self, bf16_model: torch.nn.Module, float32_model: torch.nn.Module):
        self.weights = list(bf16_model.parameters())
        self.masters = [p.detach().clone() for p in float32_model.parameters()]
        self.optimizer = torch.optim.AdamW(self.masters, lr=1e-4, fused=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The bf16 gradients dropped (set_to_none's only way here)."""
        for w in self.weights:
            w.grad = None

    def step(self) -> None:
        for master, w in zip(self.masters, self.weights, strict=True):
            master.grad = None if w.grad is None else w.grad.float()  # the one cast of a gradient per step
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_(self.weights, self.masters)  # the one cast of a weight per step
        for master in self.masters:
            master.grad = None  # not held through the next forward and backward, as zero_grad frees a real one's


def table_row(size: str, mode: str, batches: list[dict], tok: SentencePiece, warmup: int, windows: int,
              per_window: int) -> str:  # fmt: skip
    cfg = ModelConfig.from_size(size, src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size,
                                pad_id=tok.pad_id, dropout=DROPOUT)  # fmt: skip
    torch.manual_seed(0)
    autocast = build_model(cfg).train()
    autocast_optimizer = torch.optim.AdamW(autocast.parameters(), lr=1e-4, fused=True)
    working = copy.deepcopy(autocast).to(torch.bfloat16)
    master_weights = MasterWeights(working, autocast)
    if mode == "compiled":
        compile_dynamic(autocast)
        compile_dynamic(working)
    runners = {"autocast": settled(autocast, autocast_optimizer, "bf16", tok.pad_id),
               "working": settled(working, master_weights, "bf16-true", tok.pad_id)}  # fmt: skip
    _, rates = interleaved_rates(runners, batches, warmup, windows, per_window)
    today, candidate = rates["autocast"], rates["working"]
    return f"| {size} | {mode} | {today:,.0f} | {candidate:,.0f} | {candidate / today:.2f}x |"


def main() -> None:
    restart_with_jemalloc()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "base"])
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--warmup", type=int, default=6, help="batches each model trains on before timing")
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--batches", type=int, default=3, help="batches per window")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    print(machine())
    batches, tok = multi30k_batches(args.warmup + args.windows * args.batches)
    rows = ["| size | mode | autocast tok/s | bf16 working weights tok/s | working vs autocast |",
            "|---|---|---:|---:|---:|"]  # fmt: skip
    print("\n".join(rows), flush=True)
    for size in args.sizes:
        for mode in args.modes:
            rows.append(table_row(size, mode, batches, tok, args.warmup, args.windows, args.batches))
            print(rows[-1], flush=True)
            torch._dynamo.reset()  # its caches hold the compiled models: without this, base follows small's memory
            gc.collect()
    if args.write:
        record("bench_working_weights", "bf16 working weights (`python tools/bench_working_weights.py --write`)",
               f": the training step (Multi30k batches, forward, the project's loss, backward, fused AdamW, dropout "
               f"{DROPOUT}): float32 weights under bf16 autocast (today) against a bf16 model without autocast and "
               "float32 master weights (the scheme's upper bound: activations bf16 too); target tokens/s, median of "
               f"{args.windows} interleaved windows of {args.batches} batches after {args.warmup} warm-up ones; before "
               "each, jemalloc's freed pages purged and one untimed step.\n\n"
               + "\n".join(rows))  # fmt: skip


if __name__ == "__main__":
    main()
