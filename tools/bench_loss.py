"""The output layer and label-smoothed loss of a training step, forward and both gradients, at the recipe's shapes
(a Multi30k batch's target tokens x the 8,000-piece vocabulary, d_model 256 and 512): the fused piece with inductor's
loss kernel (what a CPU trains with), the same with the eager kernel (before it), and the plain formulation (F.linear,
float32 logits, PyTorch's losses, autograd) as the peer; for the cross-entropy and for R-Drop's loss over two passes
(optim.rdrop_alpha). Then the small model's whole eager step with each, interleaved.

    python tools/bench_loss.py            # print the tables
    python tools/bench_loss.py --write    # and record them in docs/benchmarks.md

Run it alone, under jemalloc as training runs (LD_PRELOAD; the script restarts itself under it as training does).
"""

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common.machine import median_seconds
from common.report import record
from common.training import multi30k_batches, train_steps
from transformer.machine.allocator import restart_with_jemalloc
from transformer.model import ModelConfig, build_model
from transformer.model import cross_entropy as fused
from transformer.model.loss import batch_loss_sum, batch_source_layout, target_logits

TOKENS, VOCAB = 3600, 8000  # a recipe batch's real target tokens (max_tokens=4096, less padding and sources')
ALPHA = 5.0  # R-Drop's, as the candidate recipe's (optim.rdrop_alpha=5)


def kernel(name: str) -> None:
    """Which kernel the fused piece takes from now on: "eager ops" or "inductor's kernel"."""
    fused.eager_only = name == "eager ops"


def plain_rdrop(logits: torch.Tensor, labels: torch.Tensor, smoothing: float, alpha: float) -> torch.Tensor:
    """R-Drop's loss as it was trained before the fused piece: float32 logits of both passes (2N, V), PyTorch's
    cross-entropy, log-softmax and KL divergence, autograd through them."""
    n = len(labels)
    ce = F.cross_entropy(logits, labels.repeat(2), label_smoothing=smoothing, reduction="sum")
    log_p = F.log_softmax(logits, dim=-1)
    one, two = log_p[:n], log_p[n:]  # (N, V) each
    kl = F.kl_div(two, one, log_target=True, reduction="sum") + F.kl_div(one, two, log_target=True, reduction="sum")
    return ce / 2 + alpha / 4 * kl


