"""From teacher to deployable student (docs/teacher_student.md), de->en on Multi30k:
  1. a reverse en->de model; it back-translates the English captions of Multi30k's images (beam, and sampled);
  2. de->en teachers: the recipe alone (two seeds, for an ensemble) and with each back-translated corpus, tagged
     __bt__, mixed in by each weight of --bt-weights;
  3. the best teacher on val (a single model or the ensemble) translates Multi30k's German and the German captions
     with beam search: the distilled corpus;
  4. students (model=tiny and model=deep_shallow) trained on the distilled corpus and on the original data;
  5. the best single teacher and the distilled students exported to int8 behind the parity gate, each plain and
     with a lexical shortlist (vmap.txt) from its own training pairs;
  6. every model evaluated (EMA weights, beam 5), one table at the end, with int8 speed on 1 and 2 threads of this
     machine's CPU, timed once everything else has finished.
Every model trains --steps steps. Each step skips what is done and resumes what was stopped: run it again after a
stop. Extra arguments are Hydra overrides for every training run (a step's own, such as model=, come after them).

The schedule follows the machine (--schedule auto). On a CPU, `serial`: one step at a time on every core, its output
in this terminal. Where a GPU is found, `concurrent`: each step starts as soon as its inputs exist, up to --slots
at once, each on its own share of the cores (threads and loader workers sized to it) and writing OUT/logs/STEP.log;
the small model is host-bound on a GPU, so several trainings share one. Both run the same steps with the same skip
rules; every model trains in one precision, pinned before the first starts (OUT/precision: bf16 on a GPU).

    python scripts/reproduce_teacher_student.py                            # every model at the recipe's 4,738 steps
    python scripts/reproduce_teacher_student.py --steps 1500 --out outputs/ts_short
    python scripts/reproduce_teacher_student.py --splits val               # while choosing: no test split
    python scripts/reproduce_teacher_student.py --minutes 9 --pack R.tgz   # a lent GPU: docs/gpu_runs.md
"""

import argparse
import gzip
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "scripts" / "teacher_student_table.py"
PACKED_BYTES = 1 << 20  # a file above it is left out of --pack (a log: its last PACKED_BYTES)
UNPACKED = (".ckpt", ".bin", ".model", ".vocab", ".npy", ".arrow", ".gz")  # weights, tokenizers, corpora


@dataclass(frozen=True)
class Step:
    name: str
    work: Callable[[list[int]], None]  # given the cores it may use
    after: tuple[str, ...] = ()
    light: bool = False  # bookkeeping of a moment: runs in the scheduler's thread and takes no slot


class StepFailed(Exception):
    """A step's command exited with an error, or was stopped at the deadline."""


