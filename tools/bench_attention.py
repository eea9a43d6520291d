"""Forward+backward time of our MultiHeadAttention against torch.nn.MultiheadAttention and a naive
matmul/masked_fill/softmax/matmul module, for short and long batches, fp32 and bf16 autocast.

    python tools/bench_attention.py            # print the table
    python tools/bench_attention.py --write    # and record it in docs/benchmarks.md

Run it alone: another torch process on the same cores distorts every number.
"""

import argparse
import math
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from common.machine import machine
from common.report import BENCHMARKS, record
from transformer.model.attention import MultiHeadAttention
from transformer.model.kernels.explicit import explicit_attention, explicit_is_faster

SHAPES = {"short": dict(B=64, T=32, d=256, h=8), "long": dict(B=4, T=1024, d=512, h=8)}


class NaiveAttention(nn.Module):
    """The textbook module: four Linear layers, scores materialised, masked_fill, softmax, matmul."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.h, self.hs = h, d // h
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, allowed):  # allowed: (B|1, 1, T, T) or (B, 1, 1, T), True = may attend
        B, T, d = x.shape
        q, k, v = (
            proj(x).view(B, T, self.h, self.hs).transpose(1, 2) for proj in (self.q, self.k, self.v)
        )  # (B, nh, T, hs)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.hs)  # (B, nh, T, T)
        probs = F.softmax(scores.masked_fill(~allowed, -1e9), dim=-1)
        return self.out((probs @ v).transpose(1, 2).reshape(B, T, d))  # (B, T, d)


def make_calls(shape: dict, masking: str):
    B, T, d, h = shape["B"], shape["T"], shape["d"], shape["h"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, d, generator=g)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    lengths[0] = T
    padding = torch.arange(T)[None, :] >= lengths[:, None]  # (B, T), True = padding
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # True = may not attend
    ours, torch_mha, naive = (
        MultiHeadAttention(d, h),
        nn.MultiheadAttention(d, h, batch_first=True),
        NaiveAttention(d, h),
    )
    if masking == "padding":
        return x, {
            "ours": lambda x: ours(x, x, x, key_padding_mask=padding)[0],
            "nn.MultiheadAttention": lambda x: torch_mha(x, x, x, key_padding_mask=padding, need_weights=False)[0],
            "naive": lambda x: naive(x, ~padding[:, None, None, :]),
        }
    return x, {
        "ours": lambda x: ours(x, x, x, is_causal=True)[0],
        "nn.MultiheadAttention": lambda x: torch_mha(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0],
        "naive": lambda x: naive(x, ~causal[None, None]),
    }


def time_calls(x, calls: dict, precision: str, reps: int, iters: int) -> dict[str, float]:
    """Median seconds per forward+backward; implementations interleaved so drift hits all alike."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    x = x.clone().requires_grad_(True)

    def step(fn):
        with autocast:
            y = fn(x)
        y.float().sum().backward()

    samples = {name: [] for name in calls}
    for fn in calls.values():  # warm-up
        step(fn)
        step(fn)
    for _ in range(reps):
        for name, fn in calls.items():
            start = time.perf_counter()
            for _ in range(iters):
                step(fn)
            samples[name].append((time.perf_counter() - start) / iters)
    return {name: statistics.median(s) for name, s in samples.items()}


def kernel_table(reps: int) -> list[str]:
    """The attention core alone (no projections), per kernel: where CPU_EXPLICIT_MAX_KEYS comes from."""
    rows = ["| precision | keys T | batch | explicit ms | SDPA flash ms | SDPA math ms | chosen by auto |",
            "|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        for T in (16, 32, 64, 128, 256, 512, 1024):
            B, h, hs = 8192 // T, 4, 64  # 8,192 tokens per batch
            q, k, v = (torch.randn(B, h, T, hs, dtype=dtype, requires_grad=True) for _ in range(3))
            allowed = torch.arange(T)[None, :] < torch.randint(T // 2, T + 1, (B,))[:, None]
            allowed = allowed[:, None, None, :]  # (B, 1, 1, T), True = may attend
            blocked = ~allowed  # the explicit kernel's polarity

            def sdpa(backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

            calls = {
                "explicit": lambda _: explicit_attention(q, k, v, blocked, 0.0)[0],
                "flash": lambda _: sdpa(SDPBackend.FLASH_ATTENTION),
                "math": lambda _: sdpa(SDPBackend.MATH),
            }
            t = time_calls(torch.zeros(1), calls, "fp32", reps, 1)  # dtype set by q, k, v
            chosen = "explicit" if explicit_is_faster("cpu", dtype, True, T) else "SDPA"
            name = "bf16" if dtype == torch.bfloat16 else "fp32"
            rows.append(
                f"| {name} | {T} | {B} | {t['explicit'] * 1e3:.1f} | {t['flash'] * 1e3:.1f} | {t['math'] * 1e3:.1f} | {chosen} |"
            )
            print(rows[-1], flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timed windows per measurement (median reported)")
    parser.add_argument("--write", action="store_true", help=f"record the table in {BENCHMARKS}")
    args = parser.parse_args()

    rows = ["| shape | mask | precision | ours ms | nn.MHA ms | naive ms | ours vs nn.MHA | ours vs naive |",
            "|---|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    print(machine())
    for shape_name, shape in SHAPES.items():
        iters = 5 if shape_name == "short" else 1
        for masking in ("padding", "causal"):
            x, calls = make_calls(shape, masking)
            for precision in ("fp32", "bf16"):
                t = time_calls(x, calls, precision, args.reps, iters)
                label = f"{shape_name} (B={shape['B']}, T={shape['T']}, d={shape['d']}, h={shape['h']})"
                rows.append(
                    f"| {label} | {masking} | {precision} | {t['ours'] * 1e3:.1f} | {t['nn.MultiheadAttention'] * 1e3:.1f} | "
                    f"{t['naive'] * 1e3:.1f} | {t['nn.MultiheadAttention'] / t['ours']:.2f}x | {t['naive'] / t['ours']:.2f}x |"
                )
                print(rows[-1], flush=True)
    table = "\n".join(rows)
    kernels = "\n".join(kernel_table(args.reps))
    if args.write:
        record(
            "bench_attention",
            "Attention: forward+backward (`python tools/bench_attention.py --write`)",
            f"; median of {args.reps} timed windows after warm-up, "
            "all implementations interleaved in the same run. Ratios above 1x mean ours is faster.\n\n"
            f"The module (in-projection, attention, out-projection):\n\n{table}\n\n"
            "The attention core alone (no projections), 8,192 tokens a batch, 4 heads of 64, padding mask; "
            "this is what `backend=auto` chooses from on a CPU (`explicit_is_faster` in "
            f"`transformer/model/kernels/explicit.py`):\n\n{kernels}",
        )


if __name__ == "__main__":
    main()
