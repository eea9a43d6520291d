"""python -m transformer.score ckpt_path=PATH [reverse_ckpt_path=PATH] [data.path=DIR] [split=train] [output=FILE]:
each pair's mean log-probability per target token under a checkpoint (teacher-forced), and with a model of the other
direction the dual conditional cross-entropy, written beside the corpus for prepare to filter by
(data.scores=FILE data.keep_best=0.9)."""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from .cli.command import CONFIGS, check_overrides, one_line_errors
from .data import DataConfig, DataError, load_corpus
from .data.scores import read_columns, split_fingerprint
from .model import RuntimeConfig
from .translators import PRECISIONS, CheckpointTranslator
from .translators.pair_scores import score_split


def check_reverse(reverse: CheckpointTranslator, data: DataConfig, path: str) -> None:
    trained = (reverse.data.get("src"), reverse.data.get("tgt"))
    if trained != (data.tgt, data.src):
        raise ValueError(f"reverse_ckpt_path={path} translates {trained[0]}->{trained[1]}, not {data.tgt}->{data.src} "
                         f"(the reverse of ckpt_path's {data.src}->{data.tgt}); give a checkpoint trained "
                         f"{data.tgt}->{data.src}")  # fmt: skip


@hydra.main(config_path=str(CONFIGS), config_name="score", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    plain = OmegaConf.to_container(cfg, resolve=True)
    runtime = RuntimeConfig(**plain["runtime"])
    forward = CheckpointTranslator.from_path(cfg.ckpt_path, cfg.device, runtime, cfg.ema)
    data = DataConfig.from_checkpoint(forward.data, plain["data"])
    reverse = None
    if cfg.reverse_ckpt_path is not None:
        reverse = CheckpointTranslator.from_path(cfg.reverse_ckpt_path, cfg.device, runtime, cfg.ema)
        check_reverse(reverse, data, cfg.reverse_ckpt_path)
    splits = load_corpus(data.corpus(), data.src, data.tgt, data.cache_dir, need_train=False)[0]
    if cfg.split not in splits:
        raise DataError(f"split={cfg.split} is not in {data.path} (found {', '.join(splits)}); choose one of those")
    if cfg.output is None and data.format == "hub":
        raise ValueError(f"data.path={data.path} is a hub dataset: give output=FILE for its scores")
    precision = str(cfg.precision or forward.trained_precision)
    if precision not in PRECISIONS:  # bf16-mixed would score in float32, unsaid
        raise ValueError(f"precision={precision} is not one of {', '.join(PRECISIONS)}; give precision=bf16 or 32")
    output = Path(cfg.output or Path(data.path) / f"{cfg.split}.{data.src}-{data.tgt}.scores.tsv")
    ds = splits[cfg.split]
    settings = {"checkpoint": str(cfg.ckpt_path), "reverse": cfg.reverse_ckpt_path, "ema": cfg.ema,
                "precision": precision, "corpus": data.path, "split": cfg.split,
                "src": data.src, "tgt": data.tgt, "fingerprint": split_fingerprint(ds)}  # fmt: skip
    score_split(ds, output, settings, forward, reverse, cfg.max_tokens or data.max_tokens, cfg.chunk_pairs,
                settings["precision"])  # fmt: skip
    columns = read_columns(output)
    means = ", ".join(f"{name} {v.mean():.3f}" for name, v in columns.items() if name != "line") if len(ds) else ""
    print(f"{len(ds)} pairs of {data.path} ({cfg.split}) scored: {output} (means: {means}; nats per token)")


def cli() -> None:
    """`python -m transformer.score`, and the console script `transformer-score`."""
    check_overrides("score", sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
