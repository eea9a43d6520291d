"""Kill a real training run with SIGKILL (and SIGTERM) at random moments, resume it each time, and report
what each fault cost; the final weights are compared with those of a run never interrupted. A kill inside a
checkpoint write is made by the writer itself, at a random stage of one of its writes (KILL_AT in
transformer/training/checkpoint.py), so that it lands there every time.

    python tools/fault_injection.py --kills 20            # print the table
    python tools/fault_injection.py --kills 20 --write    # and record it in docs/reliability.md

It trains the tiny model on a generated corpus (fp32, 1,300 steps, last.ckpt every 5 steps). Run it alone.
"""

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.corpus import write_text_corpus
from common.report import DOCS, record
from transformer.training.checkpoint import KILL_AT, WRITE_STAGES

ROOT = Path(__file__).resolve().parents[1]
DOC = DOCS / "reliability.md"
EVERY = 5


def train_args(tmp: Path, run: Path, resume: bool) -> list[str]:
    return [sys.executable, "-m", "transformer.train", "model=tiny", "trainer.precision=32", "trainer.max_steps=1300",
            "trainer.max_epochs=100", "trainer.val_check_interval=10", "trainer.log_every_n_steps=1",
            f"callbacks.last_checkpoint.every_n_train_steps={EVERY}", "trainer.enable_progress_bar=false",
            "validation.bleu_max_sentences=5", f"data.path={tmp / 'c'}", f"data.cache_dir={tmp / 'cache'}",
            "data.vocab_size=340", "data.test_split=test", "data.max_length=100", "data.max_tokens=300",
            f"hydra.run.dir={run}", *(["ckpt_path=last"] if resume else [])]  # fmt: skip


def last_logged_step(run: Path) -> int:
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return max((e.step for e in events.Scalars("train/loss")), default=-1) + 1 if events.Tags()["scalars"] else 0


def written_since(path: Path, mtime: int | None) -> bool:
    return path.exists() and (mtime is None or path.stat().st_mtime_ns != mtime)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", action="store_true", help=f"record the table in {DOC}")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="faults."))
    write_text_corpus(tmp / "c")
    subprocess.run(train_args(tmp, tmp / "reference", False), cwd=ROOT, check=True, capture_output=True)

    run, last = tmp / "run", tmp / "run" / "checkpoints" / "last.ckpt"
    rows, kinds = [], ["SIGKILL after a random delay", "SIGKILL while a checkpoint is written", "SIGTERM"]
    for i in range(args.kills):
        kind = kinds[i % 3]
        before = last.stat().st_mtime_ns if last.exists() else None
        inside_a_write = kind == "SIGKILL while a checkpoint is written"
        env = {**os.environ, KILL_AT: f"{rng.choice(WRITE_STAGES)}:{rng.randint(1, 3)}"} if inside_a_write else None
        process = subprocess.Popen(train_args(tmp, run, last.exists()), cwd=ROOT, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, env=env)  # fmt: skip
        if inside_a_write:
            code = process.wait()
            if code != -signal.SIGKILL:
                break  # finished before this fault
        else:
            while not written_since(last, before) and process.poll() is None:
                time.sleep(0.01)  # until this run has trained and written a checkpoint of its own
            time.sleep(rng.uniform(0.2, 2.0))
            if process.poll() is not None:
                break  # finished before this fault
            process.send_signal(signal.SIGTERM if kind == "SIGTERM" else signal.SIGKILL)
            code = process.wait()
        reached, saved = last_logged_step(run), torch.load(last, weights_only=True)["global_step"]
        rows.append((kind, code, reached, saved))
        print(f"{i + 1:>3} {kind:<40} exit {code:>4}  trained to step {reached:>4}  last.ckpt step {saved:>4}")
    process = subprocess.run(train_args(tmp, run, True), cwd=ROOT, capture_output=True)
    final = torch.load(last, weights_only=True)
    reference = torch.load(tmp / "reference" / "checkpoints" / "last.ckpt", weights_only=True)
    diff = max((final["state_dict"][k] - v).abs().max().item() for k, v in reference["state_dict"].items())
    print(f"finished: exit {process.returncode}, step {final['global_step']}; largest weight difference from the "
          f"uninterrupted run: {diff:.3g}")  # fmt: skip

    table = ["| fault | times | exit status | steps lost per fault (trained - in last.ckpt): max, mean | last.ckpt loadable |",
             "|---|---:|---|---:|---|"]  # fmt: skip
    for kind in kinds:
        mine = [r for r in rows if r[0] == kind]
        if mine:
            lost = [max(0, reached - saved) for _, _, reached, saved in mine]
            codes = ", ".join(sorted({str(c) for _, c, _, _ in mine}))
            table.append(f"| {kind} | {len(mine)} | {codes} | {max(lost)}, {sum(lost) / len(lost):.1f} | every time |")
    print("\n".join(table))
    if args.write:
        record(
            "fault_injection",
            f"Kills and signals (`python tools/fault_injection.py --kills {args.kills} --write`)",
            f": the tiny model, fp32, 1,300 steps, `last.ckpt` every {EVERY} steps and at "
            "every validation (every 10 steps); after each fault the run resumed with `ckpt_path=last`. "
            f"{len(rows)} faults, then the run finished (exit {process.returncode}) at step {final['global_step']}; "
            f"largest weight difference from a run never interrupted: {diff:.3g}.\n\n" + "\n".join(table),
            doc=DOC,
            on_machine=False,
        )


if __name__ == "__main__":
    main()
