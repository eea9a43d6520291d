"""What a measurement ran on, and how long it took."""

import platform
import statistics
import time

import torch


def machine() -> str:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, Python {platform.python_version()}"


def median_seconds(run, repeats: int, warmup: int = 0) -> float:
    """Median wall seconds of `run()` over `repeats` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def precision_dtype(precision: str) -> torch.dtype:
    """The dtype a Lightning precision ("bf16-mixed", "16-mixed", "32-true", ...) computes matmuls in."""
    if "bf16" in precision:
        return torch.bfloat16
    return torch.float16 if precision.startswith("16") else torch.float32


def gemm_seconds(m: int, k: int, n: int, dtype: torch.dtype, device: str = "cpu", layout: str = "nt",
                 repeats: int = 7) -> float:  # fmt: skip
    """Median seconds of one (m, k) x (k, n) product on `device`; layout says which operand is stored transposed, as
    a training step stores them: nt, x @ W.t() (forward); nn, g @ W (input gradient); tn, g.t() @ x (weight's). The
    output is written in place: no allocation is timed. On a GPU each repeat times 20 products between syncs."""
    a = torch.randn(k, m, dtype=dtype, device=device).t() if layout == "tn" else torch.randn(m, k, dtype=dtype,
                                                                                               device=device)  # fmt: skip
    b = torch.randn(n, k, dtype=dtype, device=device).t() if layout == "nt" else torch.randn(k, n, dtype=dtype,
                                                                                               device=device)  # fmt: skip
    c = torch.empty(m, n, dtype=dtype, device=device)
    batch = 20 if device != "cpu" else 1
    torch.mm(a, b, out=c)  # the library picks and builds its kernel
    times = []
    for _ in range(repeats):
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(batch):
            torch.mm(a, b, out=c)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / batch)
    return statistics.median(times)


def square_gemm_rate(dtype: torch.dtype, device: str = "cpu", n: int = 2048) -> float:
    """FLOP/s of one n^3 product: the machine's GEMM rate that MFU is judged against where no data sheet says."""
    return 2 * n**3 / gemm_seconds(n, n, n, dtype, device)
