"""The prepared GPU check: one script, within 8 minutes on one H200, every figure from real training runs
(`python -m transformer.train`: Lightning, the GPU recipe's config, logging on). It writes each result to
OUT/gpu_check.md as it comes, most important first:

1. the environment;
2. the kernels a training step of the recipe launches (torch.profiler), beside those predicted for it on a CPU
   (scripts/predict_kernels.py);
3. host syncs over 10 steps (torch.cuda.set_sync_debug_mode("warn")): one per step is expected, the step's readout;
4. MFU of the base and big models: analytic FLOPs of the real (unpadded) tokens over the device's own bf16 peak;
5. the GPU recipe for --recipe-steps steps, with its closing line (training steps' share of the wall clock), then one
   beam-5 evaluate of its last checkpoint;
6. runtime.attention_backend=flash (padding-free) through training, validation BLEU and translate;
7. where the host's time goes in the base model's training steps: py-spy's samples (py-spy is a dev dependency).
DDP is not checked: one GPU cannot show it.

    python scripts/gpu_check.py --stage          # once, where the data is: copies Multi30k (2.5 MB) beside this script
    python scripts/gpu_check.py --out OUT        # on the GPU machine (the device tool: carry scripts/gpu_check_data)
    python scripts/gpu_check.py --smoke --out OUT  # on a CPU: the tiny model, a few steps, to check the script itself
    python scripts/gpu_check.py --out OUT --stages mfu,host_profile runtime.attention_backend=efficient  # some stages, overrides
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
STAGED = Path(__file__).resolve().parent / "gpu_check_data" / "multi30k"
RECIPE = "experiment=multi30k_de_en_gpu"
PROBES = "transformer.benchmarks.gpu"
NO_CHECKPOINTS = ["~callbacks.last_checkpoint", "~callbacks.best_checkpoint", "~callbacks.epoch_checkpoints"]


def find_multi30k(given: Path | None) -> Path:
    """The Multi30k files: where given, in data/multi30k if its link resolves here, or staged beside this script."""
    for folder in [given] if given else [ROOT / "data" / "multi30k", STAGED, ROOT.parent / "shared/data/multi30k"]:
        if folder is not None and (folder / "train.de.gz").is_file():
            return folder.resolve()
    raise SystemExit(f"no Multi30k found (data/multi30k, {STAGED}); run `python scripts/gpu_check.py --stage` where "
                     "it is, and bring scripts/gpu_check_data along")  # fmt: skip


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
        self.args, self.report, self.out = args, report, args.out
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

    def probe(self, name: str) -> dict:
        return json.loads((self.out / name / "probes" / f"{name.split('_')[0]}.json").read_text())


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


def kernels_and_syncs(check: Check, report: Report) -> None:
    steps = 9 if check.args.smoke else 17
    check.run("kernels", "transformer.train", RECIPE, f"trainer.max_steps={steps}", "trainer.limit_val_batches=0",
              *NO_CHECKPOINTS, f"+callbacks.kernels._target_={PROBES}.KernelNames",
              f"+callbacks.kernels.out={check.out / 'kernels' / 'probes'}",
              f"+callbacks.syncs._target_={PROBES}.SyncWarnings", "+callbacks.syncs.first=6",  # after the profiler
              f"+callbacks.syncs.steps={steps - 7}", f"+callbacks.syncs.out={check.out / 'kernels' / 'probes'}")  # fmt: skip
    found = json.loads((check.out / "kernels" / "probes" / "kernels.json").read_text())
    lines = [f"- {family}: {', '.join(f'{k[0][:70]} x{k[1]}' for k in kernels[:3]) or 'none'}"
             for family, kernels in found["attention"].items()]  # fmt: skip
    top = "\n".join(f"| {name[:90]} | {count} | {ms:.2f} |" for name, count, ms in found["kernels"][:12])
    from transformer.kernel_calls import predicted_kernels

    predicted = predicted_kernels([RECIPE, *(["model.size=tiny"] if check.args.smoke else []), *check.args.overrides],
                                  ("training step",))  # fmt: skip
    report(f"## Kernels of {found['steps']} training steps of the recipe (torch.profiler)\nAttention kernels by family:\n"
           + "\n".join(lines) + f"\n\n| kernel | calls | GPU ms |\n|---|---:|---:|\n{top}\n\nPredicted (CPU record):\n"
           + predicted)  # fmt: skip
    syncs = json.loads((check.out / "kernels" / "probes" / "syncs.json").read_text())
    where = ", ".join(f"{place} x{n}" for place, n in syncs["where"])
    report(f"## Host syncs\n- {syncs['syncs']} in {syncs['steps']} optimizer steps (expected: 1 per step, "
           f"training/module.py's readout): {where or 'none'}")  # fmt: skip


def mfu(check: Check, report: Report) -> None:
    first, steps = (2, 6) if check.args.smoke else (20, check.args.mfu_steps)
    rows = ["| model | target tok/s | TFLOP/s | peak | MFU |", "|---|---:|---:|---:|---:|"]
    for size in ("base", "big"):
        name = f"throughput_{size}"
        check.run(name, "transformer.train", RECIPE, f"model={size}", f"trainer.max_steps={first + steps}",
                  "trainer.limit_val_batches=0", *NO_CHECKPOINTS, f"+callbacks.throughput._target_={PROBES}.Throughput",
                  f"+callbacks.throughput.first={first}", f"+callbacks.throughput.out={check.out / name / 'probes'}")  # fmt: skip
        t = check.probe(name)
        peak = f"{t['peak_tflops']:.0f}" if t["peak_tflops"] else "unknown"
        share = f"{t['mfu']:.1%}" if t["mfu"] else "n/a"
        rows.append(f"| {size} | {t['target_tokens_per_s']:,.0f} | {t['tflops']:.1f} | {peak} | {share} |")
    report(f"## MFU through the Trainer (the recipe's batches and precision, steps {first}-{first + steps})\n"
           + "\n".join(rows))  # fmt: skip


def recipe(check: Check, report: Report) -> None:
    steps = 20 if check.args.smoke else check.args.recipe_steps
    start = time.monotonic()
    done = check.run("recipe", "transformer.train", RECIPE, f"trainer.max_steps={steps}",
                     *(["trainer.val_check_interval=10", "validation.bleu_max_sentences=50"] if check.args.smoke else []))  # fmt: skip
    clock = next((line for line in done.stderr.splitlines() if line.startswith("wall clock:")), "no wall clock line")
    report(f"## The GPU recipe for {steps} steps ({time.monotonic() - start:.0f} s with start-up)\n- {clock}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    split, beam = ("val", 1) if check.args.smoke else ("test_2016_flickr", 5)
    evaluated = check.run("recipe_evaluate", "transformer.evaluate", f"ckpt_path={check.out / 'recipe/checkpoints/last.ckpt'}",
                          f"device={device}", f"split={split}", f"beam_size={beam}")  # fmt: skip
    bleu = next((line for line in evaluated.stdout.splitlines() if line.startswith("BLEU")), evaluated.stdout[-300:])
    report(f"- last checkpoint, beam {beam}, {split}: {bleu}")


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
    device = "cuda" if torch.cuda.is_available() else "cpu"
    translated = check.run("flash_translate", "transformer.translate", f"ckpt_path={check.out / 'flash/checkpoints/last.ckpt'}",
                           *kernel, f"device={device}", "precision=bf16" if device == "cuda" else "precision=32",
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
    from transformer.allocator import preloaded_environment
    from transformer.benchmarks.gpu import host_shares

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


STAGES = {stage.__name__: stage for stage in (kernels_and_syncs, mfu, recipe, flash, host_profile)}


def stage_names(text: str) -> list[str]:
    names = text.split(",")
    unknown = [name for name in names if name not in STAGES]
    if unknown:
        raise argparse.ArgumentTypeError(f"no stage {', '.join(unknown)}; the stages: {','.join(STAGES)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "gpu_check")
    parser.add_argument("--data", type=Path, help="the Multi30k folder (default: found, see find_multi30k)")
    parser.add_argument("--cache", type=Path, help="data.cache_dir of the runs (default: OUT/cache)")
    parser.add_argument("--stage", action="store_true", help="copy Multi30k beside this script, then stop")
    parser.add_argument("--smoke", action="store_true", help="the tiny model and a few steps: checks the script")
    parser.add_argument("--minutes", type=float, default=8.0, help="stages that would start later are skipped")
    parser.add_argument("--mfu-steps", type=int, default=40)
    parser.add_argument("--recipe-steps", type=int, default=1000)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every training run")
    parser.add_argument(
        "--stages", type=stage_names, default=list(STAGES), help=f"of {','.join(STAGES)} (default: all)"
    )
    args = parser.parse_intermixed_args()  # overrides among the options
    data = find_multi30k(args.data)
    if args.stage:
        STAGED.mkdir(parents=True, exist_ok=True)
        for file in data.glob("*.gz"):
            shutil.copyfile(file, STAGED / file.name)  # the files, not a link: the GPU machine has no target
        print(f"copied {len(list(STAGED.glob('*.gz')))} files into {STAGED}")
        return
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