def run_steps(steps: list[Step], slots: list[list[int]], deadline: float | None = None,
              stop: Callable[[], None] = lambda: None, say: Callable[[str], None] = print) -> list[str]:  # fmt: skip
    """Each step once every step of its `after` has finished, the first ready in list order first, up to
    len(slots) at once, each on its own slot's cores. After a failure, or once time.monotonic() passes `deadline`,
    nothing more starts; at the deadline, or if this is interrupted, `stop()` is called once (it stops what runs).
    The steps left unfinished."""
    names = [step.name for step in steps]
    unknown = {a for step in steps for a in step.after} - set(names)
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"steps after unknown steps {sorted(unknown)}, or named twice: {names}")
    finished, failed, pending, running = set(), [], list(steps), {}
    free, stopped, began = list(range(len(slots))), False, time.monotonic()

    def log(step: Step, what: str) -> None:
        say(f"[{time.monotonic() - began:7.1f} s] {step.name}: {what}")

    def ran(step: Step, work: Callable[[], None]) -> None:
        try:
            work()
            finished.add(step.name)
            log(step, "finished")
        except Exception as e:  # noqa: BLE001 (whatever a step raises, the run goes on as after any failure)
            failed.append(step.name)
            log(step, f"FAILED: {type(e).__name__}: {e}")

    with ThreadPoolExecutor(max_workers=len(slots)) as pool:
        try:
            while True:
                late = deadline is not None and time.monotonic() >= deadline
                ready = [] if failed or late else [s for s in pending if set(s.after) <= finished]
                light = next((step for step in ready if step.light), None)
                if light is not None:  # at once, then look again: it may make others ready
                    pending.remove(light)
                    ran(light, lambda: light.work([]))
                    continue
                for step in ready:
                    if not free:
                        break
                    slot = free.pop(0)
                    pending.remove(step)
                    running[pool.submit(step.work, slots[slot])] = step, slot
                    log(step, f"started on cores {','.join(map(str, slots[slot]))}" if len(slots) > 1 else "started")
                if not running:
                    break
                timeout = None if deadline is None or stopped else max(deadline - time.monotonic(), 0.0)
                done, _ = wait(running, timeout=timeout, return_when=FIRST_COMPLETED)
                if not done and not stopped:  # the deadline: what runs is stopped (a training saves its last.ckpt)
                    stopped = True
                    say(f"[{time.monotonic() - began:7.1f} s] the deadline: stopping {len(running)} running steps")
                    stop()
                for future in done:
                    step, slot = running.pop(future)
                    free.append(slot)
                    ran(step, future.result)
        except BaseException:  # interrupted (Ctrl-C, a signal): what runs stops too, before the pool waits for it
            if not stopped:
                stop()
            raise
    return [name for name in names if name not in finished]


def core_slots(count: int) -> list[list[int]]:
    """This process's cores in `count` equal slots (any left over unused: the scheduler's and the GPU driver's)."""
    cores = sorted(os.sched_getaffinity(0))
    if not 1 <= count <= len(cores):
        raise SystemExit(f"--slots {count}: between 1 and this machine's {len(cores)} cores")
    size = len(cores) // count
    return [cores[i * size : (i + 1) * size] for i in range(count)]


def cuda_device() -> str | None:
    """The GPU's name, or None where none answers (no driver, no nvidia-smi)."""
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=60)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return found.stdout.splitlines()[0].strip() if found.returncode == 0 and found.stdout.strip() else None


def machine(gpu: str | None, slots: int) -> str:
    """The processor (and GPU) steps run on, for the table: minutes belong to one machine and one schedule."""
    info = Path("/proc/cpuinfo").read_text()
    cpu, flags = re.search(r"^model name\s*: (.*)$", info, re.M), re.search(r"^flags\s*: (.*)$", info, re.M)
    flags = set(flags.group(1).split()) if flags else set()
    isa = [name for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "BF16"),
                                   ("amx_tile", "AMX")) if flag in flags]  # fmt: skip
    cores = len(os.sched_getaffinity(0))
    text = f"{cpu.group(1) if cpu else 'unknown CPU'} ({' '.join(isa) or 'no AVX2'}, {cores} cores)"
    return text + (f" + {gpu}" if gpu else "") + (f", {slots} steps at once" if slots > 1 else "")


