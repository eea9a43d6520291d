"""Fixtures shared by several test modules, and one torch thread in each process that runs tests."""

import os
from pathlib import Path

import pytest

# The maintainer tree's helpers (tools/common), which tests/helpers imports: pytest's pythonpath puts them on this
# process's path; the commands the tests start (their callbacks import tests.helpers) need them too
TOOLS = str(Path(__file__).resolve().parents[1] / "tools")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TOOLS, os.environ.get("PYTHONPATH")]))


def pytest_configure(config):
    """The tests' models are tiny: a second thread gains them nothing, while two torch processes at once each spinning
    two threads on 2 cores slow each other 5-10x. Run alone (-n 0), the commands and DDP ranks the tests wait for keep
    torch's default; in pytest-xdist's workers, which run side by side, every process gets one thread. xdist's
    controller only hands out files: it imports neither torch nor the package, and starts the workers at once."""
    worker = "PYTEST_XDIST_WORKER" in os.environ
    if getattr(config.option, "numprocesses", None) and not worker:
        return
    if worker:
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every process a test starts
    import torch

    torch.set_num_threads(1)


# The files that take longest (their fixtures train) go first. pytest-xdist hands out whole files in collection order
# (--no-loadscope-reorder), so none of them is left to start as the other workers run out of files
LONGEST = (
    "test_teacher_student.py",
    "test_train.py",
    "test_compile.py",
    "test_serve.py",
    "test_kernels.py",
    "test_decoding.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST)))  # stable: each file keeps its order


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A tiny model trained to translate a word-for-word corpus well; validation (BLEU) at the end. float32: bf16 is
    emulated on CPUs without AVX-512 BF16, 4x slower here; test_train's bf16 run covers that precision"""
    from .helpers import run_train, tiny_data, write_word_for_word_corpus  # here: the controller imports no torch

    tmp = tmp_path_factory.mktemp("trained")
    write_word_for_word_corpus(tmp / "c", 48)
    trainer = run_train(tmp / "run", [
        *tiny_data(tmp / "c", tmp / "cache"), "data.vocab_size=320", "model=tiny", "model.d_model=64",
        "model.d_ff=128", "model.dropout=0.0", "optim.lr=3e-3", "optim.warmup_steps=20", "trainer.precision=32-true",
        "trainer.max_epochs=24", "trainer.check_val_every_n_epoch=12", "trainer.enable_progress_bar=false", "~logger",
    ])  # fmt: skip
    return tmp, trainer, tmp / "run" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="session")
def multi30k_cache(tmp_path_factory):
    """One data cache for every test on Multi30k in a run: its tokenizer is trained once per language pair."""
    return tmp_path_factory.mktemp("multi30k_cache")
