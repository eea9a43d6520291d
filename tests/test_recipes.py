"""The Multi30k recipes' scripts end to end: reproduce (train, average, evaluate, table) and time to quality."""

import os
import re
import runpy
import subprocess

import pytest

from .helpers import MULTI30K, ROOT
from .helpers.prerequisites import require

pytestmark = pytest.mark.slow  # the reproduce script end to end, about 3 minutes; time_to_bleu decodes 4 times


def test_reproduce_script_trains_averages_evaluates_and_prints_the_table(tmp_path, multi30k_cache):
    require(MULTI30K.exists(), "data/multi30k", 'link it: ln -s "$PWD/../shared/data/multi30k" data/multi30k')
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


def test_time_to_bleu_finds_the_first_checkpoint_reaching_the_score(trained, capsys):
    """A score between the validation BLEU of the run's first two checkpoints (each kept with it in its name): the
    first by step falls short, the second reaches it, and scoring stops there. The script runs in this process."""
    tmp, trainer, last = trained
    folder = last.parent
    named = (re.fullmatch(r"epoch\d+-step(\d+)-bleu(\d+\.\d+)\.ckpt", p.name) for p in folder.iterdir())
    (first_step, first_bleu), (second_step, second_bleu), *_ = sorted((int(m[1]), float(m[2])) for m in named if m)
    assert second_bleu > first_bleu + 20, (first_bleu, second_bleu)  # room for greedy search's own score
    score = round((first_bleu + second_bleu) / 2, 1)
    time_to_bleu = runpy.run_path(str(ROOT / "scripts" / "time_to_bleu.py"))["main"]
    time_to_bleu([str(folder), "--bleu", str(score), "--split", "val", "--beam-size", "1"])  # as validation decodes
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line[2:3].isdigit()]
    assert [int(row[1]) for row in rows] == [first_step, second_step]  # by step, none after the first to reach it
    assert float(rows[0][3]) < score <= float(rows[1][3])
    assert f"BLEU {score} first reached at step {second_step}," in out
    time_to_bleu([str(folder), "--bleu", "101", "--split", "val", "--beam-size", "1"])
    assert "BLEU 101.0 not reached by any checkpoint" in capsys.readouterr().out
