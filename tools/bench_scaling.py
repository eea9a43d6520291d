"""How a training step's time and peak memory grow with sequence length and batch tokens, per attention kernel.

    python tools/bench_scaling.py                                 # small model, bf16, this machine's device
    python tools/bench_scaling.py --lengths 64 512 2048 --tokens 4096 16384 --write

Each point is one (sequence length T, batch tokens N, backend) training step of the model on random token ids,
N / T sentences of T source and T target tokens, in a fresh process: forward, loss, backward (no optimizer).
Every second source sentence is half padding, as in real batches, so encoder and cross attention get a padding
mask. Backends: each SDPA kernel the device offers (a forced kernel that refuses the mask fails), `auto` (the
model's default: SDPA's own choice, or matmul-softmax-matmul for short bf16 training on CPU), and `padding-free`
(nested jagged SDPA over real tokens). Memory is the peak resident set's growth on CPU,
torch.cuda.max_memory_allocated on a GPU. Run it alone.
"""

import argparse
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

from common.machine import machine
from common.memory import PeakGrowth, in_fresh_process, report
from common.report import record
from transformer.model import ModelConfig, RuntimeConfig, build_model


def backends(device: str) -> list[str]:
    kernels = ["math", "flash"] if device == "cpu" else ["math", "flash", "efficient", "cudnn"]
    return [*kernels, "auto", "padding-free"]


def one_point(size: str, length: int, tokens: int, backend: str, device: str, steps: int) -> tuple[float, float]:
    """(median step milliseconds, peak memory growth MiB) of one configuration, in this process."""
    torch.manual_seed(0)
    vocab, pad = 8000, 0
    cfg = ModelConfig.from_size(size, src_vocab_size=vocab, tgt_vocab_size=vocab, pad_id=pad,
                                max_positions=max(1024, length + 1))  # fmt: skip
    padding_free = backend == "padding-free"
    runtime = RuntimeConfig(padding_free_attention=True) if padding_free else RuntimeConfig(attention_backend=backend)
    model = build_model(cfg, runtime).to(device).train()
    batch = max(1, tokens // length)
    src = torch.randint(1, vocab, (batch, length), device=device)
    src[::2, length // 2 :] = pad
    tgt = torch.randint(1, vocab, (batch, length), device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16)
    cuda = device == "cuda"

    def step():
        with autocast:
            logits = model(src, tgt)
        F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten()).backward()
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()

    step()  # warm-up
    peak = PeakGrowth(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000, peak.mib()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--lengths", nargs="+", type=int, default=[64, 256, 1024, 2048])
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per point (median reported)")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # LENGTH TOKENS BACKEND DEVICE: a worker
    args = parser.parse_args()
    if args.one:
        length, tokens, backend, device = int(args.one[0]), int(args.one[1]), args.one[2], args.one[3]
        report(one_point(args.size, length, tokens, backend, device, args.steps))
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(machine())
    rows = [f"| T | batch tokens | {' | '.join(backends(device))} |", "|---:|---:|" + "---:|" * len(backends(device))]
    for tokens in args.tokens:
        for length in args.lengths:
            cells = []
            for backend in backends(device):
                worker = [__file__, "--size", args.size, "--steps", str(args.steps), "--one", str(length), str(tokens),
                          backend, device]  # fmt: skip
                try:
                    ms, mib = in_fresh_process(worker)
                except subprocess.CalledProcessError:
                    cells.append("fails")  # e.g. a kernel that does not take this shape on this device
                    continue
                cells.append(f"{ms:,.0f} ms, {mib:,.0f} MiB")
            rows.append(f"| {length} | {tokens:,} | {' | '.join(cells)} |")
            print(rows[-1], flush=True)
    if args.write:
        record(
            f"bench_scaling_{device}",
            f"Scaling on {device} (`python tools/bench_scaling.py --lengths {' '.join(map(str, args.lengths))} "
            f"--tokens {' '.join(map(str, args.tokens))} --steps {args.steps} --write`)",
            f": the {args.size} model, bf16 autocast, one training step (forward, loss, backward) on random ids, "
            f"batch tokens / T sentences of T source and T target tokens, every second source half padding; median of {args.steps} steps after a "
            "warm-up, each point in a fresh process. Memory: peak growth during the steps.\n\n" + "\n".join(rows),
        )


if __name__ == "__main__":
    main()
