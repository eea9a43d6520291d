"""`python -m transformer.serve` in its own process, on a free port, once /health answers: for the live tests and
scripts/bench_serve.py."""

import subprocess
import sys
import time
import urllib.request

from .corpora import ROOT
from .ranks import free_port


def start_server(model, *overrides: str, quiet: bool = True) -> tuple[subprocess.Popen, int]:
    """(the process, its port); quiet: its output kept (in the process's pipes, shown if it fails to start)."""
    port = free_port()
    pipe = subprocess.PIPE if quiet else None
    process = subprocess.Popen([sys.executable, "-m", "transformer.serve", f"models=[{model}]", f"port={port}",
                                *overrides], cwd=ROOT, stdout=pipe, stderr=pipe, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
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
    raise TimeoutError(f"the server's /health did not answer in 120 s (port {port})")
