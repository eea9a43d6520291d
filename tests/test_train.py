import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from transformer.data import TranslationDataModule
from transformer.training import OptimConfig, TranslationModule
from transformer.training.module import lr_factor
from transformer.train import model_config

from .test_data import config, write_text_corpus

ROOT = Path(__file__).resolve().parents[1]


def test_lr_schedules():
    assert lr_factor(0, 4, "inverse_sqrt", 0) == pytest.approx(0.25)
    assert lr_factor(3, 4, "inverse_sqrt", 0) == pytest.approx(1.0)  # peak at the end of warmup
    assert lr_factor(15, 4, "inverse_sqrt", 0) == pytest.approx(0.5)  # sqrt(4 / 16)
    assert lr_factor(3, 4, "cosine", 20) == pytest.approx(1.0)
    assert lr_factor(11, 4, "cosine", 20) == pytest.approx(0.5)
    assert lr_factor(19, 4, "cosine", 20) == pytest.approx(0.0, abs=1e-12)


def test_training_lowers_validation_loss_and_checkpoint_loads_alone(tmp_path):
    write_text_corpus(tmp_path / "c", sizes={"train": 300, "val": 40, "test": 10})
    data = TranslationDataModule(config(tmp_path / "c", tmp_path, max_tokens=400))
    data.setup()
    model = model_config({"size": "tiny", "dropout": 0.0}, data)
    assert model.src_vocab_size == data.data.src_tokenizer.vocab_size
    module = TranslationModule(**TranslationModule.hyperparameters(model, OptimConfig(lr=3e-3, warmup_steps=20)))
    trainer = pl.Trainer(max_epochs=8, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         use_distributed_sampler=False, default_root_dir=tmp_path)  # fmt: skip
    first = trainer.validate(module, datamodule=data, verbose=False)[0]["val/loss"]
    trainer.fit(module, datamodule=data)
    last = trainer.callback_metrics["val/loss"].item()
    assert last < 0.6 * first

    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    loaded = TranslationModule.load_from_checkpoint(path).eval()
    module.eval()
    batch = next(iter(data.val_dataloader()))
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch["src"], batch["tgt_in"]), module(batch["src"], batch["tgt_in"]))


def test_train_command_writes_its_run_folder(tmp_path):
    write_text_corpus(tmp_path / "c")
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "transformer.train", "debug=fast", f"hydra.run.dir={run_dir}",
         f"data.path={tmp_path / 'c'}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=340",
         "data.test_split=test", "data.max_length=100", "data.max_tokens=300",
         "trainer.fast_dev_run=false", "trainer.max_steps=2", "trainer.limit_val_batches=1"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / ".hydra" / "config.yaml").exists()
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    assert (run_dir / "tokenizer" / "spm.model").exists()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_bad_model_override_is_one_line(tmp_path):
    write_text_corpus(tmp_path / "c")
    result = subprocess.run(
        [sys.executable, "-m", "transformer.train", "debug=fast", f"hydra.run.dir={tmp_path / 'run'}",
         f"data.path={tmp_path / 'c'}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=340",
         "data.test_split=test", "data.max_length=100", "data.max_tokens=300", "model.d_model=250", "model.n_heads=8"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "error: d_model=250 is not divisible by n_heads=8; change one of them"
