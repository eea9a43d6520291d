"""The table of scripts/reproduce_teacher_student.py's folder: every model's steps, training wall-clock minutes, the
machines and precision it trained on, its BLEU and chrF++ on each split scored (EMA weights, beam 5), and, with
--speed, the int8 exports' BLEU at their parity gate and sentences/s on 1 and 2 threads over a file of sources (the
median of 3 passes), and the aims judged. --best-teacher prints the pipeline's teacher (OUT/teachers and the ensemble)
with the best val BLEU, which it distils; with --single, the ensemble left out: the one it exports.

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


def names(out: Path, what: str) -> list[str]:
    """The models the pipeline named in OUT/what: its `teachers` (single models) or its `ensemble_members`."""
    return (out / what).read_text().split() if (out / what).exists() else []


def best_teacher(out: Path, single: bool) -> str:
    """The pipeline's teacher with the best val BLEU, the ensemble included unless `single`."""
    found, candidates = scores(out), names(out, "teachers") + ([] if single else ["ensemble"])
    unscored = [name for name in candidates if "val" not in found.get(name, {})]
    if not names(out, "teachers") or unscored:
        raise SystemExit(f"the teachers of {out} ({', '.join(unscored) or 'none named'}) are not all scored on val; "
                         "run the pipeline's teacher stage first")  # fmt: skip
    return max(candidates, key=lambda name: found[name]["val"]["bleu"])


def wall_clock(path: Path) -> tuple[str, list[str]]:
    """A wall_clock_s file, a line per start of a training or a corpus translation (its seconds, then its machine),
    as (the minutes of all starts, or ?; the machines, in order)."""
    starts = [line.partition(" ") for line in path.read_text().splitlines()] if path.exists() else []
    minutes = f"{sum(int(seconds) for seconds, _, _ in starts) / 60:.1f}" if starts else "?"
    return minutes, list(dict.fromkeys(on or "?" for _, _, on in starts))


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


