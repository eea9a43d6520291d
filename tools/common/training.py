"""The timed training loop every training benchmark runs: the same loss, backward and optimizer step for any model."""

import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from transformer.data import DataConfig, SentencePiece, TranslationDataModule
from transformer.machine.allocator import purge_freed_pages
from transformer.model import EncoderDecoder
from transformer.model.loss import batch_loss_sum


def batch_loss(model: nn.Module, batch: dict, pad: int, label_smoothing: float) -> torch.Tensor:
    """Loss per target token: ours by the project's training loss (logits only at real target tokens, the batch
    described by the collator's host facts), the peers' from logits at every position, as they train."""
    if isinstance(model, EncoderDecoder):
        total, _ = batch_loss_sum(model, batch, label_smoothing)
        return total / batch["tgt_tokens"]
    logits = model(batch["src"], batch["tgt_in"]).flatten(0, 1).float()  # (B*T, V)
    return F.cross_entropy(logits, batch["tgt_out"].flatten(), ignore_index=pad, label_smoothing=label_smoothing)


def train_steps(model, optimizer, batches, precision, pad, label_smoothing=0.1):
    """Seconds for one optimizer step per batch, and the target tokens trained: under bf16 autocast where precision is
    "bf16", else in the model's own dtype."""
    device = batches[0]["src"].device.type
    autocast = torch.autocast(device, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    start = time.perf_counter()
    tokens = 0
    for batch in batches:
        with autocast:
            loss = batch_loss(model, batch, pad, label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        tokens += batch["tgt_tokens"] if "tgt_tokens" in batch else int(batch["tgt_out"].ne(pad).sum())
    if device == "cuda":
        torch.cuda.synchronize()  # the steps were queued: the time is theirs only once they have run
    return time.perf_counter() - start, tokens


def multi30k_batches(count: int) -> tuple[list[dict], SentencePiece]:
    """The first `count` training batches of Multi30k as training collates them, and the tokenizer (source's)."""
    data = TranslationDataModule(DataConfig())
    data.setup()
    loader = iter(data.train_dataloader())
    return [next(loader) for _ in range(count)], data.src_tokenizer


def interleaved_rates(runners: dict[str, Callable[[list[dict]], tuple[float, int]]], batches: list[dict],
                      warmup: int, windows: int, per_window: int) -> tuple[dict[str, float], dict[str, float]]:  # fmt: skip
    """(each runner's warm-up seconds, its median target tokens/s): every runner (batches -> seconds, tokens) trains
    on the first `warmup` batches, then on the same windows of the rest in turn, so that all see the same machine."""
    warmup_s = {name: run(batches[:warmup])[0] for name, run in runners.items()}
    rates = {name: [] for name in runners}
    for w in range(windows):
        window = batches[warmup + w * per_window : warmup + (w + 1) * per_window]
        for name, run in runners.items():
            seconds, tokens = run(window)
            rates[name].append(tokens / seconds)
    return warmup_s, {name: statistics.median(r) for name, r in rates.items()}


def settled(model: torch.nn.Module, optimizer, precision: str, pad: int) -> Callable[[list[dict]], tuple[float, int]]:
    """Batches -> (seconds, target tokens) of a window that starts on the pages a step of this model left: the
    allocator's freed pages purged (two models' differently sized tensors fragment what jemalloc keeps:
    docs/benchmarks.md), then one untimed step on the window's first batch. The first call, interleaved_rates'
    warm-up, trains no untimed step: its time is the cold start's."""
    calls = 0

    def run(batches: list[dict]) -> tuple[float, int]:
        nonlocal calls
        purge_freed_pages()
        if calls:
            train_steps(model, optimizer, batches[:1], precision, pad)
        calls += 1
        return train_steps(model, optimizer, batches, precision, pad)

    return run
