"""Average the weights of several checkpoints into one that `evaluate` and `translate` accept.

python scripts/average_checkpoints.py outputs/RUN/checkpoints --last 5 --output outputs/RUN/checkpoints/avg5.pt
python scripts/average_checkpoints.py a.ckpt b.ckpt c.ckpt --output avg.pt
"""

import argparse
import sys
from pathlib import Path

from transformer.averaging import average_checkpoints, checkpoints_in
from transformer.training.checkpoint import AtomicCheckpointIO


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", type=Path, help="checkpoint files, or one checkpoints/ folder")
    parser.add_argument("--last", type=int, help="with a folder: average its last N checkpoints by step")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    try:
        if len(args.inputs) == 1 and args.inputs[0].is_dir():
            paths = checkpoints_in(args.inputs[0], args.last or 5)
        else:
            paths = args.inputs
        averaged = average_checkpoints(paths)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    AtomicCheckpointIO().save_checkpoint(averaged, args.output)
    print(f"averaged {len(paths)} checkpoints (steps up to {averaged['global_step']}) into {args.output}")


if __name__ == "__main__":
    main()
