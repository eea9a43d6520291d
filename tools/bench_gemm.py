"""The training step's matrix products on this CPU (issue 55, point 4: GEMMs the matrix unit likes): the rate of
each linear-layer product of a model in the three layouts a step runs it (forward x @ W.t(), the input gradient
g @ W, the weight gradient g.t() @ x), and over a whole step's products at several tokens per batch, beside the
2048^3 rate; in the dtype trainer.precision=auto trains in here.

    python tools/bench_gemm.py                                   # small and base, print the tables
    python tools/bench_gemm.py --tokens 2048 4092 4096 8192 16384 --write

Run it alone: two torch processes on 2 cores slow each other 4-5x.
"""

import argparse

from common.gemm import LAYOUTS, model_dims, product_seconds, step_rate
from common.machine import machine, precision_dtype, square_gemm_rate
from common.report import record
from transformer.machine.allocator import restart_with_jemalloc
from transformer.machine.precision import measured_choice
from transformer.model import ModelConfig

VOCAB = 8000  # Multi30k's shared sentencepiece vocabulary


def main() -> None:
    restart_with_jemalloc()  # as training allocates
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "base"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[2048, 4092, 4096, 8192, 16384],
                        help="rows per product: target tokens per batch (4092 and 4096: alignment)")  # fmt: skip
    parser.add_argument("--layout-tokens", type=int, default=4096, help="rows of the per-layout table")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    precision, _ = measured_choice()  # what trainer.precision=auto trains in on this CPU
    dtype = precision_dtype(precision)
    square = square_gemm_rate(dtype)
    print(machine(), f"{precision}: 2048³ {square / 1e9:.0f} GFLOP/s")
    summary = ["| size | " + " | ".join(f"{t:,} tokens" for t in args.tokens) + " |",
               "|---|" + "---:|" * len(args.tokens)]  # fmt: skip
    layouts = ["| size | product (m x k x n, forward) | per step | " + " | ".join(LAYOUTS) + " |",
               "|---|---|---:|" + "---:|" * len(LAYOUTS)]  # fmt: skip
    for size in args.sizes:
        model = model_dims(ModelConfig.from_size(size, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, pad_id=0))
        timed = {t: product_seconds(model, t, dtype, repeats=5) for t in {*args.tokens, args.layout_tokens}}
        rates = [step_rate(timed[t]) for t in args.tokens]
        summary.append(f"| {size} | " + " | ".join(f"{r / 1e9:.0f} ({r / square:.0%})" for r in rates) + " |")
        print(summary[-1], flush=True)
        for (name, m, k, n, count), seconds in timed[args.layout_tokens]:
            cells = " | ".join(f"{2 * m * k * n / seconds[layout] / 1e9:.0f}" for layout in LAYOUTS)
            layouts.append(f"| {size} | {name} ({m} x {k} x {n}) | {count} | {cells} |")
            print(layouts[-1], flush=True)
    tables = ("GFLOP/s over a step's linear-layer products with their backward's two, each as often as a step has it "
              "(in parentheses: of the 2048³ rate):\n\n" + "\n".join(summary) +
              f"\n\nGFLOP/s of each product at {args.layout_tokens:,} tokens, by layout (nt: the forward, nn: the input "
              "gradient, tn: the weight gradient):\n\n" + "\n".join(layouts))  # fmt: skip
    print(tables)
    if args.write:
        record("bench_gemm", f"The step's matrix products (`python tools/bench_gemm.py --sizes {' '.join(args.sizes)} "
               f"--tokens {' '.join(map(str, args.tokens))} --layout-tokens {args.layout_tokens} --write`)",
               f": {precision} (trainer.precision=auto's choice here), {square / 1e9:.0f} GFLOP/s at 2048³; the "
               f"models' products at Multi30k's vocabulary ({VOCAB:,}), each the median of 5 after one untimed, "
               "written in place.\n\n" + tables)  # fmt: skip


if __name__ == "__main__":
    main()
