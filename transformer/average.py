"""Average the weights of several checkpoints into one that `evaluate`, `translate` and `export` accept.

python -m transformer.average outputs/RUN/checkpoints --last 5    # writes outputs/RUN/checkpoints/average.pt
python -m transformer.average a.ckpt b.ckpt c.ckpt --output avg.pt

A run keeps the best 3 checkpoints by validation.best_metric (and last.ckpt, which averaging skips); to average more,
train with callbacks.epoch_checkpoints.save_top_k=N (the newest N epochs'; experiment=multi30k_de_en_gpu keeps them
every 500 steps).
"""

import argparse
from pathlib import Path

from .cli.command import exit_with
from .training.averaging import AVERAGE_NAME, average_checkpoints, checkpoints_in
from .training.checkpoint import AtomicCheckpointIO


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", type=Path, help="checkpoint files, or one checkpoints/ folder")
    parser.add_argument("--last", type=int, default=5, help="with a folder: average its last N checkpoints by step")
    parser.add_argument("--output", type=Path, help=f"default: {AVERAGE_NAME} in the checkpoints' folder")
    args = parser.parse_args(argv)
    try:
        if len(args.inputs) == 1 and args.inputs[0].is_dir():
            paths, folder = checkpoints_in(args.inputs[0], args.last), args.inputs[0]
        else:
            paths, folder = args.inputs, args.inputs[0].parent
        output = args.output or folder / AVERAGE_NAME
        averaged = average_checkpoints(paths)
    except (ValueError, FileNotFoundError) as e:
        exit_with(e, status=1)
    AtomicCheckpointIO().save_checkpoint(averaged, output)
    print(f"averaged {len(paths)} checkpoints (steps up to {averaged['global_step']}) into {output}")


if __name__ == "__main__":
    main()
