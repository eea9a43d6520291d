"""The prepared GPU check: one script, within 10 minutes on one H200, every figure from real training runs
(`python -m transformer.train`: Lightning, the GPU recipe's config, logging on), the eager training step beside the
compiled one (COMPILED: torch.compile with CUDA graphs over bounded batch shapes). It writes each result to
OUT/gpu_check.md as it comes, most important first:

1. the environment;
2. the base model, eager and compiled: target tokens/s and MFU (analytic FLOPs of the real tokens over the device's
   bf16 peak), GPU kernels and host launches per step (torch.profiler), host syncs over 50 steps (CUDA's sync debug
   mode: one per logging interval is expected), graphs and batch shapes; and the kernels a CPU predicts;
3. the GPU recipe to its end (--recipe-steps, compiled unless --recipe-eager), with its closing line (trainer.fit's
   wall clock, validation's share), then one beam-5 evaluate of its last checkpoint on test_2016_flickr;
4. beam-5 decoding of that checkpoint on the GPU: our search beside CTranslate2 (its export, bf16), sentences/s;
5. the big model, as 2;
6. runtime.attention_backend=flash (padding-free) through training, validation BLEU and translate;
7. where the host's time goes in the base model's eager training steps: py-spy's samples (a dev dependency).
A stage that would start past --minutes is skipped. DDP is not checked: one GPU cannot show it.

    python tools/gpu_check.py --stage          # once, here: Multi30k, its captions and the wheels the lent
                                                 # machine lacks (for this check and the teacher-student pipeline)
    python tools/gpu_check.py --out OUT        # there (the device tool: carry tools/gpu_check_data; --stage
                                                 # prints the whole command)
    python tools/gpu_check.py --smoke --out OUT  # on a CPU: the tiny model, a few steps, to check the script itself
    python tools/gpu_check.py --out OUT --stages base,host_profile runtime.attention_backend=efficient  # some stages, overrides
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
STAGING = TOOLS / "gpu_check_data"
STAGED, CAPTIONS, WHEELS = STAGING / "multi30k", STAGING / "multi30k_captions", STAGING / "wheels"
RECIPE = "experiment=multi30k_de_en_gpu"
# the compiled training step: inductor's kernels replayed as CUDA graphs, one recording per batch shape
COMPILED = ["compile=true", "compile_mode=reduce-overhead", "data.length_rungs=16"]
PROBES = "common.gpu"
NO_CHECKPOINTS = ["~callbacks.last_checkpoint", "~callbacks.best_checkpoint", "~callbacks.epoch_checkpoints"]
# What the lender's image (Python 3.12, torch 2.11, Lightning, sacrebleu, sentencepiece, pyarrow) lacks, at the
# versions installed here (docs/gpu_runs.md)
CARRIED = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "datasets", "dill", "multiprocess", "py-spy",
           "ctranslate2")  # fmt: skip


def find_multi30k(given: Path | None) -> Path:
    """The Multi30k files: where given, in data/multi30k if its link resolves here, or staged beside this script."""
    for folder in [given] if given else [ROOT / "data" / "multi30k", STAGED, ROOT.parent / "shared/data/multi30k"]:
        if folder is not None and (folder / "train.de.gz").is_file():
            return folder.resolve()
    raise SystemExit(f"no Multi30k found (data/multi30k, {STAGED}); run `python tools/gpu_check.py --stage` where "
                     "it is, and bring tools/gpu_check_data along")  # fmt: skip


class Report:
    def __init__(self, out: Path):
        self.path = out / "gpu_check.md"
        self.path.write_text("")

    def __call__(self, text: str) -> None:
        print(text, flush=True)
        with self.path.open("a") as f:
            f.write(text + "\n")


class Check:
    """Runs the stages as subprocesses of this project's commands, each with its own folder under OUT."""

    def __init__(self, args, data: Path, report: Report):
        self.args, self.report, self.out, self.data = args, report, args.out, data
        cache = args.cache or args.out / "cache"
        self.common = [f"data.path={data}", f"data.cache_dir={cache}", "trainer.enable_progress_bar=false",
                       *args.overrides]  # fmt: skip
        if args.smoke:
            self.common.append("model.size=tiny")
        self.deadline = time.monotonic() + args.minutes * 60

    def run(self, name: str, module: str, *overrides: str, stdin: str | None = None, prefix: tuple[str, ...] = (),
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:  # fmt: skip
        left = self.deadline - time.monotonic()
        if left < 20:
            raise TimeoutError(f"{name}: skipped, the {self.args.minutes} minutes are spent")
        extra = self.common if module == "transformer.train" else []
        folder = self.out / name
        # the stage's overrides last: they win over the user's (`model=big` leaves the base model's row base)
        command = [*prefix, sys.executable, "-m", module, *extra, *overrides, f"hydra.run.dir={folder}"]
        with subprocess.Popen(command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True, env=env) as process:  # fmt: skip
            try:
                stdout, stderr = process.communicate(stdin, timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # py-spy's child too, which would hold the GPU
                raise
        done = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
        (self.out / f"{name}.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
            raise RuntimeError(f"{name}: exit {done.returncode}: {tail} (log: {self.out / name}.log)")
        return done

    def probe(self, name: str, probe: str | None = None) -> dict:
        """What a probe callback of stage run `name` wrote (by default the one the name begins with)."""
        return json.loads((self.out / name / "probes" / f"{probe or name.split('_')[0]}.json").read_text())


def environment(report: Report) -> None:
    lines = [f"- torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"]
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        lines.append(f"- {torch.cuda.get_device_name(0)}: sm{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                     f"{p.total_memory / 2**30:.0f} GiB; {torch.cuda.device_count()} visible")  # fmt: skip
    else:
        lines.append("- no GPU: a smoke run of the script on the CPU, its figures say nothing of a GPU")
    lines.append("- DDP is not checked here: one GPU cannot show it (tests/test_host_syncs.py runs 2 CPU ranks)")
    report("## Environment\n" + "\n".join(lines))


def training_steps(check: Check, report: Report, size: str) -> None:
    """One run per mode (eager, compiled) of the recipe's batches with the `size` model and every probe: kernels over
    2 steps, then syncs over 50, then throughput; compiled, all of it after the first epoch, whose new batch shapes
    are being recorded as CUDA graphs."""
    smoke = check.args.smoke
    rows = ["| mode | target tok/s | TFLOP/s | MFU | MFU of the GEMM rate (2048³, TFLOP/s) | GPU kernels / step | "
            "host launches / step | host syncs | graphs (breaks) | batch shapes | CUDA graph skips |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    speeds = {}
    for mode, overrides in (("eager", []), ("compiled", COMPILED)):
        first = 2 if smoke else (5 if mode == "eager" else 70)
        syncs, steps = (4, 4) if smoke else (50, check.args.mfu_steps)
        name = f"{size}_{mode}"
        probes = check.out / name / "probes"
        check.run(name, "transformer.train", RECIPE, f"model={size}", *overrides, "trainer.limit_val_batches=0",
                  f"trainer.max_steps={first + 2 + syncs + steps}", *NO_CHECKPOINTS,
                  f"+callbacks.kernels._target_={PROBES}.KernelNames", f"+callbacks.kernels.out={probes}",
                  f"+callbacks.kernels.first={first}",
                  f"+callbacks.syncs._target_={PROBES}.SyncWarnings", f"+callbacks.syncs.first={first + 2}",
                  f"+callbacks.syncs.steps={syncs}", f"+callbacks.syncs.out={probes}",
                  f"+callbacks.throughput._target_={PROBES}.Throughput", f"+callbacks.throughput.first={first + 2 + syncs}",
                  f"+callbacks.throughput.out={probes}", f"+callbacks.graphs._target_={PROBES}.Graphs",
                  f"+callbacks.graphs.out={probes}")  # fmt: skip
        t, k = check.probe(name, "throughput"), check.probe(name, "kernels")
        sync, graphs = check.probe(name, "syncs"), check.probe(name, "graphs")
        speeds[mode] = t["target_tokens_per_s"]
        peak = f"{t['mfu']:.1%} of {t['peak_tflops']:.0f}" if t["mfu"] else "n/a"
        where = ", ".join(f"{place} x{n}" for place, n in sync["where"]) or "none"
        rows.append(f"| {mode} | {t['target_tokens_per_s']:,.0f} | {t['tflops']:.1f} | {peak} | "
                    f"{t['mfu_of_gemm']:.1%} of {t['gemm_tflops']:.1f} | "
                    f"{k['device_kernels'] / k['steps']:.0f} | {k['launches'] / k['steps']:.0f} | {sync['syncs']} in "
                    f"{sync['steps']} steps ({where}) | {graphs['graphs']} ({graphs['breaks']}) | {graphs['shapes']} | "
                    f"{graphs['cudagraph_skips']} |")  # fmt: skip
    ratio = speeds["compiled"] / max(speeds["eager"], 1e-9)
    text = (f"## The {size} model's training step, eager and compiled ({' '.join(COMPILED)}; recipe batches, bf16)\n"
            + "\n".join(rows) + f"\n\nCompiled / eager target tokens/s: {ratio:.2f}x")  # fmt: skip
    if size == "base":
        from common.kernel_calls import predicted_kernels

        overrides = [RECIPE, *(["model.size=tiny"] if smoke else []), *check.args.overrides]
        text += "\n\nAttention kernels predicted on a CPU (kernels.py's record):\n" + predicted_kernels(
            overrides, ("training step",)
        )
        families = check.probe("base_eager", "kernels")["attention"]
        text += "\n\nAttention kernels profiled (eager):\n" + "\n".join(
            f"- {family}: {', '.join(f'{n[:70]} x{c}' for n, c, _ in found[:3]) or 'none'}"
            for family, found in families.items()
        )
    report(text)


def base(check: Check, report: Report) -> None:
    training_steps(check, report, "base")


def big(check: Check, report: Report) -> None:
    training_steps(check, report, "big")


def recipe(check: Check, report: Report) -> None:
    steps = 20 if check.args.smoke else check.args.recipe_steps
    mode = [] if check.args.recipe_eager else COMPILED
    start = time.monotonic()
    done = check.run("recipe", "transformer.train", RECIPE, *mode, f"trainer.max_steps={steps}",
                     *(["trainer.val_check_interval=10", "validation.bleu_max_sentences=50"] if check.args.smoke else []))  # fmt: skip
    clock = next((line for line in done.stderr.splitlines() if line.startswith("wall clock:")), "no wall clock line")
    report(f"## The GPU recipe for {steps} steps, {' '.join(mode) or 'eager'} ({time.monotonic() - start:.0f} s with "
           f"start-up)\n- {clock}")  # fmt: skip
    split, beam = ("val", 1) if check.args.smoke else ("test_2016_flickr", 5)
    evaluated = check.run("recipe_evaluate", "transformer.evaluate", f"ckpt_path={check.out / 'recipe/checkpoints/last.ckpt'}",
                          f"device={device()}", f"split={split}", f"beam_size={beam}")  # fmt: skip
    bleu = next((line for line in evaluated.stdout.splitlines() if line.startswith("BLEU")), evaluated.stdout[-300:])
    report(f"- last checkpoint, beam {beam}, {split}: {bleu}")


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def decode(check: Check, report: Report) -> None:
    """Beam 5 over test_2016_flickr with the recipe's last checkpoint on the GPU: our search in bf16 beside
    CTranslate2 running its export in bfloat16 (export's own float32 gate first, on this machine's CPU). Each engine
    translates 64 sentences to warm up, then all of them twice; the faster pass counts."""
    from transformer.data.sources import read_lines
    from transformer.translators import CheckpointTranslator, CTranslate2Translator, SearchConfig

    checkpoint = check.out / "recipe" / "checkpoints" / "last.ckpt"
    if not checkpoint.exists():
        raise RuntimeError(f"decode: no {checkpoint}; run the recipe stage first")
    sentences = 50 if check.args.smoke else 1000
    folder = check.out / "export"
    check.run("export", "transformer.export", f"ckpt_path={checkpoint}", f"output={folder}",
              f"parity_sentences={min(sentences, 200)}")  # fmt: skip
    ours = CheckpointTranslator.from_path(str(checkpoint), device=device())
    split = "val" if check.args.smoke else "test_2016_flickr"
    texts = read_lines(check.data / f"{split}.{ours.data['src']}.gz")[:sentences]
    search, precision = SearchConfig(beam_size=5), "bf16" if device() == "cuda" else "32"
    rows = ["| engine | sentences/s | relative |", "|---|---:|---:|"]
    speeds = {}
    compute_type = "bfloat16" if device() == "cuda" else "default"
    engines = {"ours": lambda: ours,
               "CTranslate2": lambda: CTranslate2Translator(folder, device=device(), compute_type=compute_type)}  # fmt: skip
    for name, make in engines.items():
        try:
            engine = make()
            engine.translate(texts[:64], search, precision)
            seconds = []
            for _ in range(2):
                started = time.perf_counter()
                engine.translate(texts, search, precision)
                if device() == "cuda":
                    torch.cuda.synchronize()
                seconds.append(time.perf_counter() - started)
            speeds[name] = len(texts) / min(seconds)
            relative = f"{speeds[name] / speeds['ours']:.2f}" if "ours" in speeds else ""
            rows.append(f"| {name} | {speeds[name]:,.1f} | {relative} |")
        except (RuntimeError, OSError, ValueError) as e:  # CTranslate2's CUDA build may miss its libraries there
            rows.append(f"| {name} | failed: {str(e).splitlines()[0][:200]} | |")
    report(f"## Beam-5 decoding on {device()}, {len(texts)} sentences of {split}, {precision}\n" + "\n".join(rows))


def flash(check: Check, report: Report) -> None:
    # on a CPU the flash kernel takes no nested tensors: the smoke run goes the padding-free way with auto
    backend = "auto" if check.args.smoke else "flash"
    kernel = [f"runtime.attention_backend={backend}", "runtime.padding_free_attention=true"]
    steps, sentences = (20, 50) if check.args.smoke else (60, 300)
    check.run("flash", "transformer.train", RECIPE, *kernel, f"trainer.max_steps={steps}",
              f"trainer.val_check_interval={steps}", f"validation.bleu_max_sentences={sentences}", *NO_CHECKPOINTS[1:])  # fmt: skip
    events = EventAccumulator(str(check.out / "flash" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    bleu = [f"{e.value:.2f}" for e in events.Scalars("val/bleu")] if "val/bleu" in events.Tags()["scalars"] else []
    translated = check.run("flash_translate", "transformer.translate", f"ckpt_path={check.out / 'flash/checkpoints/last.ckpt'}",
                           *kernel, f"device={device()}", "precision=bf16" if device() == "cuda" else "precision=32",
                           stdin="Ein Hund läuft über die Wiese.\nZwei Männer spielen Fußball.\n")  # fmt: skip
    report(f"## runtime.attention_backend={backend}, padding-free: trained {steps} steps, validated (greedy BLEU on "
           f"{sentences} sentences: {bleu[-1] if bleu else 'not shown'}), translated:\n"
           + "\n".join(f"- {line}" for line in translated.stdout.splitlines()))  # fmt: skip


def host_profile(check: Check, report: Report) -> None:
    """py-spy samples the base model's training, idle time included; of the main thread's samples inside the
    training loop, the share of each line it was on (self) and of this project's functions (inclusive): on a GPU
    the host should mostly wait, at the step's readout."""
    spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if spy is None:
        raise RuntimeError("py-spy is neither beside Python nor on the PATH (pip install py-spy)")
    from common.gpu import host_shares
    from transformer.machine.allocator import preloaded_environment

    steps, rate = (20 if check.args.smoke else 300), 200
    raw = check.out / "host_profile.txt"
    spied = (spy, "record", "--rate", str(rate), "--idle", "--nonblocking", "--format", "raw", "--output", str(raw),
             "--")  # fmt: skip
    # under jemalloc from the start: a restart would replace the image py-spy reads
    done = check.run("host_profile", "transformer.train", RECIPE, "model=base", f"trainer.max_steps={steps}",
                     "trainer.limit_val_batches=0", *NO_CHECKPOINTS, prefix=spied, env=preloaded_environment())  # fmt: skip
    total, own, ours = host_shares(raw.read_text())
    if not total:
        said = [line.strip() for line in (done.stdout + done.stderr).splitlines() if "Samples:" in line]
        raise RuntimeError(
            f"host_profile: no sample inside the training loop in {raw}: {said or 'py-spy gave no count'}"
        )
    rows = [f"{title}:\n" + "\n".join(f"- {n / total:.1%} {frame[:140]}" for frame, n in counter.most_common(12))
            for title, counter in (("By line (self)", own), ("This project's functions (inclusive)", ours))]  # fmt: skip
    report(f"## Host profile of {steps} base-model training steps (py-spy: {total:,} samples at {rate} Hz inside the "
           f"loop, about {total / rate:.1f} s)\n" + "\n\n".join(rows))  # fmt: skip


STAGES = {stage.__name__: stage for stage in (base, recipe, decode, big, flash, host_profile)}


def stage_names(text: str) -> list[str]:
    names = text.split(",")
    unknown = [name for name in names if name not in STAGES]
    if unknown:
        raise argparse.ArgumentTypeError(f"no stage {', '.join(unknown)}; the stages: {','.join(STAGES)}")
    return names


def stage_for_the_device(data: Path) -> None:
    """Multi30k, its captions (for scripts/reproduce_teacher_student.py) and wheels of CARRIED for the lender's
    Python 3.12 at the versions installed here, into STAGING (git ignores it); then the device commands that install
    them there and run this check, or the teacher-to-student pipeline."""
    captions = next((f for f in (data.parent / "multi30k_captions", ROOT / "data" / "multi30k_captions")
                     if (f / "train.1.en.gz").is_file()), None)  # fmt: skip
    if captions is None:
        raise SystemExit(f"no captions beside {data} or in data/multi30k_captions: link them as the README says")
    for source, staged in ((data, STAGED), (captions.resolve(), CAPTIONS)):
        staged.mkdir(parents=True, exist_ok=True)
        for file in source.glob("*.gz"):
            shutil.copyfile(file, staged / file.name)  # the files, not a link: the GPU machine has no target
    WHEELS.mkdir(parents=True, exist_ok=True)
    pinned = [f"{name}=={metadata.version(name)}" for name in CARRIED]
    platforms = [arg for tag in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_17", "manylinux2014", "manylinux1")
                 for arg in ("--platform", f"{tag}_x86_64")]  # fmt: skip
    pip = [sys.executable, "-m", "pip", "-q"]
    binary = [p for p in pinned if not p.startswith("antlr4")]  # antlr4's runtime comes as a source package only
    subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                    "--implementation", "cp", *platforms, "-d", str(WHEELS), *binary], check=True)  # fmt: skip
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(WHEELS), *set(pinned) - set(binary)], check=True)
    size = sum(f.stat().st_size for f in STAGING.rglob("*") if f.is_file()) / 2**20
    install = (f"python3 -m pip install -q --no-index --no-deps --target /tmp/site {WHEELS.relative_to(ROOT)}/*.whl && "
               "PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 python3")  # fmt: skip
    pipeline = (f"scripts/reproduce_teacher_student.py --main {STAGED.relative_to(ROOT)} --captions "
                f"{CAPTIONS.relative_to(ROOT)} --minutes 8 --speed-sentences 250 --pack $OUT/teacher_student.tar.gz")  # fmt: skip
    print(f"staged {len(list(STAGED.glob('*.gz')))} Multi30k files, {len(list(CAPTIONS.glob('*.gz')))} caption files "
          f"and {len(list(WHEELS.glob('*.whl')))} wheels ({size:.0f} MiB) in {STAGING}; there, with carry "
          f"[tools/gpu_check_data], this check:\n  {install} tools/gpu_check.py --out $OUT\n"
          f"or the teacher-to-student pipeline (docs/teacher_student.md):\n  {install} {pipeline}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "gpu_check")
    parser.add_argument("--data", type=Path, help="the Multi30k folder (default: found, see find_multi30k)")
    parser.add_argument("--cache", type=Path, help="data.cache_dir of the runs (default: OUT/cache)")
    parser.add_argument(
        "--stage", action="store_true", help="copy Multi30k, its captions and the wheels beside this script, then stop"
    )
    parser.add_argument("--smoke", action="store_true", help="the tiny model and a few steps: checks the script")
    parser.add_argument("--minutes", type=float, default=9.0, help="stages that would start later are skipped")
    parser.add_argument("--mfu-steps", type=int, default=40)
    parser.add_argument("--recipe-steps", type=int, default=6000, help="default: the recipe's, to its end")
    parser.add_argument("--recipe-eager", action="store_true", help="the recipe without COMPILED")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every training run")
    parser.add_argument(
        "--stages", type=stage_names, default=list(STAGES), help=f"of {','.join(STAGES)} (default: all)"
    )
    args = parser.parse_intermixed_args()  # overrides among the options
    data = find_multi30k(args.data)
    if args.stage:
        stage_for_the_device(data)
        return
    # the training runs load the probes (common.gpu, beside this script) as callbacks
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TOOLS), os.environ.get("PYTHONPATH")]))
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out)
    environment(report)
    check = Check(args, data, report)
    failed = 0
    for stage in [STAGES[name] for name in args.stages]:
        try:
            stage(check, report)
        except (RuntimeError, TimeoutError, subprocess.TimeoutExpired, OSError, KeyError, StopIteration) as e:
            failed += 1
            report(f"## {stage.__name__}: FAILED\n- {e}")
    report(f"\n{failed} of {len(args.stages)} stages failed" if failed else "\nall stages ran")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
