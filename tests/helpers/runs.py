"""Training runs from a test: the real config composed with overrides, in process or as the command."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytorch_lightning as pl
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from transformer.config.schema import register_configs
from transformer.train import train

from .corpora import ROOT

register_configs()  # once: the schemas stay in Hydra's ConfigStore for every composition after


def tiny_data(corpus: Path, cache: Path) -> list[str]:
    return [f"data.path={corpus}", f"data.cache_dir={cache}", "data.vocab_size=340", "data.test_split=test",
            "data.max_length=100", "data.max_tokens=300"]  # fmt: skip


def compose_train(run_dir: Path, overrides: list[str]):
    """The real config with overrides, as `python -m transformer.train` composes it, for running train() here."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"hydra.run.dir={run_dir}"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
        cfg.hydra.job.num = 0
    HydraConfig.instance().set_config(cfg)
    return cfg


def compose_command(name: str, overrides: list[str], run_dir: Path | None = None):
    """The command's config as `python -m transformer.{name}` composes it; with run_dir, ready for its main() here
    (Hydra's runtime set, the hydra node dropped)."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(name, overrides=overrides, return_hydra_config=run_dir is not None or name == "evaluate")
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)  # Hydra makes it before main() runs
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(run_dir)
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


def run_train(run_dir: Path, overrides: list[str]) -> pl.Trainer:
    return train(compose_train(run_dir, overrides), run_dir, overrides)


def run_command(*args: str, module: str = "transformer.train") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT)


def callback(trainer: pl.Trainer, cls):
    return next(c for c in trainer.callbacks if isinstance(c, cls))


class LossRecorder(pl.Callback):
    def __init__(self):
        self.losses, self.batches = {}, {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = outputs["loss"].item() / batch["tgt_tokens"]  # the loss is summed
        self.batches[trainer.global_step] = batch["index"].tolist()


class LossFile(LossRecorder):
    """LossRecorder for a run in another process (DDP's ranks): each rank writes {folder}/losses.rank{R}.json."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = Path(folder)

    def on_train_end(self, trainer, module):
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"losses.rank{trainer.global_rank}.json"
        path.write_text(json.dumps({"losses": self.losses, "batches": self.batches}))


class SignalAt(pl.Callback):
    """Sends this process a real signal at the start of a given optimizer step (under DDP: on `rank` only, if given)."""

    def __init__(self, step: int, signum: int = int(signal.SIGTERM), rank: int | None = None):
        self.step, self.signum, self.rank = step, signum, rank
        self.sent = False

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank) and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)


RECORD = ["+callbacks.recorder._target_=tests.helpers.runs.LossRecorder"]