class Commands:
    """The pipeline's commands as subprocesses of this Python: with one slot in this terminal; with several each
    pinned to its slot's cores (OMP_NUM_THREADS too) and appending to OUT/logs/STEP.log. stop() sends SIGTERM to
    every one still running: a training saves last.ckpt and exits, a corpus translation keeps its chunks."""

    def __init__(self, logs: Path | None):
        self.logs, self.live, self.lock, self.stopped = logs, set(), threading.Lock(), False

    def __call__(self, step: str, cores: list[int], *args: str) -> None:
        command, env, log = [sys.executable, *args], dict(os.environ), None
        if self.logs is not None:
            self.logs.mkdir(parents=True, exist_ok=True)
            env["OMP_NUM_THREADS"] = str(max(len(cores), 1))
            if cores and shutil.which("taskset"):  # taskset execs the command: its pid is the one stop() signals
                command = ["taskset", "--cpu-list", ",".join(map(str, cores)), *command]
            log = self.logs / f"{step}.log"
        with open(log or os.devnull, "a", encoding="utf-8") as out:
            out.write(f"\n$ {' '.join(command)}\n")
            out.flush()
            with self.lock:
                if self.stopped:  # a step's next command, after the deadline
                    raise StepFailed("stopped at the deadline")
                process = subprocess.Popen(
                    command, cwd=ROOT, env=env, stdout=log and out, stderr=log and subprocess.STDOUT
                )
                self.live.add(process)
            code = process.wait()
            with self.lock:
                self.live.discard(process)
        if code:
            raise StepFailed(f"{' '.join(args[:2])} exited with {code}" + (f"; its log: {log}" if log else ""))

    def stop(self, grace: float = 60.0) -> None:
        """SIGTERM now, SIGKILL to any still running `grace` seconds later (a training stops at its next batch)."""
        with self.lock:
            self.stopped = True
            for process in self.live:
                process.terminate()
        timer = threading.Timer(grace, self.kill)
        timer.daemon = True
        timer.start()

    def kill(self) -> None:
        with self.lock:
            for process in self.live:
                process.kill()


