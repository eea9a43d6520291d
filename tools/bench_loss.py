"""The output layer and label-smoothed loss of a training step, forward and both gradients, at the recipe's shapes
(a Multi30k batch's target tokens x the 8,000-piece vocabulary, d_model 256 and 512): the fused piece with inductor's
loss kernel (what a CPU trains with), the same with the eager in-place kernel (before it), and the plain
formulation (F.linear, float32 logits, F.cross_entropy, autograd) as the peer; then the small model's whole eager
step with either kernel, interleaved.

    python tools/bench_loss.py            # print the tables
    python tools/bench_loss.py --write    # and record them in docs/benchmarks.md

Run it alone, under jemalloc as training runs (LD_PRELOAD; the script restarts itself under it as training does).
"""

import argparse
import statistics

import torch
import torch.nn.functional as F

from common.machine import median_seconds
from common.report import record
from common.training import multi30k_batches, train_steps
from transformer.machine.allocator import restart_with_jemalloc
from transformer.model import ModelConfig, build_model
from transformer.model import cross_entropy as fused

TOKENS, VOCAB = 3600, 8000  # a recipe batch's real target tokens (max_tokens=4096, less padding and sources')


def kernel(name: str) -> None:
    """Which kernel the fused piece takes from now on."""
    fused._compiled = False if name == "eager ops" else None


def loss_rows(repeats: int) -> list[str]:
    rows = ["| d_model | fused, inductor's kernel (ms) | fused, eager ops (ms) | plain (ms) | inductor's vs eager ops | "
            "inductor's vs plain |", "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    labels = torch.randint(1, VOCAB, (TOKENS,))
    for d in (256, 512):
        x = torch.randn(TOKENS, d, requires_grad=True)
        w = (torch.randn(VOCAB, d) * d**-0.5).requires_grad_()

        def fused_step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = fused.linear_cross_entropy(x, w, labels, 0.1, 0)
            loss.backward()

        def plain_step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = F.linear(x, w).float()
            F.cross_entropy(logits, labels, ignore_index=0, label_smoothing=0.1, reduction="sum").backward()

        seconds = {}
        for name in ("inductor's kernel", "eager ops"):
            kernel(name)
            seconds[name] = median_seconds(fused_step, repeats, warmup=2)
        seconds["plain"] = median_seconds(plain_step, repeats, warmup=2)
        ours, eager, plain = seconds["inductor's kernel"], seconds["eager ops"], seconds["plain"]
        rows.append(f"| {d} | {1e3 * ours:.1f} | {1e3 * eager:.1f} | {1e3 * plain:.1f} | {eager / ours:.2f}x | "
                    f"{plain / ours:.2f}x |")  # fmt: skip
    kernel("inductor's kernel")
    return rows


def step_rows(windows: int, per_window: int = 4) -> list[str]:
    batches, tok = multi30k_batches(3 + windows * per_window)
    cfg = ModelConfig.from_size("small", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size,
                                pad_id=tok.pad_id, dropout=0.2)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    train_steps(model, optimizer, batches[:3], "bf16", tok.pad_id)
    rates = {"inductor's kernel": [], "eager ops": []}
    for w in range(windows):  # interleaved, so that both see the same machine
        window = batches[3 + w * per_window : 3 + (w + 1) * per_window]
        for name in rates:
            kernel(name)
            seconds, tokens = train_steps(model, optimizer, window, "bf16", tok.pad_id)
            rates[name].append(tokens / seconds)
    kernel("inductor's kernel")
    ours, eager = (statistics.median(rates[k]) for k in rates)
    return ["| loss kernel | target tok/s | vs eager ops |", "|---|---:|---:|",
            f"| inductor's | {ours:,.0f} | {ours / eager:.2f}x |", f"| eager ops | {eager:,.0f} | |"]  # fmt: skip


def main() -> None:
    restart_with_jemalloc()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    loss, step = loss_rows(args.repeats), step_rows(args.windows)
    print("\n".join(loss) + "\n\n" + "\n".join(step))
    if args.write:
        record("bench_loss", "The output layer and loss (`python tools/bench_loss.py --write`)",
               f": bf16 autocast, {TOKENS:,} target tokens x {VOCAB:,} pieces, forward and both gradients; median of "
               f"{args.repeats} after two warm-up calls; under jemalloc. Plain: F.linear, logits copied to float32, "
               "F.cross_entropy, autograd.\n\n" + "\n".join(loss) + "\n\nThe small model's eager bf16 training step "
               f"(Multi30k batches, dropout 0.2, fused AdamW), median of {args.windows} interleaved windows of 4 "
               "batches:\n\n" + "\n".join(step))  # fmt: skip


if __name__ == "__main__":
    main()
