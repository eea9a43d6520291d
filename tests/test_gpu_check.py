"""The prepared GPU check runs every stage: on a CPU, with --smoke (the tiny model, a few steps), so that the script
a lent GPU runs once is known to work before then."""

import subprocess
import sys

import pytest

from .helpers import MULTI30K, ROOT

STAGES = ("## Environment", "## Kernels of", "## Host syncs", "## MFU through the Trainer", "## The GPU recipe for",
          "## runtime.attention_backend=auto, padding-free", "## Host profile of")  # fmt: skip


@pytest.mark.slow  # every stage as a subprocess of the real commands: about 2 minutes
def test_gpu_check_runs_every_stage_in_its_smoke_mode(tmp_path, multi30k_cache):
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--smoke", "--out", str(tmp_path / "out"),
                           "--data", str(MULTI30K), "--cache", str(multi30k_cache)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)  # fmt: skip
    report = (tmp_path / "out" / "gpu_check.md").read_text()
    assert done.returncode == 0, report + done.stderr[-2000:]
    assert [stage in report for stage in STAGES] == [True] * len(STAGES) and report.rstrip().endswith("all stages ran")
    assert "wall clock: training steps" in report and "| base |" in report and "| big |" in report
    assert "(transformer/model/" in report.split("## Host profile of")[1]  # py-spy saw the model's lines
