"""The prepared GPU check runs every stage: on a CPU, with --smoke (the tiny model, a few steps), so that the script
a lent GPU runs once is known to work before then."""

import subprocess
import sys

import pytest

from common.gpu import attention_family, host_shares

from .helpers import MULTI30K, ROOT

STAGES = ("## Environment", "## The base model's training step, eager and compiled", "## The GPU recipe for",
          "## Beam-5 decoding on", "## The big model's training step", "## runtime.attention_backend=auto, padding-free",
          "## Host profile of")  # fmt: skip


@pytest.mark.slow  # every stage as a subprocess of the real commands: about 3 minutes
def test_gpu_check_runs_every_stage_in_its_smoke_mode(tmp_path, multi30k_cache):
    done = subprocess.run([sys.executable, "tools/gpu_check.py", "--smoke", "--out", str(tmp_path / "out"),
                           "--data", str(MULTI30K), "--cache", str(multi30k_cache)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)  # fmt: skip
    report = (tmp_path / "out" / "gpu_check.md").read_text()
    assert done.returncode == 0, report + done.stderr[-2000:]
    assert [stage in report for stage in STAGES] == [True] * len(STAGES) and report.rstrip().endswith("all stages ran")
    assert "wall clock: training steps" in report and report.count("| eager |") == report.count("| compiled |") == 2
    assert "| ours |" in report and "| CTranslate2 | failed" not in report
    assert "(transformer/model/" in report.split("## Host profile of")[1]  # py-spy saw the model's lines


def test_host_shares_count_the_training_loop_by_line_and_by_function():
    loop = "<module> (transformer/train.py:183);run (pytorch_lightning/loops/training_epoch_loop.py:154)"
    raw = "\n".join([
        f"{loop};attend (transformer/model/attention.py:101) 30",
        f"{loop};attend (transformer/model/attention.py:100);linear (torch/nn/functional.py:3) 10",
        "<module> (transformer/train.py:183);prepare (transformer/data/prepare.py:10) 50",  # before the loop
        "a line py-spy never writes",
        f"{loop};MultiHeadAttention.forward (transformer/model/attention.py:240);attend (transformer/model/attention.py:101) 60",
    ])  # fmt: skip
    total, by_line, by_function = host_shares(raw)
    assert total == 100
    assert by_line["attend (transformer/model/attention.py:101)"] == 90
    assert by_line["linear (torch/nn/functional.py:3)"] == 10
    assert dict(by_function) == {"attend (transformer/model/attention.py)": 100,
                                 "MultiHeadAttention.forward (transformer/model/attention.py)": 60}  # fmt: skip


def test_each_attention_kernel_counts_in_one_family():
    """cuDNN's kernels carry "flash" in their names (an H200 run listed them under both)."""
    assert attention_family("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64") == "cudnn"
    assert attention_family("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>") == "flash"
    assert (
        attention_family("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)")
        == "efficient"
    )
    assert attention_family("void at::native::vectorized_elementwise_kernel<4>") is None
