"""The Multi30k recipes' scripts end to end: reproduce (train, average, evaluate, table) and time to quality."""

import os
import subprocess
import sys

import pytest

from .helpers import MULTI30K, ROOT

pytestmark = pytest.mark.slow  # subprocesses end to end: the reproduce script about 3 minutes, time_to_bleu 25 s


@pytest.mark.skipif(not MULTI30K.exists(), reason="Multi30k is not linked into data/ (see data/README.md)")
def test_reproduce_script_trains_averages_evaluates_and_prints_the_table(tmp_path, multi30k_cache):
    out = tmp_path / "out"
    tiny = ["model.size=tiny", "trainer.max_time=null", "trainer.max_epochs=2", "trainer.limit_train_batches=3",
            "trainer.log_every_n_steps=1", "validation.bleu_max_sentences=8", f"data.cache_dir={multi30k_cache}",
            "trainer.enable_progress_bar=false"]  # fmt: skip
    env = {**os.environ, "PAIRS": "de-en", "OUT": str(out), "AVERAGE": "2"}
    done = subprocess.run(["bash", "scripts/reproduce_multi30k.sh", *tiny], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout[done.stdout.index("| direction | model |") :].splitlines()
    training = next(line for line in table if line.startswith("| de->en | tiny |"))
    assert training.split("|")[4].strip() == "6"  # steps: 2 epochs of 3 batches
    cells = [[c.strip() for c in line.split("|")[2:5]] for line in table if line.startswith("| de->en |")]
    evaluations = {tuple(c) for c in cells if c[0].endswith((".ckpt", ".pt"))}
    assert evaluations == {("last.ckpt", "test_2016_flickr", "greedy"), ("average.pt", "val", "beam 5"),
                           ("average.pt", "test_2016_flickr", "beam 5")}  # fmt: skip
    assert (out / "de-en" / "wall_clock_s").exists()


def test_time_to_bleu_finds_the_first_checkpoint_reaching_the_score(trained):
    tmp, trainer, last = trained
    folder = last.parent
    done = subprocess.run([sys.executable, "scripts/time_to_bleu.py", str(folder), "--bleu", "0", "--split", "val"],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    first_step = min(int(line.split("|")[1]) for line in done.stdout.splitlines() if line[2:3].isdigit())
    assert f"first reached at step {first_step}," in done.stdout
    unreachable = subprocess.run([sys.executable, "scripts/time_to_bleu.py", str(folder), "--bleu", "101"],
                                 cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert "not reached by any checkpoint" in unreachable.stdout
