"""Fixtures shared by several test modules, and one torch thread in the test process."""

import pytest
import torch

from .helpers import run_train, tiny_data, write_word_for_word_corpus

# The tests' models are tiny: a second thread gains them nothing, while two torch processes at once (a test and the
# DDP ranks it forks, which keep this setting, or a command it starts in the background) each spinning two threads on
# 2 cores slow each other 5-10x. Commands the tests wait for keep torch's default
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A tiny model trained to translate a word-for-word corpus well; validation (BLEU) at the end."""
    tmp = tmp_path_factory.mktemp("trained")
    write_word_for_word_corpus(tmp / "c", 48)
    trainer = run_train(tmp / "run", [
        *tiny_data(tmp / "c", tmp / "cache"), "data.vocab_size=320", "model=tiny", "model.d_model=64",
        "model.d_ff=128", "model.dropout=0.0", "optim.lr=3e-3", "optim.warmup_steps=20", "trainer.precision=bf16-mixed",
        "trainer.max_epochs=24", "trainer.check_val_every_n_epoch=12", "trainer.enable_progress_bar=false", "~logger",
    ])  # fmt: skip
    return tmp, trainer, tmp / "run" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="session")
def multi30k_cache(tmp_path_factory):
    """One data cache for every test on Multi30k in a run: its tokenizer is trained once per language pair."""
    return tmp_path_factory.mktemp("multi30k_cache")
