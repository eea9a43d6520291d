"""scripts/reproduce_teacher_student.py: its scheduler (each step after its inputs, at most one per slot, each on
its own cores, nothing new after a failure or the deadline), and the pipeline end to end at a small scale (1,500
Multi30k pairs, 100 captions, 12 steps per model) under the GPU's concurrent schedule rehearsed on this CPU: stopped
at a deadline as a lease would stop it (packed all the same), then run again to the end: a reverse model,
back-translation (beam and sampled), teachers with and without it, an ensemble, a distilled corpus, two students on
it and on the original data, int8 exports with and without a shortlist, the table, the packed results; run again
under the serial schedule, it redoes nothing."""

import argparse
import dataclasses
import gzip
import itertools
import os
import runpy
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from .helpers import MULTI30K, ROOT
from .helpers.prerequisites import require

CAPTIONS = ROOT / "data" / "multi30k_captions"
TABLE = runpy.run_path(str(ROOT / "scripts" / "teacher_student_table.py"))
SCRIPT = ROOT / "scripts" / "reproduce_teacher_student.py"
PIPELINE = runpy.run_path(str(SCRIPT))
Step, run_steps, StepFailed = PIPELINE["Step"], PIPELINE["run_steps"], PIPELINE["StepFailed"]


def recorder(log: list, barrier: threading.Barrier | None = None, fail: bool = False):
    """A step's work that records (its name is given later), meets the others at `barrier`, or fails."""

    def work(name: str, cores: list[int]) -> None:
        log.append(("start", name, tuple(cores)))
        if barrier is not None:
            barrier.wait()  # broken (an error) unless every party runs at once
        if fail:
            raise StepFailed(f"{name} failed")
        log.append(("end", name))

    return work


def steps_of(spec: dict[str, tuple[str, ...]], work) -> list:
    return [Step(name, lambda cores, name=name: work(name, cores), after) for name, after in spec.items()]


def test_one_slot_runs_the_steps_one_at_a_time_in_list_order_each_after_its_inputs():
    log = []
    spec = {"a": (), "b": ("c",), "c": (), "d": ("a", "b")}
    assert run_steps(steps_of(spec, recorder(log)), [[0, 1]], say=lambda _: None) == []
    assert [entry[1] for entry in log] == ["a", "a", "c", "c", "b", "b", "d", "d"]  # b waits for c, started after it


def test_slots_run_independent_steps_at_once_on_their_own_cores_and_dependents_after_them():
    log, barrier = [], threading.Barrier(2, timeout=20)
    meet = recorder(log, barrier)
    steps = [Step("x", lambda c: meet("x", c)), Step("y", lambda c: meet("y", c)),
             Step("z", lambda c: recorder(log)("z", c), ("x", "y"))]  # fmt: skip
    assert run_steps(steps, [[0], [1]], say=lambda _: None) == []
    starts = {entry[1]: entry[2] for entry in log if entry[0] == "start"}
    assert {starts["x"], starts["y"]} == {(0,), (1,)}  # met at the barrier: at once, each on its own core
    assert log.index(("start", "z", starts["z"])) > max(log.index(("end", "x")), log.index(("end", "y")))


def test_more_ready_steps_than_slots_wait_for_a_free_one():
    running, most, lock = [0], [0], threading.Lock()

    def work(cores: list[int]) -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1

    assert run_steps([Step(f"s{i}", work) for i in range(6)], [[0], [1]], say=lambda _: None) == []
    assert most[0] == 2


def test_after_a_failure_nothing_new_starts_and_the_unfinished_steps_are_named():
    log = []
    steps = [Step("bad", lambda c: recorder(log, fail=True)("bad", c)), Step("next", lambda c: recorder(log)("next", c)),
             Step("child", lambda c: recorder(log)("child", c), ("bad",))]  # fmt: skip
    said = []
    assert run_steps(steps, [[0]], say=said.append) == ["bad", "next", "child"]
    assert [entry[1] for entry in log] == ["bad"] and any(
        "bad: FAILED: StepFailed: bad failed" in line for line in said
    )