class Pipeline:
    """The pipeline's steps over one folder, OUT (see the module's docstring)."""

    def __init__(self, args: argparse.Namespace, commands: Commands, device: str, on: str):
        self.args, self.out, self.commands, self.device, self.on = args, args.out, commands, device, on
        self.concurrent = commands.logs is not None
        self.prepare_lock = threading.Lock()  # caches written one at a time: a tokenizer trained once, not raced
        members = ["base", "base_seed2"]
        bt = [f"bt_{source}_w{weight}" for source in ("beam", "sampled") for weight in args.bt_weights.split()]
        self.members, self.teachers = members, members + bt

    def ckpt(self, name: str) -> str:
        return str(self.out / name / "checkpoints" / "last.ckpt")

    def ensemble_ckpt(self) -> str:
        return f"[{','.join(self.ckpt(member) for member in self.members)}]"

    def teacher_ckpt(self) -> str:
        teacher = (self.out / "teacher").read_text().strip()
        return self.ensemble_ckpt() if teacher == "ensemble" else self.ckpt(teacher)

    def steps(self) -> list[Step]:
        """In the order a free slot takes them: the critical path (reverse model, back-translation, its teachers,
        the distilled corpus, the distilled students) before what only the table waits for."""
        out, weights, sources = self.out, self.args.bt_weights.split(), ("beam", "sampled")
        steps = [
            Step("inputs", lambda _: self.inputs(), light=True),
            Step("train_reverse", self.train("reverse", "data.src=en", "data.tgt=de"), ("inputs",)),
            Step("train_base", self.train("base", "seed=1"), ("inputs",)),
            Step("train_base_seed2", self.train("base_seed2", "seed=2"), ("inputs",)),
        ]
        for source in sources:
            steps.append(Step(f"translate_bt_{source}", self.back_translate(source), ("train_reverse",)))
        for source in sources:
            for weight in weights:
                mix = (f"+data.corpora.bt.path={out / f'bt_{source}'}", "+data.corpora.bt.tag=__bt__",
                       f"+data.corpora.bt.weight={weight}")  # fmt: skip
                name = f"bt_{source}_w{weight}"
                steps.append(Step(f"train_{name}", self.train(name, *mix), (f"translate_bt_{source}",)))
        evaluated = [*self.teachers, "ensemble"]
        for name in self.teachers:
            steps.append(Step(f"evaluate_{name}", self.evaluate(name, self.ckpt(name)), (f"train_{name}",)))
        steps += [
            Step("evaluate_ensemble", self.evaluate("ensemble", self.ensemble_ckpt()), ("train_base", "train_base_seed2")),
            Step("choose_teacher", lambda _: self.choose_teacher(), tuple(f"evaluate_{n}" for n in evaluated), light=True),
            Step("translate_distilled", self.distil, ("choose_teacher",)),
        ]  # fmt: skip
        students = [(f"student_{model}_{data}", model, data) for data in ("distilled", "original")
                    for model in ("tiny", "deep_shallow")]  # fmt: skip
        for name, model, data in students:
            corpus = [f"data.path={out / 'distilled'}"] if data == "distilled" else []
            after = "translate_distilled" if data == "distilled" else "inputs"
            steps.append(Step(f"train_{name}", self.train(name, f"model={model}", *corpus), (after,)))
        for name, _, _ in students:
            steps.append(Step(f"evaluate_{name}", self.evaluate(name, self.ckpt(name)), (f"train_{name}",)))
        steps.append(Step("choose_single", lambda _: self.choose_single(), tuple(f"evaluate_{n}" for n in self.teachers),
                          light=True))  # fmt: skip
        for name in ("single", "student_tiny_distilled", "student_deep_shallow_distilled"):
            after = "choose_single" if name == "single" else f"train_{name}"
            for shortlist in (False, True):
                steps.append(Step(f"export_{name}{'_shortlist' * shortlist}", self.export(name, shortlist), (after,)))
        return steps

    def inputs(self) -> None:
        """The captions (the first --caption-lines of each language), the distillation's German, the models' names
        for the table and the teacher's choice, and the precision every model trains in."""
        a, folder = self.args, self.out / "input"
        folder.mkdir(parents=True, exist_ok=True)
        for lang in ("en", "de"):
            files = [a.captions / f"train.{k}.{lang}.gz" for k in range(1, 6)]
            write_once(folder / f"captions.{lang}.gz", lines(files, a.caption_lines))
        write_once(folder / "distill.de.gz", lines([a.main / "train.de.gz", folder / "captions.de.gz"], 0))
        for what, names in (("ensemble_members", self.members), ("teachers", self.teachers)):
            if read(self.out / what) != " ".join(names):  # rewritten only when they change
                (self.out / what).write_text(" ".join(names) + "\n")
        if not (self.out / "precision").exists():
            (self.out / "precision").write_text(pinned_precision(a.overrides, self.device) + "\n")

    def train(self, name: str, *overrides: str) -> Callable[[list[int]], None]:
        """The run folder OUT/NAME, resumed where it stopped, skipped once done; OUT/NAME/wall_clock_s gets a line
        per start: its seconds, then the machine (a start that was killed: its seconds up to its last save)."""
        a, run = self.args, self.out / name

        def work(cores: list[int]) -> None:
            if (run / "done").exists():
                return
            last, started = run / "checkpoints" / "last.ckpt", run / "wall_clock_s.start"
            run.mkdir(parents=True, exist_ok=True)
            per_slot = []
            if self.concurrent:  # loader workers beside the training process, within its cores; logs without a bar
                per_slot = [f"data.num_workers={min(2, len(cores) - 1)}", "trainer.enable_progress_bar=false"]
            config = [f"experiment={a.experiment}", f"data.path={a.main}", f"data.test_split={a.test_split}",
                      f"trainer.max_steps={a.steps}", "trainer.max_time=null",
                      f"callbacks.last_checkpoint.every_n_train_steps={a.save_every}",
                      f"trainer.precision={read(self.out / 'precision')}", *per_slot, *a.overrides, *overrides]  # fmt: skip
            if self.concurrent:  # its data cache written before any other's: no two processes train one tokenizer
                with self.prepare_lock:
                    self.commands(f"train_{name}", cores, "-m", "transformer.prepare", *config,
                                f"hydra.run.dir={self.out / 'logs' / f'prepare_{name}'}")  # fmt: skip
            if started.exists() and last.exists():  # counted as the next start's line replaces it: once
                began, _, on = started.read_text().strip().partition(" ")
                if (kept := int(last.stat().st_mtime) - int(began)) > 0:
                    append(run / "wall_clock_s", f"{kept} {on}")
            started.write_text(f"{int(time.time())} {self.on}\n")
            start = time.monotonic()
            resume = ["ckpt_path=last"] if last.exists() else []
            self.commands(f"train_{name}", cores, "-m", "transformer.train", *config, f"hydra.run.dir={run}", *resume)
            append(run / "wall_clock_s", f"{round(time.monotonic() - start)} {self.on}")
            started.unlink()
            (run / "done").touch()

        return work

    def decoding(self) -> list[str]:
        """Where decoding runs: on the GPU, in batches sized for it."""
        return [
            f"device={self.device}",
            *([f"max_tokens={self.args.decode_max_tokens}"] if self.device != "cpu" else []),
        ]

    def evaluate(self, name: str, ckpt: str) -> Callable[[list[int]], None]:
        """OUT/eval/NAME/SPLIT/ for each split: EMA weights, beam 5."""

        def work(cores: list[int]) -> None:
            for split in self.args.splits.split():
                folder = self.out / "eval" / name / split
                if (folder / "done").exists():
                    continue
                self.commands(f"evaluate_{name}", cores, "-m", "transformer.evaluate", f"ckpt_path={ckpt}", "ema=true",
                            f"data.path={self.args.main}", f"split={split}", "beam_size=5", *self.decoding(),
                            f"hydra.run.dir={folder}")  # fmt: skip
                (folder / "done").touch()

        return work

    def translate(self, step: str, cores: list[int], ckpt: str, source: Path, output: Path, tgt: str, *search: str):
        """A corpus folder; translate skips one that is done (with the same settings) and resumes a stopped one.
        OUT/CORPUS.wall_clock_s gets a line per start that translated: its seconds, then the machine."""
        done = (output / f"train.{tgt}.gz").exists()
        start = time.monotonic()
        try:
            self.commands(step, cores, "-m", "transformer.translate", f"ckpt_path={ckpt}", "ema=true",
                          f"input={source}", f"output={output}", *search, *self.decoding())  # fmt: skip
        finally:  # a stopped start too: the chunks it wrote are kept
            if not done:
                append(output.with_name(output.name + ".wall_clock_s"), f"{round(time.monotonic() - start)} {self.on}")

    def back_translate(self, source: str) -> Callable[[list[int]], None]:
        search = ["beam_size=5"] if source == "beam" else ["beam_size=1", "sampling_topk=-1", "seed=1"]
        return lambda cores: self.translate(f"translate_bt_{source}", cores, self.ckpt("reverse"),
                                            self.out / "input" / "captions.en.gz", self.out / f"bt_{source}", "de", *search)  # fmt: skip

    def choose_teacher(self) -> None:
        """The best teacher on val, chosen once: the distilled corpus is its translation, whatever later runs score."""
        if not (self.out / "teacher").exists():
            (self.out / "teacher").write_text(best_teacher(self.out, single=False) + "\n")
        print(f"teacher: {read(self.out / 'teacher')}", flush=True)

    def distil(self, cores: list[int]) -> None:
        """The teacher's translation of Multi30k's German and the German captions; MAIN's dev and test sets."""
        distilled = self.out / "distilled"
        self.translate("translate_distilled", cores, self.teacher_ckpt(), self.out / "input" / "distill.de.gz",
                       distilled, "en", "beam_size=5")  # fmt: skip
        for split in sorted({"val", *self.args.splits.split(), self.args.test_split}):
            for lang in ("de", "en"):
                source = self.args.main / f"{split}.{lang}.gz"
                if not source.is_file():
                    raise StepFailed(f"{source} is missing; --main needs it")
                link = distilled / source.name
                if not link.is_symlink() or link.resolve() != source.resolve():
                    link.unlink(missing_ok=True)
                    link.symlink_to(source.resolve())

    def choose_single(self) -> None:
        """The best single teacher on val: the one exported."""
        self.single = best_teacher(self.out, single=True)

    def export(self, name: str, shortlist: bool) -> Callable[[list[int]], None]:
        """OUT/export/NAME(_shortlist): int8 behind the parity gate on MAIN's test split; skipped once written."""

        def work(cores: list[int]) -> None:
            model = self.single if name == "single" else name
            folder = self.out / "export" / (model + "_shortlist" * shortlist)
            if (folder / "model.bin").exists():
                return
            test = self.args.main / self.args.test_split
            self.commands(f"export_{name}", cores, "-m", "transformer.export", f"ckpt_path={self.ckpt(model)}",
                        "ema=true", "quantization=int8", f"shortlist={str(shortlist).lower()}", f"output={folder}",
                        f"parity_input={test}.de.gz", f"parity_references={test}.en.gz", *self.args.export_args.split())  # fmt: skip

        return work

    def table(self, speed: bool) -> None:
        """OUT/table.md, also printed: with the int8 exports timed (nothing else runs by then) if `speed`."""
        timed = ["--speed", str(self.args.main / f"{self.args.test_split}.de.gz"),
                 "--speed-sentences", str(self.args.speed_sentences)] if speed else []  # fmt: skip
        table = subprocess.run([sys.executable, str(TABLE), str(self.out), *timed], cwd=ROOT, check=True,
                               stdout=subprocess.PIPE, text=True).stdout  # fmt: skip
        (self.out / "table.md").write_text(table)
        print(table, end="", flush=True)


