import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from transformer.training.checkpoint import RunFolderLock
from transformer.training.errors import TrainingError

from .test_data import write_text_corpus
from .test_train import ROOT, run_train, tiny_data


class NaNLogitsAt(pl.Callback):
    """From a given step on, the model's logits are NaN (as a numerical blow-up would make them)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_start(self, trainer, module):
        module.model.output.register_forward_hook(
            lambda m, i, out: out * float("nan") if m.training and trainer.global_step >= self.step else None
        )


def test_non_finite_loss_stops_before_any_update_and_keeps_the_last_checkpoint(tmp_path):
    write_text_corpus(tmp_path / "c")
    with pytest.raises(TrainingError, match=r"non-finite gradient norm \(nan\) at step 7 \(epoch 0, batch 7"):
        run_train(tmp_path / "run", [
            *tiny_data(tmp_path / "c", tmp_path / "cache"), "model=tiny", "~logger", "trainer.max_steps=20",
            "trainer.enable_progress_bar=false", "callbacks.last_checkpoint.every_n_train_steps=5",
            "+callbacks.nan._target_=tests.test_reliability.NaNLogitsAt", "+callbacks.nan.step=7",
        ])  # fmt: skip
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints == ["last.ckpt"]  # no validation ran, so no best checkpoint either
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 5 and all(v.isfinite().all() for v in last["state_dict"].values())


def test_a_second_run_in_the_same_folder_is_refused(tmp_path):
    first = RunFolderLock(tmp_path)
    with pytest.raises(TrainingError, match=f"{tmp_path} is in use by a training run \\(pid {os.getpid()}\\)"):
        RunFolderLock(tmp_path)
    first.release()
    RunFolderLock(tmp_path).release()  # free again once the first run has stopped


def test_crafted_checkpoint_with_code_is_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    path = tmp_path / "evil.ckpt"
    torch.save({"hyper_parameters": {"model": {}}, "state_dict": {}, "payload": Payload()}, path)
    for module in ("transformer.evaluate", "transformer.translate"):
        result = subprocess.run([sys.executable, "-m", module, f"ckpt_path={path}", f"hydra.run.dir={tmp_path}"],
                                capture_output=True, text=True, cwd=ROOT, input="")  # fmt: skip
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith(f"error: ckpt_path={path} is refused: it holds code")
    assert not (tmp_path / "pwned").exists()
