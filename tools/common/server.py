"""`python -m transformer.serve` in a process of its own, on a free port, returned once /health answers: for the
tests and benchmarks that need a live server."""

import os
import socket
import subprocess
import sys
import time
import urllib.request


def start_server(models: list[str], *overrides: str, quiet: bool = True, cpus: set[int] | None = None,
                 timeout_s: float = 120) -> tuple[subprocess.Popen, int]:  # fmt: skip
    """(the process, its port). quiet: its output kept in the process's pipes (shown if it fails to start); cpus:
    the cores it may run on (all by default)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pipe = subprocess.PIPE if quiet else None
    process = subprocess.Popen([sys.executable, "-m", "transformer.serve", f"models=[{','.join(map(str, models))}]",
                                f"port={port}", *overrides], stdout=pipe, stderr=pipe, text=True)  # fmt: skip
    if cpus:
        os.sched_setaffinity(process.pid, cpus)  # before it loads torch, whose threads follow the affinity
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return process, port
        except OSError:
            if process.poll() is not None:
                output = (process.communicate()[1] or "")[-2000:]
                raise RuntimeError(f"the server exited {process.returncode}: {output}") from None
            time.sleep(0.5)
    process.kill()
    process.wait()
    raise TimeoutError(f"the server's /health did not answer in {timeout_s:.0f} s (port {port})")