def best_teacher(out: Path, single: bool) -> str:
    command = [sys.executable, str(TABLE), str(out), "--best-teacher", *(["--single"] if single else [])]
    return subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True).stdout.strip()


def pinned_precision(overrides: list[str], device: str) -> str:
    """trainer.precision for every model: an override's, else bf16 on a GPU, else what `auto` chooses for this CPU."""
    given = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("trainer.precision=")), "auto")
    if given == "auto" and device != "cpu":
        return "bf16-mixed"
    from transformer.machine.precision import resolve_precision  # torch: imported by the step that needs it

    return str(resolve_precision(given, "cpu")[0])


def read(path: Path) -> str:
    return path.read_text().strip() if path.exists() else ""


def append(path: Path, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def lines(files: list[Path], limit: int):
    """The lines of gzipped `files` in order, the first `limit` of them if limit > 0."""
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise StepFailed(f"{', '.join(missing)}: not found; give the folder that holds it (--main, --captions)")
    count = 0
    for file in files:
        with gzip.open(file, "rt", encoding="utf-8") as f:
            for line in f:
                if limit and count == limit:
                    return
                count += 1
                yield line


def write_once(path: Path, content) -> None:
    """A gzipped file of `content`'s lines, written whole under a temporary name, skipped once it exists."""
    if path.exists():
        return
    partial = path.with_name(path.name + ".partial")
    with gzip.open(partial, "wt", encoding="utf-8") as f:
        f.writelines(content)
    partial.replace(path)


def pack(out: Path, archive: Path) -> None:
    """What a lent machine brings back: OUT's table, logs, scores, cards and curves (files up to PACKED_BYTES; a
    longer log's last PACKED_BYTES), no weights, tokenizers or corpora."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(p for p in out.rglob("*") if p.is_file() and not p.is_symlink()):
            if path.name.endswith(UNPACKED) or path.resolve() == archive.resolve():
                continue
            name = str(path.relative_to(out))
            if path.stat().st_size <= PACKED_BYTES:
                tar.add(path, name)
            elif path.suffix == ".log":
                with open(path, "rb") as f:
                    f.seek(-PACKED_BYTES, os.SEEK_END)
                    tail = f.read()
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(tail), int(path.stat().st_mtime)
                tar.addfile(info, io.BytesIO(tail))
    print(f"packed {archive} ({archive.stat().st_size / 2**20:.1f} MiB)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "teacher_student")
    parser.add_argument(
        "--steps", type=int, default=4738, help="per model: the recipe's steps in an hour on its machines"
    )
    parser.add_argument(
        "--main", type=Path, default=ROOT / "data" / "multi30k", help="the parallel corpus: train, val, test"
    )
    parser.add_argument(
        "--captions", type=Path, default=ROOT / "data" / "multi30k_captions", help="train.{1..5}.{de,en}.gz"
    )
    parser.add_argument(
        "--caption-lines", type=int, default=0, help="0: every caption; N: the first N of each language"
    )
    parser.add_argument(
        "--bt-weights", default="1.0 0.5", help="the back-translated corpus's sampling weights (Multi30k's: 1.0)"
    )
    parser.add_argument(
        "--splits", default="val test_2016_flickr", help="scored splits of --main: val chooses, the test split reports"
    )
    parser.add_argument("--test-split", default="test_2016_flickr")
    parser.add_argument("--experiment", default="multi30k_de_en_cpu")
    parser.add_argument("--export-args", default="", help="extra export overrides, space-separated")
    parser.add_argument("--save-every", type=int, default=50, help="training steps between last.ckpt writes")
    parser.add_argument(
        "--schedule",
        choices=("auto", "serial", "concurrent"),
        default="auto",
        help="auto: concurrent where a GPU is found, else serial",
    )
    parser.add_argument(
        "--slots", type=int, default=5, help="concurrent: steps at once (the 5 trainings that need nothing)"
    )
    parser.add_argument(
        "--decode-max-tokens", type=int, default=65536, help="on a GPU: tokens per decoding batch x beam"
    )
    parser.add_argument("--minutes", type=float, help="start nothing after this many minutes, and stop what runs")
    parser.add_argument(
        "--speed-sentences", type=int, default=0, help="time the int8 exports on the first N test sentences (0: all)"
    )
    parser.add_argument("--pack", type=Path, help="then a .tar.gz of OUT's table, logs, scores and curves")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every training run")
    a = parser.parse_intermixed_args()
    a.out, a.main, a.captions = a.out.resolve(), a.main.resolve(), a.captions.resolve()
    began = time.monotonic()
    gpu = cuda_device()
    concurrent = a.schedule == "concurrent" or (a.schedule == "auto" and gpu is not None)
    cores = sorted(os.sched_getaffinity(0))
    if not concurrent:
        slots = [cores]
    else:  # auto: as many as the cores allow
        slots = core_slots(min(a.slots, len(cores)) if a.schedule == "auto" else a.slots)
    a.out.mkdir(parents=True, exist_ok=True)
    pipeline = Pipeline(a, Commands(a.out / "logs" if concurrent else None), "cuda" if gpu else "cpu",
                        machine(gpu, len(slots)))  # fmt: skip
    schedule_log = a.out / "logs" / "schedule.log"
    schedule_log.parent.mkdir(parents=True, exist_ok=True)

    def say(line: str) -> None:
        print(line, flush=True)
        append(schedule_log, line)

    say(f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {'concurrent' if concurrent else 'serial'}, {len(slots)} slots "
        f"of {len(slots[0])} cores, on {pipeline.on}")  # fmt: skip
    deadline = began + a.minutes * 60 if a.minutes else None
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))  # a timeout's signal: stop, then pack
    try:  # whatever happens, what there is comes back packed
        left = run_steps(pipeline.steps(), slots, deadline, pipeline.commands.stop, say)
        if left:
            say(f"not finished: {', '.join(left)}; run the same command again to resume")
        pipeline.table(speed=not left)
    finally:
        if a.pack:
            pack(a.out, a.pack)
    sys.exit(1 if left else 0)


if __name__ == "__main__":
    main()
