"""What tools/gpu_check.py measures inside real training runs (Lightning, the recipe's config, logging on), as
callbacks it adds with Hydra overrides; each writes its findings as JSON into `out`. They run on a CPU too, where
there is no GPU kernel or sync to see, so that the script can be checked before a GPU is lent."""

import json
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from pytorch_lightning import Callback

from transformer.model import ModelConfig

from .machine import precision_dtype, square_gemm_rate

# Dense bf16 peak FLOP/s (NVIDIA's data sheets, without sparsity), by what torch.cuda.get_device_name() contains
PEAKS = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("A100", 312e12),
         ("L40S", 362e12), ("L4", 121e12), ("A10G", 70e12))  # fmt: skip
# the fused kernels' names, each kernel in the first family that matches (cuDNN's are named ..._sdpa_..._flash_...);
# the math path runs generic matmul and softmax kernels, which the loss's look like
ATTENTION_KERNELS = (
    ("cudnn", ("cudnn", "sdpa_")),
    ("flash", ("flash",)),
    ("efficient", ("fmha", "efficient", "cutlass")),
)


# the CUDA runtime and driver calls by which a host starts work on the GPU, as the profiler names them
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def attention_family(kernel: str) -> str | None:
    return next((family for family, patterns in ATTENTION_KERNELS if any(p in kernel.lower() for p in patterns)), None)


def peak_flops(device_name: str) -> float | None:
    return next((peak for name, peak in PEAKS if name in device_name), None)


def training_flops(cfg: ModelConfig, src_tokens: int, tgt_tokens: int, src_sq: float, tgt_sq: float,
                   cross: float) -> float:  # fmt: skip
    """Analytic FLOPs of a training step (forward and backward: 3 x the forward's 2 x multiply-adds) over the real
    tokens only: src_tokens and tgt_tokens, and per sentence the sums of S^2, T^2 and S*T (attention's products).
    Causal self-attention counts its half; the output layer runs at real target tokens only, as the loss does."""
    d, ff, V = cfg.d_model, cfg.d_ff, cfg.tgt_vocab_size
    encoder = cfg.n_encoder_layers * (src_tokens * (4 * d * d + 2 * d * ff) + 2 * src_sq * d)
    decoder = cfg.n_decoder_layers * (tgt_tokens * (6 * d * d + 2 * d * ff) + src_tokens * 2 * d * d
                                      + tgt_sq * d + 2 * cross * d)  # fmt: skip
    return 6 * (encoder + decoder + tgt_tokens * d * V)


def _write(out: str, name: str, found: dict) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"{name}.json").write_text(json.dumps(found, indent=1))


def _in_window(trainer, first: int, steps: int) -> tuple[bool, bool]:
    """(this batch starts the window, this batch ends it), by optimizer step."""
    return trainer.global_step == first, trainer.global_step == first + steps


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class KernelNames(Callback):
    """The GPU kernels optimizer steps first..first+steps-1 launch (torch.profiler), with their count and time; and
    which attention kernel families appear among them."""

    def __init__(self, out: str, first: int = 3, steps: int = 2):
        self.out, self.first, self.steps = out, first, steps
        self.profiler: torch.profiler.profile | None = None
        self.done = False

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        starts, ends = _in_window(trainer, self.first, self.steps)
        if starts and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
        elif ends and self.profiler is not None and not self.done:
            self.done = True
            _synchronize()
            self.profiler.stop()
            averages = self.profiler.key_averages()
            events = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
            kernels = sorted(((e.key, e.count, e.device_time_total / 1e3) for e in events), key=lambda k: -k[2])
            families = {
                family: [k for k in kernels if attention_family(k[0]) == family] for family, _ in ATTENTION_KERNELS
            }
            # what the host itself launched: kernels one by one, or whole CUDA graphs (a replay is one launch)
            launches = sum(e.count for e in averages if e.device_type == torch.autograd.DeviceType.CPU
                           and any(name in e.key for name in LAUNCHES))  # fmt: skip
            _write(self.out, "kernels", {"steps": self.steps, "kernels": kernels[:60], "attention": families,
                                         "device_kernels": sum(k[1] for k in kernels), "launches": launches})  # fmt: skip