def test_at_the_deadline_what_runs_is_stopped_and_nothing_more_starts():
    stopped, log = threading.Event(), []

    def long_step(cores: list[int]) -> None:
        if not stopped.wait(timeout=30):
            raise AssertionError("never stopped")
        raise StepFailed("stopped")  # as a training that saved last.ckpt on SIGTERM exits: with an error

    steps = [Step("long", long_step), Step("after", lambda c: recorder(log)("after", c), ("long",)),
             Step("quick", lambda c: recorder(log)("quick", c))]  # fmt: skip
    left = run_steps(steps, [[0]], deadline=time.monotonic() + 0.3, stop=stopped.set, say=lambda _: None)
    assert stopped.is_set() and left == ["long", "after", "quick"] and log == []


def pipeline_steps(tmp_path: Path, device: str = "cuda") -> list:
    args = argparse.Namespace(out=tmp_path, bt_weights="1.0 0.5", overrides=[], splits="val test", test_split="test",
                              main=tmp_path, decode_max_tokens=65536)  # fmt: skip
    return PIPELINE["Pipeline"](args, PIPELINE["Commands"](tmp_path / "logs"), device, "here").steps()


def test_the_gpu_schedule_starts_the_five_trainings_that_need_nothing_at_once_then_the_critical_path():
    steps, log = pipeline_steps(Path("/nonexistent")), []
    independent = ["train_reverse", "train_base", "train_base_seed2", "train_student_tiny_original",
                   "train_student_deep_shallow_original"]  # fmt: skip
    barrier = threading.Barrier(len(independent), timeout=20)

    def work(name: str, cores: list[int]) -> None:
        log.append(name)  # as it starts
        if name in independent:
            barrier.wait()  # broken unless all five run at once

    fake = [dataclasses.replace(step, work=lambda cores, name=step.name: work(name, cores)) for step in steps]
    assert run_steps(fake, [[i] for i in range(5)], say=lambda _: None) == []
    later = log[len(independent) + 1 :]  # the inputs first, then the five
    assert set(log[1 : len(independent) + 1]) == set(independent) and log[0] == "inputs"
    assert (
        later.index("train_student_tiny_distilled")
        > later.index("translate_distilled")
        > later.index("choose_teacher")
        > max(later.index(f"evaluate_{name}") for name in ("ensemble", "bt_beam_w1.0", "bt_sampled_w0.5"))
    )
    assert later.index("train_bt_beam_w0.5") > later.index("translate_bt_beam")


def test_a_freed_slot_goes_to_the_critical_path_before_what_only_the_table_waits_for():
    started = []
    fake = [dataclasses.replace(step, work=lambda cores, name=step.name: started.append(name))
            for step in pipeline_steps(Path("/nonexistent"))]  # fmt: skip
    assert run_steps(fake, [[0], [1]], say=lambda _: None) == []
    assert started[:3] == ["inputs", "train_reverse", "train_base"]  # the first two trainings in the list
    assert started.index("translate_bt_beam") < started.index("train_student_tiny_original")


def test_every_model_is_pinned_to_one_precision_before_the_first_trains():
    pinned = PIPELINE["pinned_precision"]
    assert pinned([], "cuda") == "bf16-mixed"  # a GPU: bf16, whichever model starts first
    assert pinned(["trainer.precision=32-true"], "cuda") == "32-true"  # an override: for every model
    assert pinned(["trainer.precision=bf16-mixed"], "cpu") == "bf16-mixed"
    import transformer.machine.precision as precision

    for speedup, chosen in ((2.0, "bf16-mixed"), (0.5, "32-true")):  # a CPU's: what auto measures for it
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(precision, "bf16_speedup", lambda *a, speedup=speedup, **k: speedup)
            assert pinned([], "cpu") == chosen


