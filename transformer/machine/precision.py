"""trainer.precision=auto: bf16 autocast where this machine multiplies in bf16 faster than in float32, else float32.
Which is faster depends on the CPU, not on its flags: bf16 matmuls ran 2.7x float32's speed on an AMD EPYC (Zen 4)
and the training step 1.5x faster on an Intel Xeon with AMX, but on an Intel Xeon without AMX (AVX-512 BF16 only,
as a virtual machine may show it) bf16 dot products peak where float32's FMAs do: matmuls ran at 0.6x, and the
training step faster in float32 (docs/benchmarks.md, precision). One timed matmul tells them apart, timed by rank 0
alone and taken by every other DDP rank: ranks timing each on their own, at once on shared cores, could read either
side of the threshold and train in different precisions."""

import os
import time

import torch
from lightning_fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

AUTO = "auto"
CPU_CHOICES = ("32-true", "bf16-mixed")
# Rank 0's choice, inherited by the DDP ranks Lightning's own launcher starts as child processes after rank 0 chose
INHERITED = "TRANSFORMER_AUTO_PRECISION"
# tokens x d_model x d_ff: the small model's feed-forward matmul on a batch of 4,096 tokens
PROBE_SHAPE = (4096, 256, 1024)
MIN_SPEEDUP = 1.1  # below it float32 wins: a tie is not worth bf16's rounding
# A bf16 product this many times slower than float32's fastest loses whatever the noise: timing stops there. Where
# bf16 is emulated (a CPU without AVX-512 BF16 or AMX) one takes ~100x float32's time, 1.9 s on an AVX2 AMD EPYC.
SURELY_SLOWER = 10


def bf16_speedup(shape: tuple[int, int, int] = PROBE_SHAPE, repeats: int = 8) -> float:
    """float32's time over bf16's for one matmul on this CPU, the fastest of `repeats` each (~0.2 s in all; ~4 s
    where bf16 is emulated, which stops after one timed product)."""
    m, k, n = shape
    fastest = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        a @ b  # the first call picks and builds oneDNN's kernel
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
            if dtype == torch.bfloat16 and times[-1] > SURELY_SLOWER * fastest[torch.float32]:
                break
        fastest[dtype] = min(times)
    return fastest[torch.float32] / fastest[torch.bfloat16]


def cpu_precision(speedup: float) -> str:
    return "bf16-mixed" if speedup >= MIN_SPEEDUP else "32-true"


def device_type(accelerator: str = "auto") -> str:
    """The device trainer.accelerator trains on: cuda where it names or finds a GPU, else cpu (or what it names)."""
    if accelerator in ("auto", "gpu", "cuda"):
        return "cuda" if torch.cuda.is_available() or accelerator != "auto" else "cpu"
    return accelerator


def resolve_precision(precision, accelerator: str = "auto", resumed: str | None = None) -> tuple[object, str | None]:
    """A Lightning precision for trainer.precision, and for `auto` a line saying what it chose and why. `resumed`:
    the precision of the checkpoint a run resumes, which a CPU keeps rather than probe again (exact resume)."""
    if precision != AUTO:
        return precision, None
    if device_type(accelerator) == "cuda" and torch.cuda.is_available():
        if torch.cuda.is_bf16_supported():
            return "bf16-mixed", "trainer.precision=auto: bf16-mixed (the GPU computes in bf16)"
        return "16-mixed", "trainer.precision=auto: 16-mixed (the GPU has no bf16; float16 with a gradient scaler)"
    if accelerator not in ("auto", "cpu"):
        return "32-true", f"trainer.precision=auto: 32-true (no measurement for trainer.accelerator={accelerator})"
    if resumed in CPU_CHOICES:
        return resumed, f"trainer.precision=auto: {resumed}, as the resumed checkpoint was trained"
    launched = launched_rank()
    if launched is None and int(os.environ.get("LOCAL_RANK", "0")) > 0 and os.environ.get(INHERITED) in CPU_CHOICES:
        return os.environ[INHERITED], None  # a rank Lightning's launcher started
    chosen, speedup = measured_choice() if launched is None else rank_zeros_choice(*launched)
    os.environ[INHERITED] = chosen
    return chosen, (
        f"trainer.precision=auto: {chosen} (bf16 matmuls run {speedup:.2f}x float32's speed on this CPU; "
        "trainer.precision=32 or bf16-mixed chooses yourself)"
    )


def measured_choice() -> tuple[str, float]:
    speedup = bf16_speedup()
    return cpu_precision(speedup), speedup


def launched_rank() -> tuple[int, int] | None:
    """(rank, world size) of one of several DDP ranks that an outside launcher started, read as Lightning reads
    them: torchrun's, else SLURM's srun, else RANK and WORLD_SIZE of any launcher that sets torch's env:// variables.
    Sets MASTER_ADDR and MASTER_PORT where Lightning would (SLURM: the first node of SLURM_NODELIST, port 15000 +
    the job id's last 4 digits). None for one process, and for the ranks Lightning's own launcher starts (no RANK)."""
    if TorchElasticEnvironment.detect():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    elif SLURMEnvironment.detect():
        slurm = SLURMEnvironment()
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = slurm.main_address, str(slurm.main_port)
        rank, world = slurm.global_rank(), slurm.world_size()
    elif {"RANK", "WORLD_SIZE", "LOCAL_RANK"} <= os.environ.keys():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        return None
    return (rank, world) if world > 1 else None


def rank_zeros_choice(rank: int, world: int) -> tuple[str, float]:
    """Rank 0's measured choice and speedup, on every rank. The process group this joins is the one the run trains
    with (gloo, as Lightning's DDP on a CPU): Lightning finds it initialised and keeps it, so the ranks meet once."""
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)  # env://: MASTER_ADDR, MASTER_PORT
    choice = [measured_choice() if rank == 0 else None]
    torch.distributed.broadcast_object_list(choice, src=0)
    return choice[0]
