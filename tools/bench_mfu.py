"""Model FLOPs utilisation of the training step on this CPU: the real step (`python -m transformer.train` with the
60-minute recipe's settings, its LightningModule, optimizer and EMA) for each size and mode, against the GEMM rate
this machine reaches in the same run, at 2048^3 and at the model's own matmul shapes; and where the step's time goes.

    python tools/bench_mfu.py                                    # small and base, eager and compiled
    python tools/bench_mfu.py --sizes small --modes eager --write   # and record the tables in docs/benchmarks.md

Each run is a subprocess with the StepCost callback (tools/step_cost.py): target tokens/s over --steps
optimizer steps after a warm-up (a step that compiles is left out and counted), then 3 steps under torch.profiler
(time by kind); then the timed steps' batches again under FlopCounterMode (model FLOPs per target token, padding
included; a compiled model counts its eager ops). Both modes time the same batches (the same seed and warm-up). The
GEMM rates are measured by this process between the runs, in the precision the run trained in
(trainer.precision=auto's choice). Run it alone.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from common.gemm import step_gemm_rate
from common.machine import machine, precision_dtype, square_gemm_rate
from common.report import record
from step_cost import KINDS, PROFILED
from transformer.machine.allocator import restart_with_jemalloc

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RECIPE = ["experiment=multi30k_de_en_cpu", "trainer.max_time=null", "trainer.limit_val_batches=0",
          "trainer.enable_progress_bar=false", "~callbacks.last_checkpoint", "~callbacks.best_checkpoint",
          "~callbacks.epoch_checkpoints"]  # fmt: skip
MODES = {"eager": [], "compiled": ["compile=true"]}
# warm-up steps: a compiled model records its graphs on the first batches (and again once shapes turn dynamic);
# eager waits as long, so that both time the same batches
WARMUP = 12
STEPS = {"small": 30, "base": 10}


def run(size: str, mode: str, steps: int, folder: Path) -> dict:
    command = [sys.executable, "-m", "transformer.train", *RECIPE, f"model={size}", *MODES[mode],
               f"trainer.max_steps={WARMUP + steps + PROFILED + 1}", f"hydra.run.dir={folder}",
               "+callbacks.step_cost._target_=step_cost.StepCost", f"+callbacks.step_cost.out={folder}",
               f"+callbacks.step_cost.first={WARMUP}", f"+callbacks.step_cost.steps={steps}"]  # fmt: skip
    # the training process loads StepCost from this folder
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{size} {mode}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads((folder / "step_cost.json").read_text())


def main() -> None:
    restart_with_jemalloc()  # the GEMMs timed under the allocator training runs with
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "base"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=int, help="timed optimizer steps per run (default: small 30, base 10)")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    print(machine())
    rates = ["| size | mode | precision | MFLOP / target token | target tok/s | GFLOP/s | GEMM 2048³ GFLOP/s | GEMM at "
             "the model's shapes | MFU (2048³) | MFU (model's shapes) |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    kinds = ["| size | mode | timed steps (compiling, left out) | step ms (profiled) | " + " | ".join(KINDS) +
             " | of which parameter-shaped casts: calls/step, share | other casts: calls/step, share |",
             "|---|---|---:|---:|" + "---:|" * (len(KINDS) + 2)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            for mode in args.modes:
                found = run(size, mode, args.steps or STEPS[size], Path(tmp) / f"{size}_{mode}")
                timed, flops, profiled = found["timed"], found["flops"], found["profiled"]
                if timed["steps"] == 0:
                    raise SystemExit(f"{size} {mode}: every timed step compiled; try a longer --steps")
                per_token = flops["total"] / flops["target_tokens"]
                speed = timed["target_tokens"] / timed["seconds"]
                dtype = precision_dtype(found["precision"])
                torch.set_num_threads(found["threads"])
                square = square_gemm_rate(dtype)
                own = step_gemm_rate(found["model"], timed["target_tokens"] // timed["steps"], dtype)
                achieved = per_token * speed
                rates.append(f"| {size} | {mode} | {found['precision']} | {per_token / 1e6:.1f} | {speed:,.0f} | "
                             f"{achieved / 1e9:.0f} | {square / 1e9:.0f} | {own / 1e9:.0f} | {achieved / square:.0%} | "
                             f"{achieved / own:.0%} |")  # fmt: skip
                shares = " | ".join(f"{profiled['by_kind'][k] / profiled['seconds']:.0%}" for k in KINDS)
                casts = " | ".join(f"{calls / profiled['steps']:.0f}, {seconds / profiled['seconds']:.1%}"
                                   for calls, seconds in profiled["casts"].values())  # fmt: skip
                step_ms = 1e3 * profiled["seconds"] / profiled["steps"]
                kinds.append(f"| {size} | {mode} | {timed['steps']} ({timed['compiling_steps']}) | {step_ms:.0f} (unprofiled {1e3 * timed['seconds'] / timed['steps']:.0f}) "
                             f"| {shares} | {casts} |")  # fmt: skip
                print(rates[-1], kinds[-1], sep="\n", flush=True)
    tables = "\n".join(rates) + "\n\nWhere the step's time goes (torch.profiler's self time by kind; framework: what no op accounts for, Python, Lightning and the autograd engine; casts split by their operand: a parameter's shape, what bf16 working weights would remove, or another):\n\n" + "\n".join(kinds)  # fmt: skip
    print(tables)
    if args.write:
        record("bench_mfu", f"Model FLOPs utilisation of the training step (`python tools/bench_mfu.py --sizes "
               f"{' '.join(args.sizes)} --modes {' '.join(args.modes)} --write`)",
               ": `python -m transformer.train experiment=multi30k_de_en_cpu model=small` (and `model=base`; its precision, AdamW, EMA, "
               "logging), validation and checkpoints off; target tokens/s over the timed steps after "
               f"{WARMUP} warm-up steps (the same batches in both modes), leaving out a step that compiled (a "
               "compiled model meeting a new shape: paid once a run); model FLOPs per target token of the same steps' "
               "batches by FlopCounterMode when training ends (forward, loss, backward as eager runs them, a compiled "
               "model too; padded positions included; the CPU's flash attention counted as FlopCounterMode counts "
               "the GPU's). "
               "GEMM rates measured by the benchmark's process between the runs with the run's threads and dtype: "
               "at 2048³, and over the step's linear-layer products at its mean tokens per batch (forward, and "
               "the backward's two with their transposed operands), each as often as a step has it. MFU: "
               "FLOPs per token x tokens/s over each rate.\n\n" + tables)  # fmt: skip


if __name__ == "__main__":
    main()