def test_core_slots_are_disjoint_and_refuse_more_slots_than_cores():
    slots = PIPELINE["core_slots"](2)
    assert len(slots) == 2 and not set(slots[0]) & set(slots[1]) and all(slots)
    with pytest.raises(SystemExit, match="--slots 99"):
        PIPELINE["core_slots"](99)


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


@pytest.mark.slow  # 11 trainings, 3 corpus translations, 6 exports in subprocesses, 2 at a time: 5-6 minutes
def test_the_pipeline_under_the_gpu_schedule_stops_at_its_deadline_resumes_and_the_serial_one_then_redoes_nothing(
    tmp_path,
):
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
    options = [f"--out={out}", "--steps=12", f"--main={main}", f"--captions={captions}", "--caption-lines=100",
               "--splits=val test", "--test-split=test", "--bt-weights=1.0",
               "--export-args=bleu_tolerance=100 parity_sentences=20"]  # fmt: skip  # 12 steps: the gate's rule aside
    args = [f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=1000", "data.max_tokens=600", "model.d_model=64",
            "model.d_ff=128", "trainer.enable_progress_bar=false"]  # fmt: skip
    stale = out / "eval" / "old_run" / "val" / "scores.json"  # a folder from another run: never the teacher
    stale.parent.mkdir(parents=True)
    stale.write_text('{"bleu": 99.0, "chrf": 99.0}')
    packed = tmp_path / "results.tar.gz"
    gpu_schedule = ["--schedule=concurrent", "--slots=2", "--speed-sentences=10", f"--pack={packed}"]
    models = ["reverse", "base", "base_seed2", "bt_beam_w1.0", "bt_sampled_w1.0", "student_tiny_distilled",
              "student_tiny_original", "student_deep_shallow_distilled", "student_deep_shallow_original"]  # fmt: skip
    stopped = subprocess.run([sys.executable, str(SCRIPT), *options, *gpu_schedule, "--minutes=0.75", *args],
                             capture_output=True, text=True, cwd=ROOT)  # fmt: skip  # as a lease's deadline
    assert stopped.returncode == 1 and "the deadline: stopping" in stopped.stdout, stopped.stdout[-3000:]
    with tarfile.open(packed) as tar:  # packed all the same, with the table of what was done
        assert {"table.md", "logs/schedule.log"} <= set(tar.getnames())
    assert not all((out / name / "done").exists() for name in models)  # something left to resume
    run = subprocess.run([sys.executable, str(SCRIPT), *options, *gpu_schedule, *args], capture_output=True,
                         text=True, cwd=ROOT)  # fmt: skip  # the same command again, on the still-warm machine
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    table = (out / "table.md").read_text()
    for name in [m for m in models if m != "reverse"] + ["ensemble"]:
        assert f"| {name} | " in table, name
    for name in models:
        assert (out / name / "done").exists(), name
    for corpus, lines in (("bt_beam", 100), ("bt_sampled", 100), ("distilled", 1500 + 100)):
        with gzip.open(out / corpus / "train.en.gz", "rt") as f:
            assert len(f.read().splitlines()) == lines, corpus
        row = next(row for row in table.splitlines() if row.startswith(f"| {corpus} | "))
        assert f"| {lines:,} | {lines:,} |" in row and row.endswith(", 2 steps at once |"), row  # lines, pairs, on
    teacher = (out / "teacher").read_text().strip()
    assert f"| {teacher} | " in table and teacher != "old_run"
    precision = (out / "precision").read_text().strip()  # pinned before the first model: every model's
    schedule = (out / "logs" / "schedule.log").read_text()
    for name in models:  # a line per start (a stopped one: up to its last save): its seconds, then the machine
        starts = [line.split(" ", 1) for line in (out / name / "wall_clock_s").read_text().splitlines()]
        assert sum(int(seconds) for seconds, _ in starts) > 0 and not (out / name / "wall_clock_s.start").exists()
        machine = starts[-1][1]
        assert (
            all(on.endswith(", 2 steps at once") for _, on in starts) and f"train_{name}: started on cores" in schedule
        )
        assert f"trainer.precision={precision}" in (out / name / ".hydra" / "overrides.yaml").read_text()
        overrides = (out / name / ".hydra" / "overrides.yaml").read_text()
        workers = int(overrides.split("data.num_workers=")[1].split()[0])  # beside the training process, in its cores
        assert workers <= 2 and workers < len(PIPELINE["core_slots"](2)[0]) and (os.cpu_count() > 2 or workers == 0)
        if name != "reverse":
            row = next(row for row in table.splitlines() if row.startswith(f"| {name} |"))
            assert f"| {machine}, {precision} |" in row
        assert "transformer.train" in (out / "logs" / f"train_{name}.log").read_text()
    export_rows = table.split("| int8 export |")[1].split("\n\n")[0].splitlines()[2:]
    exports = [row.split(" | ")[0][2:] for row in export_rows]
    plain = [name for name in exports if not name.endswith("_shortlist")]  # each twice: plain and shortlisted
    assert len(exports) == 6 and sorted(exports) == sorted(plain + [f"{name}_shortlist" for name in plain])
    assert {"student_tiny_distilled", "student_deep_shallow_distilled"} < set(plain)
    assert "on 10 sentences of" in table  # --speed-sentences
    aims = table.split("| aim | result | met |")[1].splitlines()[2:]
    assert len(aims) == 6 and all(row.endswith(("| yes |", "| no |")) for row in aims)  # the speed aim too
    assert (out / "teachers").read_text().split() == ["base", "base_seed2", "bt_beam_w1.0", "bt_sampled_w1.0"]
    with gzip.open(out / "distilled" / "train.de.gz", "rt") as f:  # Multi30k's German, then the captions'
        with gzip.open(main / "train.de.gz", "rt") as m:
            assert f.read().splitlines()[:1500] == m.read().splitlines()
    with tarfile.open(packed) as tar:  # what a lent machine brings back: no weights, tokenizers or corpora
        names = tar.getnames()
    assert {"table.md", "logs/schedule.log", "logs/train_reverse.log", "eval/base/test/test.beam5.json"} <= set(names)
    assert not [n for n in names if n.endswith((".ckpt", ".bin", ".gz", ".model"))]
    written = {path: path.stat().st_mtime_ns for path in out.rglob("*")
               if path.is_file() and "table" not in path.name and "logs" not in path.parts}  # fmt: skip
    again = subprocess.run([sys.executable, str(SCRIPT), *options, "--schedule=serial", *args], capture_output=True,
                           text=True, cwd=ROOT)  # fmt: skip
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    changed = [str(p) for p, t in written.items() if not p.exists() or p.stat().st_mtime_ns != t]
    assert not changed and "nothing to translate" in again.stderr, changed[:5]  # no checkpoint, corpus or score
    assert (out / "table.md").read_text().split("The int8 exports")[0] == table.split("The int8 exports")[0]


def test_stopping_the_commands_ends_the_running_one_with_its_log_named_and_refuses_the_next(tmp_path):
    commands = PIPELINE["Commands"](tmp_path / "logs")
    errors = []

    def sleeper() -> None:
        try:
            commands("step", [0], "-c", "import time; print('up', flush=True); time.sleep(60)")
        except StepFailed as e:
            errors.append(str(e))

    thread = threading.Thread(target=sleeper)
    thread.start()
    log = tmp_path / "logs" / "step.log"
    deadline = time.monotonic() + 120  # until the child runs (a loaded machine starts Python slowly)
    while "up" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    commands.stop()
    thread.join(timeout=30)
    assert not thread.is_alive() and errors and f"its log: {log}" in errors[0] and "-15" in errors[0]
    with pytest.raises(StepFailed, match="stopped at the deadline"):
        commands("next", [0], "-c", "pass")
