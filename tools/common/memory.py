"""Peak memory, measured one way by every benchmark: in a fresh process (`in_fresh_process`), so that nothing the
caller allocated earlier counts, as the growth of the peak from a point the measurement chooses (`PeakGrowth`)."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from transformer.machine.allocator import status_kib


class PeakGrowth:
    """From its construction: on a CPU, how far the process's peak resident size (VmHWM, which the kernel resets to
    the current size here) rose above the resident size then; on a GPU, the caching allocator's peak (reset here)."""

    def __init__(self, device: str = "cpu"):
        self.cuda = device == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            self.before = status_kib("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current resident size

    def mib(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        return (status_kib("VmHWM") - self.before) / 1024


def in_fresh_process(argv: list[str], env: dict | None = None):
    """Run `python ARGV` (a benchmark re-running itself in measuring mode) and return what it `report`ed: the JSON
    of its last line of output. A failure raises CalledProcessError, its output attached."""
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(value) -> None:
    """What the fresh process hands back: its last line of output, as JSON."""
    print(json.dumps(value), flush=True)
