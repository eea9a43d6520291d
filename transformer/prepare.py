"""python -m transformer.prepare data=multi30k: train or reuse the tokenizer, encode all splits, report."""

import logging
import sys

import datasets
import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

from .cli import check_overrides, one_line_errors
from .data import DataConfig, PreparedData, TokenBatchSampler, example_lengths, padding_fraction, prepare_data

log = logging.getLogger(__name__)


def report(prepared: PreparedData, cfg: DataConfig) -> str:
    """A table: pairs per split, kept and dropped (empty, too long, length ratio), repaired (undecodable bytes,
    control characters, evaluation sequences cut to max_length), lengths, batches per epoch, padding."""
    rows = [
        f"corpus {cfg.path} ({cfg.src}->{cfg.tgt}), cache {prepared.folder}" + (" (reused)" if prepared.reused else ""),
        f"vocabulary: {prepared.src_tokenizer.vocab_size} ({'joint' if cfg.joint_vocab else 'source'})"
        + ("" if cfg.joint_vocab else f", {prepared.tgt_tokenizer.vocab_size} (target)")
        + f", {cfg.tokenizer_type}; pad/unk/bos/eos = {prepared.src_tokenizer.pad_id}/{prepared.src_tokenizer.unk_id}"
        f"/{prepared.src_tokenizer.bos_id}/{prepared.src_tokenizer.eos_id}",
        "",
        f"{'split':<18}{'pairs':>8}{'kept':>8}{'empty':>7}{'long':>6}{'ratio':>7}{'utf8':>6}{'ctrl':>6}{'cut':>5}"
        f"{'src mean/p95':>14}{'tgt mean/p95':>14}{'batches':>9}{'padding':>9}",
    ]
    train_batches = 1
    for split, s in prepared.stats.items():
        lengths = example_lengths(prepared.splits[split])
        batches = TokenBatchSampler(
            lengths, cfg.max_tokens, shuffle=split == cfg.train_split, seed=cfg.seed
        ).all_batches(0)
        if split == cfg.train_split:
            train_batches = len(batches)
        d, r = s["dropped"], s["repaired"]
        rows.append(
            f"{split:<18}{s['pairs']:>8}{s['kept']:>8}{d['empty']:>7}{d['too_long']:>6}{d['length_ratio']:>7}"
            f"{r['invalid_utf8']:>6}{r['control_chars']:>6}{r['truncated']:>5}"
            f"{s['src_mean']:>8.1f}/{s['src_p95']:<5.0f}{s['tgt_mean']:>8.1f}/{s['tgt_p95']:<5.0f}"
            f"{len(batches):>9}{padding_fraction(batches, lengths):>9.1%}"
        )
    train = example_lengths(prepared.splits[cfg.train_split])
    order = np.random.default_rng(cfg.seed).permutation(len(train))
    per_batch = max(1, len(train) // train_batches)  # sentences per batch, on average
    sentence_batches = [order[i : i + per_batch] for i in range(0, len(order), per_batch)]
    rows.append(
        f"\nmax_tokens={cfg.max_tokens}; the same {cfg.train_split} split in random batches of {per_batch} sentences "
        f"would be {padding_fraction(sentence_batches, train):.1%} padding"
    )
    return "\n".join(rows)


@hydra.main(config_path="../configs", config_name="prepare", version_base="1.3")
@one_line_errors
def main(config: DictConfig) -> None:
    datasets.disable_progress_bars()
    cfg = DataConfig.from_dict(OmegaConf.to_container(config.data, resolve=True))
    prepared = prepare_data(cfg)
    print(report(prepared, cfg))


if __name__ == "__main__":
    check_overrides("prepare", sys.argv[1:])
    main()
