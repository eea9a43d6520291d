"""Training-step throughput on Multi30k token batches: this project's model against a plain torch.nn.Transformer
of the same dimensions, both trained by the same loop (label-smoothed loss, AdamW), fp32 and bf16 autocast.

    python scripts/bench_train.py                      # small model, print the table
    python scripts/bench_train.py --sizes small base --write   # and record it in docs/benchmarks.md

Both models see the identical padded batches (data.max_tokens=4096, the first epoch's order). Run it alone.
"""

import argparse
import math
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_attention import machine, record  # noqa: E402

from transformer.data import DataConfig, TranslationDataModule  # noqa: E402
from transformer.model import ModelConfig, build_model  # noqa: E402


class TorchTransformer(nn.Module):
    """The peer: torch.nn.Transformer (pre-LN, batch-first) with scaled embeddings, sinusoidal positions and a
    tied output layer, masks as PyTorch's translation tutorial builds them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.d, self.pad = cfg.d_model, cfg.pad_id
        self.embed = nn.Embedding(cfg.src_vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.transformer = nn.Transformer(
            cfg.d_model, cfg.n_heads, cfg.n_encoder_layers, cfg.n_decoder_layers, cfg.d_ff, cfg.dropout,
            batch_first=True, norm_first=True,
        )  # fmt: skip
        position = torch.arange(cfg.max_positions)[:, None]
        freq = torch.exp(torch.arange(0, cfg.d_model, 2) * (-math.log(10000.0) / cfg.d_model))
        pe = torch.zeros(cfg.max_positions, cfg.d_model)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(position * freq), torch.cos(position * freq)
        self.register_buffer("pe", pe)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, src, tgt):
        def embed(x):
            return self.dropout(self.embed(x) * math.sqrt(self.d) + self.pe[: x.size(1)])

        causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), dtype=torch.bool)
        out = self.transformer(
            embed(src), embed(tgt), tgt_mask=causal, src_key_padding_mask=src.eq(self.pad),
            tgt_key_padding_mask=tgt.eq(self.pad), memory_key_padding_mask=src.eq(self.pad),
        )  # fmt: skip
        return out @ self.embed.weight.T  # (B, T, V)


def train_steps(model, optimizer, batches, precision, pad):
    """Seconds for one optimizer step per batch, and the target tokens trained."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    start = time.perf_counter()
    tokens = 0
    for batch in batches:
        with autocast:
            logits = model(batch["src"], batch["tgt_in"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["tgt_out"].flatten(), ignore_index=pad,
                               label_smoothing=0.1)  # fmt: skip
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        tokens += int(batch["tgt_out"].ne(pad).sum())
    return time.perf_counter() - start, tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["small"])
    parser.add_argument("--windows", type=int, default=5, help="timed windows per configuration (median reported)")
    parser.add_argument("--batches", type=int, default=4, help="batches per window")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = TranslationDataModule(DataConfig())
    data.setup()
    loader = iter(data.train_dataloader())
    batches = [next(loader) for _ in range(args.batches * args.windows + 2)]
    tok = data.data.src_tokenizer
    rows = ["| size | precision | ours tgt tok/s | nn.Transformer tgt tok/s | ours vs nn.Transformer |",
            "|---|---|---:|---:|---:|"]  # fmt: skip
    print(machine())
    for size in args.sizes:
        cfg = ModelConfig.from_size(
            size, src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, pad_id=tok.pad_id
        )
        models = {"ours": build_model(cfg), "nn.Transformer": TorchTransformer(cfg)}
        for precision in ("fp32", "bf16"):
            optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
            for name, model in models.items():  # warm-up
                model.train()
                train_steps(model, optimizers[name], batches[:2], precision, tok.pad_id)
            rates = {name: [] for name in models}
            for w in range(args.windows):  # interleaved, so that both see the same machine load
                window = batches[2 + w * args.batches : 2 + (w + 1) * args.batches]
                for name, model in models.items():
                    seconds, tokens = train_steps(model, optimizers[name], window, precision, tok.pad_id)
                    rates[name].append(tokens / seconds)
            ours, peer = statistics.median(rates["ours"]), statistics.median(rates["nn.Transformer"])
            rows.append(f"| {size} | {precision} | {ours:.0f} | {peer:.0f} | {ours / peer:.2f}x |")
            print(rows[-1], flush=True)
    if args.write:
        record(
            "bench_train",
            f"Training step (`python scripts/bench_train.py --sizes {' '.join(args.sizes)} --write`)",
            ": Multi30k de-en, the first epoch's token batches "
            f"(max_tokens=4096), identical for both models; forward, label-smoothed loss, backward and AdamW step; "
            f"median of {args.windows} interleaved windows of {args.batches} batches after warm-up. "
            "Target tokens exclude padding.\n\n" + "\n".join(rows),
        )


if __name__ == "__main__":
    main()
