"""Training-step throughput and peak memory on Multi30k batches: this project's model against a plain
torch.nn.Transformer and Hugging Face's MarianMTModel of the same dimensions, all trained by the same loop
(label-smoothed loss, AdamW) on identical token batches, fp32 and bf16 autocast; and, for reference, the
pipeline of PyTorch's translation tutorial as it is (d=512, untied embeddings, random batches of 128 sentences).

    python tools/bench_train.py                      # small model, print the tables
    python tools/bench_train.py --sizes small base --write   # and record them in docs/benchmarks.md

MarianMTModel needs the optional extra: pip install -e ".[bench]" (skipped without it). Peak memory is measured
in a fresh process per model: the growth of peak resident memory over three steps. Run it alone.
"""

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

from common.machine import machine
from common.memory import PeakGrowth, in_fresh_process, report
from common.peers import MarianPeer, TorchTransformer, TutorialTransformer
from common.report import record
from common.training import train_steps
from transformer.data import DataConfig, TranslationDataModule
from transformer.data.batching import Collate, TokenDataset
from transformer.model import ModelConfig, build_model


def models_of(size: str, data: TranslationDataModule) -> dict[str, nn.Module]:
    tok = data.data.src_tokenizer
    cfg = ModelConfig.from_size(size, src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, pad_id=tok.pad_id)
    models = {"ours": build_model(cfg), "nn.Transformer": TorchTransformer(cfg),
              "nn.Transformer, our dropout": TorchTransformer(cfg, our_dropout=True)}  # fmt: skip
    try:
        models["MarianMT"] = MarianPeer(cfg, tok.bos_id, tok.eos_id)
    except ImportError:
        print('MarianMTModel skipped: pip install -e ".[bench]" installs transformers', file=sys.stderr)
    return models


def token_batches(data: TranslationDataModule, count: int) -> list[dict]:
    loader = iter(data.train_dataloader())
    return [next(loader) for _ in range(count)]


def tutorial_batches(data: TranslationDataModule, count: int, sentences: int = 128) -> list[dict]:
    """The tutorial's batches: random sentences, padded to the longest of each batch."""
    dataset, tok = TokenDataset(data.data.splits[data.cfg.train_split]), data.data.tgt_tokenizer
    order = list(range(len(dataset)))
    random.Random(0).shuffle(order)
    collate = Collate(tok.pad_id, tok.bos_id, tok.eos_id)
    return [collate([dataset[i] for i in order[k * sentences : (k + 1) * sentences]]) for k in range(count)]


def peak_memory_mib(size: str, name: str, precision: str) -> float:
    """Peak resident memory growth over three training steps of one model, measured in a fresh process."""
    return in_fresh_process([__file__, "--peak-memory-of", size, name, precision])


def measure_peak_memory(size: str, name: str, precision: str) -> None:
    data = TranslationDataModule(DataConfig())
    data.setup()
    torch.manual_seed(0)
    if name == "tutorial":
        tok = data.data.src_tokenizer
        batches, model = tutorial_batches(data, 3), TutorialTransformer(tok.vocab_size, tok.pad_id)
    else:
        batches, model = token_batches(data, 3), models_of(size, data)[name]
    peak = PeakGrowth()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_steps(model.train(), optimizer, batches, precision, data.data.src_tokenizer.pad_id)
    report(peak.mib())


def throughput(models, batches, precision, pad, windows, per_window, label_smoothing=0.1) -> dict[str, float]:
    """Median target tokens/s per model over interleaved windows, after a warm-up of two batches."""
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    for name, model in models.items():
        model.train()
        train_steps(model, optimizers[name], batches[:2], precision, pad, label_smoothing)
    rates = {name: [] for name in models}
    for w in range(windows):  # interleaved, so that all see the same machine load
        window = batches[2 + w * per_window : 2 + (w + 1) * per_window]
        for name, model in models.items():
            seconds, tokens = train_steps(model, optimizers[name], window, precision, pad, label_smoothing)
            rates[name].append(tokens / seconds)
    return {name: statistics.median(r) for name, r in rates.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["small"])
    parser.add_argument("--windows", type=int, default=5, help="timed windows per configuration (median reported)")
    parser.add_argument("--batches", type=int, default=4, help="batches per window")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--peak-memory-of", nargs=3, metavar=("SIZE", "MODEL", "PRECISION"), help=argparse.SUPPRESS)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.peak_memory_of:
        return measure_peak_memory(*args.peak_memory_of)
    torch.manual_seed(0)
    data = TranslationDataModule(DataConfig())
    data.setup()
    pad = data.data.src_tokenizer.pad_id
    batches = token_batches(data, args.batches * args.windows + 2)
    memory = not args.no_memory and Path("/proc/self/clear_refs").exists()
    print(machine())
    rows = []
    for size in args.sizes:
        models = models_of(size, data)
        for precision in ("fp32", "bf16"):
            rates = throughput(models, batches, precision, pad, args.windows, args.batches)
            for name in models:
                mib = f"{peak_memory_mib(size, name, precision):,.0f}" if memory else "n/a"
                ratio = f"{rates['ours'] / rates[name]:.2f}x" if name != "ours" else ""
                rows.append(f"| {size} | {precision} | {name} | {rates[name]:,.0f} | {ratio} | {mib} |")
                print(rows[-1], flush=True)
    # The tutorial's pipeline as it is: its own model and random sentence batches, fp32, plain cross-entropy.
    tutorial = {"tutorial": TutorialTransformer(data.data.src_tokenizer.vocab_size, pad)}
    rate = throughput(tutorial, tutorial_batches(data, args.batches * args.windows + 2), "fp32", pad,
                      args.windows, args.batches, label_smoothing=0.0)["tutorial"]  # fmt: skip
    mib = f"{peak_memory_mib('small', 'tutorial', 'fp32'):,.0f}" if memory else "n/a"
    tutorial_row = f"| PyTorch tutorial pipeline (d=512, 128-sentence batches) | fp32 | {rate:,.0f} | {mib} |"
    print(tutorial_row)
    table = ("| size | precision | model | target tok/s | ours vs it | peak memory growth (MiB) |\n"
             "|---|---|---|---:|---:|---:|\n" + "\n".join(rows))  # fmt: skip
    reference = ("| pipeline | precision | target tok/s | peak memory growth (MiB) |\n|---|---|---:|---:|\n"
                 + tutorial_row)  # fmt: skip
    print(table + "\n\n" + reference)
    if args.write:
        record(
            "bench_train",
            f"Training step (`python tools/bench_train.py --sizes {' '.join(args.sizes)} --write`)",
            ": Multi30k de-en, the first epoch's token batches (max_tokens=4096), identical for every model; "
            "forward, label-smoothed loss (ours: the project's, with logits only at real target tokens; the "
            "peers': at every position), backward and AdamW step; median of "
            f"{args.windows} interleaved windows of {args.batches} batches after warm-up. Target tokens exclude "
            "padding. Peak memory: growth of the peak resident set over three steps, each model in a fresh "
            "process. nn.Transformer as PyTorch's tutorial builds it drops attention probabilities and "
            'feed-forward activations with its one dropout rate; "our dropout" sets those two to ours (0), '
            "so that both do the same work. MarianMTModel: transformers' implementation, randomly "
            "initialised with the same dimensions (post-LN), with our dropout.\n\n"
            + table
            + "\n\nFor reference, PyTorch's translation tutorial as it "
            "is (its model: d=512, ff=512, 3+3 layers, untied embeddings; random batches of 128 sentences, "
            "fp32, plain cross-entropy), on the same sentencepiece ids:\n\n" + reference,
        )


if __name__ == "__main__":
    main()