def loss_rows(repeats: int) -> list[str]:
    rows = ["| loss | d_model | fused, inductor's kernel (ms) | fused, eager ops (ms) | plain (ms) | inductor's vs eager "
            "ops | inductor's vs plain |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    labels = torch.randint(1, VOCAB, (TOKENS,))
    for loss, passes, alpha in (("cross-entropy", 1, None), ("R-Drop", 2, ALPHA)):
        for d in (256, 512):
            x = torch.randn(passes * TOKENS, d, requires_grad=True)
            w = (torch.randn(VOCAB, d) * d**-0.5).requires_grad_()

            def fused_step():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    total = fused.linear_cross_entropy(x, w, labels, 0.1, 0, rdrop_alpha=alpha)
                total.backward()

            def plain_step():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = F.linear(x, w).float()
                if alpha is None:
                    F.cross_entropy(logits, labels, ignore_index=0, label_smoothing=0.1, reduction="sum").backward()
                else:
                    plain_rdrop(logits, labels, 0.1, alpha).backward()

            seconds = {}
            for name in ("inductor's kernel", "eager ops"):
                kernel(name)
                seconds[name] = median_seconds(fused_step, repeats, warmup=2)
            seconds["plain"] = median_seconds(plain_step, repeats, warmup=2)
            ours, eager, plain = seconds["inductor's kernel"], seconds["eager ops"], seconds["plain"]
            rows.append(f"| {loss} | {d} | {1e3 * ours:.1f} | {1e3 * eager:.1f} | {1e3 * plain:.1f} | "
                        f"{eager / ours:.2f}x | {plain / ours:.2f}x |")  # fmt: skip
    kernel("inductor's kernel")
    return rows


def rdrop_steps(model, optimizer, batches: list[dict], formulation: str) -> tuple[float, int]:
    """Seconds and target tokens of R-Drop training steps (bf16 autocast) with the fused piece or the plain loss."""
    start, tokens = time.perf_counter(), 0
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if formulation == "fused":
                loss, _ = batch_loss_sum(model, batch, 0.1, ALPHA)
            else:
                doubled = [batch[k].repeat(2, 1) for k in ("src", "tgt_in", "tgt_out")]  # (2B, S), (2B, T) x 2
                layout = batch_source_layout(model, batch, copies=2)
                logits, targets = target_logits(model, *doubled, layout, 2 * batch["tgt_tokens"])  # no host sync
                loss = plain_rdrop(logits, targets[: batch["tgt_tokens"]], 0.1, ALPHA)
        optimizer.zero_grad(set_to_none=True)
        (loss / batch["tgt_tokens"]).backward()
        optimizer.step()
        tokens += batch["tgt_tokens"]
    return time.perf_counter() - start, tokens


def step_rows(windows: int, per_window: int = 4) -> list[str]:
    batches, tok = multi30k_batches(3 + windows * per_window)
    cfg = ModelConfig.from_size("small", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size,
                                pad_id=tok.pad_id, dropout=0.2)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def cross_entropy_steps(b: list[dict]) -> tuple[float, int]:
        return train_steps(model, optimizer, b, "bf16", tok.pad_id)

    def rdrop(formulation: str) -> Callable[[list[dict]], tuple[float, int]]:
        return lambda b: rdrop_steps(model, optimizer, b, formulation)

    runners = {  # (loss, formulation) -> (the fused piece's kernel, batches -> (seconds, tokens))
        ("cross-entropy", "fused, inductor's kernel"): ("inductor's kernel", cross_entropy_steps),
        ("cross-entropy", "fused, eager ops"): ("eager ops", cross_entropy_steps),
        ("R-Drop", "fused, inductor's kernel"): ("inductor's kernel", rdrop("fused")),
        ("R-Drop", "plain"): ("inductor's kernel", rdrop("plain")),
    }
    for _, run in runners.values():
        run(batches[:3])
    rates = {name: [] for name in runners}
    for w in range(windows):  # interleaved, so that all see the same machine
        window = batches[3 + w * per_window : 3 + (w + 1) * per_window]
        for name, (kernel_name, run) in runners.items():
            kernel(kernel_name)
            seconds, tokens = run(window)
            rates[name].append(tokens / seconds)
    kernel("inductor's kernel")
    median = {name: statistics.median(r) for name, r in rates.items()}
    rows = ["| loss | formulation | target tok/s | vs the row below |", "|---|---|---:|---:|"]
    for (loss, ours), (_, peer) in ((("cross-entropy", "fused, inductor's kernel"), ("cross-entropy", "fused, eager ops")),
                                    (("R-Drop", "fused, inductor's kernel"), ("R-Drop", "plain"))):  # fmt: skip
        rows.append(f"| {loss} | {ours} | {median[loss, ours]:,.0f} | {median[loss, ours] / median[loss, peer]:.2f}x |")
        rows.append(f"| {loss} | {peer} | {median[loss, peer]:,.0f} | |")
    return rows


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
               f": bf16 autocast, {TOKENS:,} target tokens x {VOCAB:,} pieces (R-Drop: each in two passes), forward "
               f"and both gradients; median of {args.repeats} after two warm-up calls; under jemalloc. Plain: "
               "F.linear, logits copied to float32, F.cross_entropy (R-Drop: and F.log_softmax, two F.kl_div), "
               f"autograd. R-Drop's alpha {ALPHA:g}.\n\n" + "\n".join(loss) + "\n\nThe small model's eager bf16 "
               f"training step (Multi30k batches, dropout 0.2, fused AdamW), median of {args.windows} interleaved "
               "windows of 4 batches:\n\n" + "\n".join(step))  # fmt: skip


if __name__ == "__main__":
    main()
