"""Time to quality: minutes of training until a run's epoch checkpoints first score a BLEU on a split.

    python scripts/time_to_bleu.py outputs/RUN/checkpoints --bleu 39.2              # test split, beam 5
    python scripts/time_to_bleu.py outputs/RUN/checkpoints --bleu 39.2 --all        # score every checkpoint
    python scripts/time_to_bleu.py outputs/RUN/checkpoints --bleu 41.3 --ema        # their weight averages

Training minutes come from Lightning's Timer state in each checkpoint (the run needs trainer.max_time set, as
the multi30k_*_cpu recipe has): time inside fit, validation included, setup and data preparation excluded.
Keep every epoch's checkpoint for this (callbacks.epoch_checkpoints.save_top_k=-1). Run it alone.
"""

import argparse
from pathlib import Path

from transformer.data import DataConfig
from transformer.training.averaging import checkpoints_by_step
from transformer.translators import CheckpointTranslator, SearchConfig
from transformer.translators.scores import evaluate


def training_minutes(checkpoint: dict) -> float | None:
    timer = checkpoint.get("callbacks", {}).get("Timer")
    return timer["time_elapsed"]["train"] / 60 if timer else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a run's checkpoints/ folder")
    parser.add_argument("--bleu", type=float, required=True, help="the BLEU to reach")
    parser.add_argument("--split", default=None, help="default: the run's test split")
    parser.add_argument("--beam-size", type=int, default=5)
    parser.add_argument("--all", action="store_true", help="score every checkpoint, not only up to the first hit")
    parser.add_argument("--ema", action="store_true", help="score the weight average (optim.ema_decay) of each")
    args = parser.parse_args(argv)
    print("| step | training minutes | BLEU | chrF++ |\n|---:|---:|---:|---:|")
    reached = None
    for step, path, minutes in checkpoints_by_step(args.folder, training_minutes):
        translator = CheckpointTranslator.from_path(str(path), ema=args.ema)
        data = DataConfig.from_checkpoint(translator.data, {})
        result = evaluate(translator, data, args.split or data.test_split, SearchConfig(beam_size=args.beam_size),
                          translator.trained_precision)  # fmt: skip
        shown = f"{minutes:.1f}" if minutes is not None else "?"
        print(f"| {step} | {shown} | {result['bleu']:.2f} | {result['chrf']:.2f} |", flush=True)
        if result["bleu"] >= args.bleu and reached is None:
            reached = (step, shown)
            if not args.all:
                break
    if reached:
        print(f"BLEU {args.bleu} first reached at step {reached[0]}, after {reached[1]} minutes of training")
    else:
        print(f"BLEU {args.bleu} not reached by any checkpoint in {args.folder}")


if __name__ == "__main__":
    main()
