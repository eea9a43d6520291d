"""The results table of one or more run folders: training (epochs, steps, minutes, target tokens/s) and every
evaluation written under RUN/evaluate/ (BLEU cased and lowercased, chrF: chrF++ where its chrf_line starts "chrF2++", plain chrF in older ones).

    python scripts/results_table.py outputs/reproduce_multi30k/de-en outputs/reproduce_multi30k/en-de
"""

import json
import statistics
import sys
from pathlib import Path

from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from transformer.training.resume import load_checkpoint


def training_row(run: Path, cfg) -> str:
    last = load_checkpoint(str(run / "checkpoints" / "last.ckpt"))
    timer = last.get("callbacks", {}).get("Timer")
    minutes = f"{timer['time_elapsed']['train'] / 60:.1f}" if timer else "?"
    wall = run / "wall_clock_s"
    wall_minutes = f"{float(wall.read_text()) / 60:.1f}" if wall.exists() else "?"
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    rate = statistics.median(e.value for e in events.Scalars("train/tokens_per_s"))
    return (f"| {cfg.data.src}->{cfg.data.tgt} | {cfg.model.size} | {last['epoch']} | {last['global_step']} | "
            f"{minutes} | {wall_minutes} | {rate:,.0f} |")  # fmt: skip


def evaluation_rows(run: Path, cfg) -> list[str]:
    rows = []
    for path in sorted((run / "evaluate").glob("*/*.json")):
        result = json.loads(path.read_text())
        search = result["search"]
        decoding = "greedy" if search["beam_size"] == 1 else f"beam {search['beam_size']}"
        rows.append(
            f"| {cfg.data.src}->{cfg.data.tgt} | {Path(result['checkpoint']).name} | {result['split']} | {decoding} | "
            f"{result['bleu']:.2f} | {result['bleu_lowercase']:.2f} | {result['chrf']:.2f} |"
        )
    return rows


def main() -> None:
    runs = [Path(p) for p in sys.argv[1:]]
    if not runs:
        sys.exit("usage: python scripts/results_table.py RUN [RUN ...]")
    configs = {run: OmegaConf.load(run / ".hydra" / "config.yaml") for run in runs}
    print("| direction | model | epochs | steps | training min | wall-clock min | median target tok/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for run in runs:
        print(training_row(run, configs[run]))
    print("\n| direction | checkpoint | split | decoding | BLEU | BLEU lowercase | chrF |")
    print("|---|---|---|---|---:|---:|---:|")
    for run in runs:
        print("\n".join(evaluation_rows(run, configs[run])))


if __name__ == "__main__":
    main()