def aims(found: dict, out: Path, rates: dict[str, list[float]], test: str) -> list[tuple[str, str, bool | None]]:
    """The issue's aims (docs/teacher_student.md), each (aim, result, met; None: not yet scored): BLEU on `test`,
    every choice on val, a tie on val taking the harder bar; speed on one thread through the int8 exports (`rates`:
    export name -> sentences/s on 1 and 2 threads), against the single teacher the pipeline exports."""

    def bleu(name: str, split: str = test) -> float:
        return found[name][split]["bleu"]

    def versus(name: str, other: str, bar: float) -> tuple[str, bool]:
        gain = bleu(name) - bleu(other)
        return f"{name} {bleu(name):.2f} against {other} {bleu(other):.2f}: {gain:+.2f}", gain >= bar

    def ensemble():
        better = max(names(out, "ensemble_members"), key=lambda name: (bleu(name, "val"), bleu(name)))
        return versus("ensemble", better, 0.5)

    def back_translation():
        bt = [name for name in names(out, "teachers") if name.startswith("bt_")]
        return versus(max(bt, key=lambda name: (bleu(name, "val"), -bleu(name))), "base", 1.0)

    student = "student_deep_shallow_distilled"

    def speed():
        single = best_teacher(out, single=True)
        ratios = {name: rates[name][0] / rates[single][0] for name in (student, student + "_shortlist")}
        result = "; ".join(f"{name} {rates[name][0]:.1f} against {single} {rates[single][0]:.1f}: {ratio:.2f}x"
                           for name, ratio in ratios.items())  # fmt: skip
        return result, max(ratios.values()) >= 3

    rules = [
        ("ensemble of two: +0.5 over the better single model", ensemble),
        ("back-translation: +1.0 over the recipe (the best on val)", back_translation),
        ("deep-shallow: within 1.5 BLEU of its teacher", lambda: versus(student, (out / "teacher").read_text().strip(), -1.5)),
        *[(f"distilled {model}: +1.0 over the same student on original data",
           lambda model=model: versus(f"student_{model}_distilled", f"student_{model}_original", 1.0))
          for model in ("deep_shallow", "tiny")],
    ]  # fmt: skip
    if rates:
        rules.insert(3, ("deep-shallow int8: 3x the teacher's sentences/s on 1 thread", speed))
    rows = []
    for aim, judge in rules:
        try:
            rows.append((aim, *judge()))
        except (KeyError, ValueError, OSError, SystemExit):  # a model or export not there yet: a run under way
            rows.append((aim, "not yet scored", None))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--best-teacher", action="store_true", help="print the teacher the pipeline distils")
    parser.add_argument("--single", action="store_true", help="with --best-teacher: the ensemble left out")
    parser.add_argument("--speed", help="a file of sources: time the int8 exports on them")
    parser.add_argument("--speed-sentences", type=int, default=0, help="with --speed: its first N lines (0: all)")
    args = parser.parse_args()
    out = Path(args.out)
    if args.best_teacher:
        print(best_teacher(out, args.single))
        return
    found = scores(out)
    splits = sorted({split for by_split in found.values() for split in by_split}, key=lambda s: (s != "val", s))
    print("| model | steps | training wall-clock min | trained on, precision | "
          + " | ".join(f"{s} BLEU | {s} chrF++" for s in splits) + " |")  # fmt: skip
    print("|---|---:|---:|---|" + "---:|---:|" * len(splits))
    members = names(out, "ensemble_members") or ["?"]
    for name, by_split in found.items():
        steps, minutes, machines, precisions = [], [], {}, {}
        for run in [out / n for n in (members if name == "ensemble" else [name])]:
            last = run / "checkpoints" / "last.ckpt"
            checkpoint = load_checkpoint(str(last)) if last.exists() else {}
            steps.append(str(checkpoint.get("global_step", "?")))
            precisions[checkpoint.get("precision", "?")] = None
            spent, on = wall_clock(run / "wall_clock_s")
            minutes.append(spent)
            machines.update(dict.fromkeys(on))
        trained_on = f"{' / '.join(machines) or '?'}, {' / '.join(precisions)}"
        cells = [f"{by_split[s]['bleu']:.2f} | {by_split[s]['chrf']:.2f}" if s in by_split else "|" for s in splits]
        print(f"| {name} | {' + '.join(steps)} | {' + '.join(minutes)} | {trained_on} | " + " | ".join(cells) + " |")
    cards = sorted(out.glob("*/train.translation.json"))  # translate output=: each corpus's record
    translations = [(card, card.parent.with_name(card.parent.name + ".wall_clock_s")) for card in cards]
    if translations:
        print("\nThe corpus translations (the wall clock of each start that translated, and its machine):\n")
        print("| corpus | lines | pairs | search | minutes | on |\n|---|---:|---:|---|---:|---|")
        for card, wall in translations:
            record = json.loads(card.read_text())
            minutes, on = wall_clock(wall)
            search = record["search"]
            how = (
                f"sampling (top-k {search['sampling_topk']})"
                if search["sampling_topk"]
                else f"beam {search['beam_size']}"
            )
            print(
                f"| {card.parent.name} | {record['lines']:,} | {record['pairs']:,} | {how} | {minutes} | "
                f"{' / '.join(on) or '?'} |"
            )
    rates = {}
    if args.speed:
        sources = read_lines(Path(args.speed))[: args.speed_sentences or None]
        print(f"\nThe int8 exports (NAME_shortlist: with a lexical shortlist) on {len(sources)} sentences of "
              f"{args.speed}, beam 5, median of 3 passes; BLEU as their parity gate measured it:\n")  # fmt: skip
        print("| int8 export | gate BLEU, beam 5 (checkpoint) | sentences/s, 1 thread | 2 threads |")
        print("|---|---:|---:|---:|")
        for folder in sorted((out / "export").glob("*/model.bin")):
            rate = rates[folder.parent.name] = [sentences_per_second(folder.parent, sources, n) for n in (1, 2)]
            print(f"| {folder.parent.name} | {gate_bleu(folder.parent)} | {rate[0]:.1f} | {rate[1]:.1f} |")
    test = next((split for split in splits if split != "val"), None)
    if test and names(out, "teachers"):
        print(
            f"\nThe aims: BLEU on {test}, each choice (the better single model, the back-translation setting) on val\n"
        )
        print("| aim | result | met |\n|---|---|---|")
        for aim, result, met in aims(found, out, rates, test):
            print(f"| {aim} | {result} | {'?' if met is None else 'yes' if met else 'no'} |")


if __name__ == "__main__":
    main()
