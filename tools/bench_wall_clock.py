"""Where a scaled-down run of the GPU recipe spends its wall clock on this machine: training steps, validation, and
the rest (data waits, checkpoints, loader workers starting), measured the same way in this tree and in a peer
revision (a git worktree of it), one after the other, alone.

    python tools/bench_wall_clock.py --peer a5a9816            # the tiny model, 1,000 steps of the recipe
    python tools/bench_wall_clock.py --peer a5a9816 --write    # and record it in docs/benchmarks.md

The share comes from a callback of this script's (WallShare, on the command line of both runs), not from the run's
own closing line, which the peer may not have.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pytorch_lightning import Callback

ROOT = Path(__file__).resolve().parents[1]


class WallShare(Callback):
    """trainer.fit's wall clock, and the time from each training batch's start to its end, and in validation."""

    def __init__(self):
        self.steps = self.validation = 0.0

    def on_fit_start(self, trainer, module):
        self.started = time.perf_counter()

    def on_train_batch_start(self, *args):
        self.batch = time.perf_counter()

    def on_train_batch_end(self, *args):
        self.steps += time.perf_counter() - self.batch

    def on_validation_start(self, *args):
        self.validating = time.perf_counter()

    def on_validation_end(self, *args):
        self.validation += time.perf_counter() - self.validating

    def on_fit_end(self, trainer, module):
        wall = time.perf_counter() - self.started
        print(f"WALL {wall:.1f} STEPS {self.steps:.1f} VALIDATION {self.validation:.1f} COUNT {trainer.global_step}",
              file=sys.stderr, flush=True)  # fmt: skip


def run(tree: Path, overrides: list[str]) -> dict:
    here = str(Path(__file__).resolve().parent)  # WallShare, imported by the training process
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "transformer.train", *overrides,
                           "+callbacks.wall_share._target_=bench_wall_clock.WallShare"],
                          cwd=tree, env=env, capture_output=True, text=True)  # fmt: skip
    found = re.search(r"WALL ([\d.]+) STEPS ([\d.]+) VALIDATION ([\d.]+) COUNT (\d+)", done.stderr)
    if done.returncode or not found:
        raise SystemExit(f"{tree}: exit {done.returncode}\n{done.stderr[-2000:]}")
    wall, steps, validation, count = map(float, found.groups())
    return {"wall": wall, "steps": steps / wall, "validation": validation / wall, "count": int(count)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", help="a git revision to measure the same way (a worktree of it)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    from common.machine import machine
    from common.report import record

    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        overrides = ["experiment=multi30k_de_en_gpu", "model.size=tiny", f"trainer.max_steps={args.steps}",
                     "trainer.max_time=null", "trainer.enable_progress_bar=false", f"data.cache_dir={cache}",
                     f"data.path={(ROOT / 'data' / 'multi30k').resolve()}"]  # fmt: skip
        trees = {"this tree": ROOT}
        if args.peer:
            peer = Path(tmp) / "peer"
            subprocess.run(["git", "worktree", "add", "--detach", str(peer), args.peer], cwd=ROOT, check=True,
                           capture_output=True)  # fmt: skip
            trees[args.peer] = peer
        rows = []
        try:
            for name, tree in trees.items():
                run(tree, [*overrides, f"hydra.run.dir={Path(tmp) / 'warm'}", "trainer.max_steps=1"])  # the cache
                r = run(tree, [*overrides, f"hydra.run.dir={Path(tmp) / name.replace(' ', '_')}"])
                rest = 1 - r["steps"] - r["validation"]
                rows.append(f"| {name} | {r['count']} | {r['wall']:.0f} s | {r['steps']:.1%} | {r['validation']:.1%} "
                            f"| {rest:.1%} |")  # fmt: skip
                print(rows[-1], flush=True)
        finally:
            if args.peer:
                subprocess.run(["git", "worktree", "remove", "--force", str(peer)], cwd=ROOT, capture_output=True)
    table = ("| code | steps | trainer.fit | training steps | validation | the rest |\n|---|---:|---:|---:|---:|---:|\n"
             + "\n".join(rows))  # fmt: skip
    print(machine())
    print(table)
    if args.write:
        record("bench_wall_clock", f"The GPU recipe's wall clock, scaled down (`python tools/bench_wall_clock.py "
               f"--peer {args.peer} --write`)", f": experiment=multi30k_de_en_gpu with the tiny model for "
               f"{args.steps} steps on this CPU, each tree's run alone after a one-step run that builds the data "
               "cache; the share of trainer.fit's wall clock spent from each training batch's start to its end, "
               "and in validation.\n\n" + table)  # fmt: skip


if __name__ == "__main__":
    main()
