"""The table of scripts/reproduce_teacher_student.sh's folder: every model's steps and training wall-clock minutes,
its BLEU and chrF++ on each split scored (EMA weights, beam 5), and, with --speed, the int8 exports' BLEU at their
parity gate and sentences/s on 1 and 2 threads over a file of sources (the median of 3 passes). --best-teacher prints
the teacher with the best val BLEU (--single: leaving out the ensemble), which the pipeline distils.

    python scripts/teacher_student_table.py outputs/teacher_student --speed data/multi30k/test_2016_flickr.de.gz
"""

import argparse
import json
import statistics
import time
from pathlib import Path

from transformer.data.sources import read_lines
from transformer.training.resume import load_checkpoint


def scores(out: Path) -> dict[str, dict[str, dict]]:
    """model name -> split -> evaluate's result."""
    found = {}
    for path in sorted(out.glob("eval/*/*/*.json")):
        found.setdefault(path.parent.parent.name, {})[path.parent.name] = json.loads(path.read_text())
    return found


def best_teacher(out: Path, single: bool) -> str:
    candidates = {name: by_split["val"]["bleu"] for name, by_split in scores(out).items()
                  if not name.startswith("student_") and "val" in by_split
                  and not (single and name == "ensemble")}  # fmt: skip
    if not candidates:
        raise SystemExit(f"no teacher of {out} has been scored on val; run the pipeline's teacher stage first")
    return max(candidates, key=candidates.get)


def gate_bleu(folder: Path) -> str:
    """The export's BLEU in its parity gate's beam search (the checkpoint's in brackets)."""
    beam = json.loads((folder / "model_card.json").read_text())["parity"]["searches"][-1]
    return f"{beam['bleu_export']:.2f} ({beam['bleu_ours']:.2f})"


def sentences_per_second(folder: Path, sources: list[str], threads: int) -> float:
    from transformer.translators import SearchConfig, open_translator

    translator, search, times = open_translator(str(folder), threads=threads), SearchConfig(beam_size=5), []
    for _ in range(3):
        start = time.perf_counter()
        translator.translate(sources, search)
        times.append(time.perf_counter() - start)
    return len(sources) / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--best-teacher", action="store_true")
    parser.add_argument("--single", action="store_true", help="with --best-teacher: not the ensemble")
    parser.add_argument("--speed", help="a file of sources: time the int8 exports on them")
    args = parser.parse_args()
    out = Path(args.out)
    if args.best_teacher:
        print(best_teacher(out, args.single))
        return
    found = scores(out)
    splits = sorted({split for by_split in found.values() for split in by_split}, key=lambda s: s != "val")
    print("| model | steps | training wall-clock min | " + " | ".join(f"{s} BLEU | {s} chrF++" for s in splits) + " |")
    print("|---|---:|---:|" + "---:|---:|" * len(splits))
    members = (out / "ensemble_members").read_text().split() if (out / "ensemble_members").exists() else []
    for name, by_split in found.items():
        runs = [out / n for n in (members if name == "ensemble" else [name])]
        steps, minutes = [], []
        for run in runs:
            steps.append(str(load_checkpoint(str(run / "checkpoints" / "last.ckpt"))["global_step"]))
            wall = run / "wall_clock_s"  # the training command's seconds, one line per start (a resumed run: more)
            minutes.append(f"{sum(map(int, wall.read_text().split())) / 60:.1f}" if wall.exists() else "?")
        cells = [f"{by_split[s]['bleu']:.2f} | {by_split[s]['chrf']:.2f}" if s in by_split else "|" for s in splits]
        print(f"| {name} | {' + '.join(steps)} | {' + '.join(minutes)} | " + " | ".join(cells) + " |")
    if args.speed:
        sources = read_lines(Path(args.speed))
        print(f"\nThe int8 exports (NAME_shortlist: with a lexical shortlist) on {len(sources)} sentences of "
              f"{args.speed}, beam 5, median of 3 passes; BLEU as their parity gate measured it:\n")  # fmt: skip
        print("| int8 export | gate BLEU, beam 5 (checkpoint) | sentences/s, 1 thread | 2 threads |")
        print("|---|---:|---:|---:|")
        for folder in sorted((out / "export").glob("*/model.bin")):
            rates = [sentences_per_second(folder.parent, sources, threads) for threads in (1, 2)]
            print(f"| {folder.parent.name} | {gate_bleu(folder.parent)} | {rates[0]:.1f} | {rates[1]:.1f} |")


if __name__ == "__main__":
    main()