class SyncWarnings(Callback):
    """CUDA's own count of host syncs over optimizer steps first..first+steps-1: torch.cuda.set_sync_debug_mode
    ("warn") warns at every synchronizing call; the warnings are recorded with where in Python they came from."""

    def __init__(self, out: str, first: int = 5, steps: int = 10):
        self.out, self.first, self.steps = out, first, steps
        self._catcher: warnings.catch_warnings | None = None
        self._recorded: list = []
        self.done = False

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        starts, ends = _in_window(trainer, self.first, self.steps)
        if starts and self._catcher is None:
            self._catcher = warnings.catch_warnings(record=True)
            self._recorded = self._catcher.__enter__()
            warnings.simplefilter("always")  # every sync, not the first of each place
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("warn")
        elif ends and self._catcher is not None and not self.done:
            self.done = True
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(0)
            self._catcher.__exit__(None, None, None)
            syncs = [w for w in self._recorded if "synchroniz" in str(w.message)]
            where = Counter(f"{Path(w.filename).parent.name}/{Path(w.filename).name}:{w.lineno}" for w in syncs)
            _write(self.out, "syncs", {"steps": self.steps, "syncs": len(syncs), "where": where.most_common()})


class Graphs(Callback):
    """What torch.compile made of the run, read when training ends: dynamo's graphs and graph breaks, the CUDA graph
    recordings inductor skipped (cudagraph trees record one per batch shape), and the distinct batch shapes."""

    def __init__(self, out: str):
        self.out, self.shapes = out, set()

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.shapes.add(tuple(tuple(v.shape) for v in batch.values() if torch.is_tensor(v)))

    def on_train_end(self, trainer, module):
        from torch._dynamo.utils import counters

        _write(self.out, "graphs", {
            "graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
            "shapes": len(self.shapes),
        })  # fmt: skip


class Throughput(Callback):
    """From optimizer step `first` to the end of training: target tokens per second and model FLOPs utilisation
    from analytic FLOPs of the real tokens (training_flops) over the device's own bf16 peak, and over the GEMM rate
    it reaches at 2048^3 in the run's precision, measured when training ends. The attention sums
    are added up on the device and read once, at the end."""

    def __init__(self, out: str, first: int = 20):
        self.out, self.first = out, first
        self.start, self.tokens, self.sums = None, [0, 0], None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.first and self.start is None:
            _synchronize()
            self.start = time.perf_counter()
        if self.start is None:
            return
        s = batch["src_lengths"].double()  # (B,) on the device
        t = batch["tgt_out"].ne(module.model.pad_id).sum(1).double()  # (B,)
        step = torch.stack([(s * s).sum(), (t * t).sum(), (s * t).sum()])
        self.sums = step if self.sums is None else self.sums + step
        self.tokens[0] += batch["src_tokens"]
        self.tokens[1] += batch["tgt_tokens"]

    def on_train_end(self, trainer, module):
        if self.start is None:
            return
        _synchronize()
        seconds = time.perf_counter() - self.start
        flops = training_flops(module.model_config, *self.tokens, *self.sums.tolist())
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        peak = peak_flops(name)
        gemm = square_gemm_rate(
            precision_dtype(str(trainer.precision)), "cuda" if torch.cuda.is_available() else "cpu"
        )  # as bench_mfu.py judges
        _write(self.out, "throughput", {
            "device": name, "steps": trainer.global_step - self.first, "seconds": seconds,
            "target_tokens_per_s": self.tokens[1] / seconds, "tflops": flops / seconds / 1e12,
            "peak_tflops": peak and peak / 1e12, "mfu": peak and flops / seconds / peak,
            "gemm_tflops": gemm / 1e12, "mfu_of_gemm": flops / seconds / gemm,
        })  # fmt: skip


def host_shares(collapsed: str, loop: str = "training_epoch_loop.py") -> tuple[int, Counter, Counter]:
    """py-spy's raw output (one "frame;frame;...;frame count" line per stack, frames as "function (file:line)"):
    of the samples inside the training loop (a frame in `loop`, Lightning's), the count, the innermost line of each
    (self) and this project's functions on the stack (inclusive, line numbers dropped; transformer/train.py, which
    holds the whole loop, left out)."""
    total, own, ours = 0, Counter(), Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not count.isdigit() or not any(loop in frame for frame in frames):
            continue  # start-up, data preparation, the end of the run, other threads
        total += int(count)
        own[frames[-1]] += int(count)
        functions = {frame.rsplit(":", 1)[0] + ")" for frame in frames
                     if "(transformer/" in frame and "(transformer/train.py" not in frame}  # fmt: skip
        for function in functions:  # once per stack, however deep the recursion
            ours[function] += int(count)
    return total, own, ours
