"""scripts/reproduce_teacher_student.sh end to end at a small scale (1,500 Multi30k pairs, 100 captions, 12 steps per
model): a reverse model, back-translation (beam and sampled), teachers with and without it, an ensemble, a
distilled corpus, two students on it and on the original data, int8 exports with and without a shortlist, the table; run again, it redoes
nothing."""

import gzip
import itertools
import os
import runpy
import subprocess
from pathlib import Path

import pytest

from .helpers import MULTI30K, ROOT
from .helpers.prerequisites import require

CAPTIONS = ROOT / "data" / "multi30k_captions"
TABLE = runpy.run_path(str(ROOT / "scripts" / "teacher_student_table.py"))


def test_the_aims_judge_test_bleu_with_every_choice_made_on_val(tmp_path):
    val_test = {"base": (26.0, 26.1), "base_seed2": (26.0, 26.5), "ensemble": (26.8, 27.0), "bt_beam_w1.0": (27.5, 26.9),
                "bt_sampled_w1.0": (27.0, 28.0), "bt_old": (40.0, 40.0), "student_deep_shallow_distilled": (25.0, 25.4),
                "student_deep_shallow_original": (24.0, 24.5), "student_tiny_distilled": (20.0, 20.0),
                "student_tiny_original": (18.0, 18.9)}  # fmt: skip
    for name, (val, test) in val_test.items():  # bt_old: a folder the pipeline's teachers do not name
        for split, bleu in (("val", val), ("test", test)):
            (tmp_path / "eval" / name / split).mkdir(parents=True)
            (tmp_path / "eval" / name / split / "scores.json").write_text(f'{{"bleu": {bleu}, "chrf": 0}}')
    (tmp_path / "teachers").write_text("base base_seed2 bt_beam_w1.0 bt_sampled_w1.0\n")
    (tmp_path / "ensemble_members").write_text("base base_seed2\n")
    (tmp_path / "teacher").write_text("ensemble\n")
    assert TABLE["best_teacher"](tmp_path, single=False) == "bt_beam_w1.0"
    rates = {"bt_beam_w1.0": [70.0, 95.0], "student_deep_shallow_distilled": [90.0, 160.0],
             "student_deep_shallow_distilled_shortlist": [224.0, 320.0]}  # fmt: skip
    rows = {
        aim.split(":")[0]: (result, met)
        for aim, result, met in TABLE["aims"](TABLE["scores"](tmp_path), tmp_path, rates, "test")
    }
    assert rows["ensemble of two"] == ("ensemble 27.00 against base_seed2 26.50: +0.50", True)  # val tied: the harder
    assert rows["back-translation"] == ("bt_beam_w1.0 26.90 against base 26.10: +0.80", False)  # chosen on val
    assert rows["deep-shallow"] == ("student_deep_shallow_distilled 25.40 against ensemble 27.00: -1.60", False)
    speed, met = rows["deep-shallow int8"]  # against the exported teacher: the best single one on val
    assert met and speed.endswith("_shortlist 224.0 against bt_beam_w1.0 70.0: 3.20x") and "1.29x" in speed
    assert rows["distilled deep_shallow"][1] is False and rows["distilled tiny"][1] is True
    (tmp_path / "eval" / "student_tiny_original" / "test" / "scores.json").unlink()  # a run under way
    rows = {
        aim.split(":")[0]: (result, met)
        for aim, result, met in TABLE["aims"](TABLE["scores"](tmp_path), tmp_path, {}, "test")
    }
    assert rows["distilled tiny"] == ("not yet scored", None) and "deep-shallow int8" not in rows
    assert rows["ensemble of two"][1] is True


def write_head(source: Path, target: Path, n: int) -> list[str]:
    with gzip.open(source, "rt", encoding="utf-8") as f:
        lines = list(itertools.islice(f, n))
    target.write_bytes(gzip.compress("".join(lines).encode()))
    return [line.rstrip("\n") for line in lines]


