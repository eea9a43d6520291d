"""What a measurement ran on, and how much memory this process holds."""

import platform
from pathlib import Path

import torch


def machine() -> str:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, Python {platform.python_version()}"


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB, e.g. VmRSS (resident now) or VmHWM (peak resident)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1])
