"""The prepared GPU check (issue 7), under 10 minutes on one H100/H200-class GPU:

1. SDPA's flash kernel is selected: decoder self-attention runs with SDPA restricted to flash, and a whole
   training step runs with every attention forced to flash (padding-free encoder and cross attention); a training
   step runs without host syncs (torch.cuda.set_sync_debug_mode("error"));
2. bf16 training throughput and model FLOPs utilisation of the base model on Multi30k batches, padded
   against padding-free attention;
3. the GPU recipe's first minutes (experiment=multi30k_de_en_gpu), then greedy BLEU of its last checkpoint.

    python scripts/gpu_check.py --out OUT [--recipe-minutes 4] [--peak-tflops 989]

Needs the Multi30k files in data/multi30k. Prints each result as it comes and writes OUT/gpu_check.md.
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from transformer.benchmarks.training import batch_loss, train_steps
from transformer.data import DataConfig, TranslationDataModule
from transformer.model import ModelConfig, MultiHeadAttention, RuntimeConfig, build_model

ROOT = Path(__file__).resolve().parents[1]


def flash_selected(device: str) -> str:
    attention = MultiHeadAttention(512, 8).to(device)
    x = torch.randn(8, 128, 512, device=device)
    with torch.autocast(device, dtype=torch.bfloat16), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        attention(x, is_causal=True)[0].sum().backward()  # raises if flash cannot run this
    return "decoder self-attention (causal, bf16) runs with SDPA restricted to flash: yes"


def no_host_sync(data, device: str) -> list[str]:
    """Training steps (forward, the project's loss, backward, fused AdamW) of the base model, padded and
    padding-free, under CUDA's sync debug mode "error": any host-device synchronisation in them raises."""
    if device != "cuda":
        return ["training step without host syncs: not checked (no CUDA)"]
    tok, results = data.src_tokenizer, []
    cfg = ModelConfig.from_size("base", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, pad_id=tok.pad_id)
    loader = iter(data.train_dataloader())
    batches = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in next(loader).items()} for _ in range(3)]
    for padding_free in (False, True):
        model = build_model(cfg, RuntimeConfig(padding_free_attention=padding_free)).to(device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        train_steps(model, optimizer, batches[:1], "bf16", tok.pad_id)  # warm-up: lazy initialisation may sync
        name = "padding-free" if padding_free else "padded"
        torch.cuda.set_sync_debug_mode("error")
        try:
            for batch in batches[1:]:  # train_steps' own loop, less its closing synchronize
                with torch.autocast(device, dtype=torch.bfloat16):
                    loss = batch_loss(model, batch, tok.pad_id, 0.1)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            results.append(f'{name} training step without host syncs: yes (2 steps, set_sync_debug_mode("error"))')
        except RuntimeError as e:
            results.append(f"{name} training step without host syncs: FAILED ({str(e).splitlines()[0][:160]})")
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return results


def throughput(data, size: str, padding_free: bool, backend: str, device: str, steps: int, peak_tflops: float):
    tok = data.src_tokenizer
    cfg = ModelConfig.from_size(size, src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, pad_id=tok.pad_id)
    runtime = RuntimeConfig(attention_backend=backend, padding_free_attention=padding_free)
    model = build_model(cfg, runtime).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    loader = iter(data.train_dataloader())
    batches = [
        {k: v.to(device) if torch.is_tensor(v) else v for k, v in next(loader).items()} for _ in range(steps + 3)
    ]

    with FlopCounterMode(display=False) as counter:
        train_steps(model, optimizer, batches[:1], "bf16", tok.pad_id)
    flops_per_token = counter.get_total_flops() / int(batches[0]["tgt_out"].ne(tok.pad_id).sum())
    train_steps(model, optimizer, batches[1:3], "bf16", tok.pad_id)  # warm-up
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds, tokens = train_steps(model, optimizer, batches[3:], "bf16", tok.pad_id)
    mfu = tokens * flops_per_token / seconds / (peak_tflops * 1e12)
    memory = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return tokens / seconds, mfu, memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recipe-minutes", type=int, default=4)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM: 989)")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}"]

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
        (args.out / "gpu_check.md").write_text("\n".join(lines) + "\n")

    say(lines.pop())
    say(flash_selected(device))
    data = TranslationDataModule(DataConfig(max_tokens=16384))
    data.setup()
    for line in no_host_sync(data, device):
        say(line)
    say("| model | attention | target tok/s | MFU | peak memory GiB |\n|---|---|---:|---:|---:|")
    for size in ("small", "base"):
        runs = [("padded, auto", False, "auto"), ("padding-free, auto", True, "auto"), ("padding-free, flash", True, "flash")]  # fmt: skip
        for name, padding_free, backend in runs:
            try:
                rate, mfu, memory = throughput(data, size, padding_free, backend, device, args.steps, args.peak_tflops)
                say(f"| {size} | {name} | {rate:,.0f} | {mfu:.1%} | {memory:.1f} |")
            except RuntimeError as e:
                say(f"| {size} | {name} | failed: {str(e).splitlines()[0][:120]} | | |")
    run = args.out / "gpu_recipe"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "transformer.train", "experiment=multi30k_de_en_gpu", f"hydra.run.dir={run}",
                    f"trainer.max_time=00:00:{args.recipe_minutes:02d}:00", "trainer.enable_progress_bar=false"],
                   cwd=ROOT, check=True)  # fmt: skip
    say(f"GPU recipe: {args.recipe_minutes} minutes of training took {time.perf_counter() - start:.0f} s in all")
    done = subprocess.run([sys.executable, "-m", "transformer.evaluate", f"ckpt_path={run}/checkpoints/last.ckpt",
                           "beam_size=1", f"device={device}"],
                          cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    say("GPU recipe, last checkpoint, greedy, test_2016_flickr:\n" + done.stdout.strip())
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    rates = [e.value for e in events.Scalars("train/tokens_per_s")]
    say(f"GPU recipe: median {statistics.median(rates):,.0f} target tok/s over {len(rates)} logged steps")


if __name__ == "__main__":
    main()