@pytest.mark.slow  # 11 trainings, 4 corpus translations, 6 exports in subprocesses: about 5 minutes
def test_the_pipeline_runs_end_to_end_and_a_second_run_redoes_nothing(tmp_path):
    for folder in (MULTI30K, CAPTIONS):
        require(folder.is_dir(), str(folder), f'link it: ln -s "$PWD/../shared/data/{folder.name}" data/{folder.name}')
    main, captions, out = tmp_path / "main", tmp_path / "captions", tmp_path / "out"
    main.mkdir()
    captions.mkdir()
    for split, name, n in (("train", "train", 1500), ("val", "val", 20), ("test_2016_flickr", "test", 20)):
        for lang in ("de", "en"):
            write_head(MULTI30K / f"{split}.{lang}.gz", main / f"{name}.{lang}.gz", n)
    for k, lang in itertools.product(range(1, 6), ("de", "en")):
        write_head(CAPTIONS / f"train.{k}.{lang}.gz", captions / f"train.{k}.{lang}.gz", 30)
    env = {
        **os.environ,
        "OUT": str(out),
        "STEPS": "12",
        "MAIN": str(main),
        "CAPTIONS": str(captions),
        "CAPTION_LINES": "100",
        "SPLITS": "val test",
        "TEST_SPLIT": "test",
        "BT_WEIGHTS": "1.0",
        "EXPORT_ARGS": "bleu_tolerance=100 parity_sentences=20",
    }  # a model of 12 steps: the gate's rule aside
    args = [f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=1000", "data.max_tokens=600", "model.d_model=64",
            "model.d_ff=128", "trainer.enable_progress_bar=false"]  # fmt: skip
    stale = out / "eval" / "old_run" / "val" / "scores.json"  # a folder from another run: never the teacher
    stale.parent.mkdir(parents=True)
    stale.write_text('{"bleu": 99.0, "chrf": 99.0}')
    script = str(ROOT / "scripts" / "reproduce_teacher_student.sh")
    run = subprocess.run(["bash", script, *args], env=env, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    table = (out / "table.md").read_text()
    models = ["reverse", "base", "base_seed2", "bt_beam_w1.0", "bt_sampled_w1.0", "student_tiny_distilled",
              "student_tiny_original", "student_deep_shallow_distilled", "student_deep_shallow_original"]  # fmt: skip
    for name in [m for m in models if m != "reverse"] + ["ensemble"]:
        assert f"| {name} | " in table, name
    for name in models:
        assert (out / name / "done").exists(), name
    for corpus, lines in (("bt_beam", 100), ("bt_sampled", 100), ("distilled", 1500 + 100)):
        with gzip.open(out / corpus / "train.en.gz", "rt") as f:
            assert len(f.read().splitlines()) == lines, corpus
    teacher = (out / "teacher").read_text().strip()
    assert f"| {teacher} | " in table and teacher != "old_run"
    precision = (out / "precision").read_text().strip()  # the reverse model's, every model's
    for name in models:  # one start each: its seconds, then the machine, which the table names
        seconds, machine = (out / name / "wall_clock_s").read_text().rstrip("\n").split(" ", 1)
        assert int(seconds) > 0 and not (out / name / "wall_clock_s.start").exists()
        if name != "reverse":
            row = next(row for row in table.splitlines() if row.startswith(f"| {name} |"))
            assert f"| {machine}, {precision} |" in row
            assert f"trainer.precision={precision}" in (out / name / ".hydra" / "overrides.yaml").read_text()
    export_rows = table.split("| int8 export |")[1].split("\n\n")[0].splitlines()[2:]
    exports = [row.split(" | ")[0][2:] for row in export_rows]
    plain = [name for name in exports if not name.endswith("_shortlist")]  # each twice: plain and shortlisted
    assert len(exports) == 6 and sorted(exports) == sorted(plain + [f"{name}_shortlist" for name in plain])
    assert {"student_tiny_distilled", "student_deep_shallow_distilled"} < set(plain)
    aims = table.split("| aim | result | met |")[1].splitlines()[2:]
    assert len(aims) == 6 and all(row.endswith(("| yes |", "| no |")) for row in aims)  # the speed aim too
    assert (out / "teachers").read_text().split() == ["base", "base_seed2", "bt_beam_w1.0", "bt_sampled_w1.0"]
    with gzip.open(out / "distilled" / "train.de.gz", "rt") as f:  # Multi30k's German, then the captions'
        with gzip.open(main / "train.de.gz", "rt") as m:
            assert f.read().splitlines()[:1500] == m.read().splitlines()
    written = {path: path.stat().st_mtime_ns for path in out.rglob("*") if path.is_file() and "table" not in path.name}
    again = subprocess.run(["bash", script, *args], env=env, capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    changed = [str(p) for p, t in written.items() if not p.exists() or p.stat().st_mtime_ns != t]
    assert not changed and "nothing to translate" in again.stderr, changed[:5]  # no checkpoint, corpus or score
    assert (out / "table.md").read_text().split("The int8 exports")[0] == table.split("The int8 exports")[0]
