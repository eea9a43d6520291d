"""python -m transformer.prepare [experiment=...] [data.key=value ...]: train or reuse the tokenizer, encode all
splits, report. It composes train's config, so it takes the overrides a training run takes, and uses their data.*."""

import logging
import sys

import datasets
import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

from .cli.command import CONFIGS, check_overrides, one_line_errors
from .data import (
    DataConfig,
    PreparedData,
    TokenBatchSampler,
    TranslationDataModule,
    example_lengths,
    padding_fraction,
)
from .data.cleaning import DROP_REASONS
from .data.prepare import dropped_file

log = logging.getLogger(__name__)


# prepare's column headings for cleaning.DROP_REASONS
REASON_HEADINGS = {"empty": "empty", "copy": "copy", "language": "lang", "duplicate": "dup",
                   "repeated_source": "rep.src", "score": "score", "too_long": "long", "length_ratio": "ratio"}  # fmt: skip


def _training_table(prepared: PreparedData, cfg: DataConfig) -> list[str]:
    """One row per corpus's training split: what cleaning dropped by reason, the tokens it took, its part in the
    mix; then where each lists its dropped pairs."""
    mix = prepared.mixture
    rows = [
        f"{'training corpus':<18}{'pairs':>9}{'kept':>9}  dropped:"
        + "".join(f"{REASON_HEADINGS[r]:>8}" for r in DROP_REASONS)
        + f"{'tokens lost':>12}{'src mean/p95':>14}{'tgt mean/p95':>14}{'weight':>8}{'share':>7}{'per epoch':>10}"
        f"{'repeats':>8}",
    ]
    for (name, corpus), kept, share, drawn in zip(cfg.all_corpora().items(), mix.sizes, mix.shares, mix.counts()):
        s = prepared.corpus_stats[name][corpus.train_split]
        rows.append(
            f"{name:<18}{s['pairs']:>9}{s['kept']:>9}{'':10}"
            + "".join(f"{s['dropped'][r]:>8}" for r in DROP_REASONS)
            + f"{sum(s['dropped_tokens'].values()):>12}"
            f"{s['src_mean']:>8.1f}/{s['src_p95']:<5.0f}{s['tgt_mean']:>8.1f}/{s['tgt_p95']:<5.0f}"
            f"{corpus.weight:>8.3g}{share:>7.1%}{drawn:>10}{drawn / max(kept, 1):>7.2f}x"
        )
    how = f"temperature {cfg.temperature}" if cfg.temperature else "weights"
    rows.append(f"shares by {how}; {mix.epoch_pairs} pairs per epoch")
    for name, corpus in cfg.all_corpora().items():
        if sum(prepared.corpus_stats[name][corpus.train_split]["dropped"].values()):
            rows.append(
                f"{name}'s dropped pairs, by line and reason: {dropped_file(prepared.folder, name, corpus.train_split)}"
            )
    return rows


def report(prepared: PreparedData, cfg: DataConfig) -> str:
    """A table of the training corpora (see _training_table), then one of every split: pairs, kept and dropped,
    repaired (undecodable bytes, control characters, evaluation sequences cut to
    max_length), lengths, batches per epoch, padding."""
    corpora = cfg.all_corpora()
    tok = prepared.src_tokenizer
    joint = tok.path == prepared.tgt_tokenizer.path
    rows = [
        f"corpora {', '.join(f'{n} ({c.path})' for n, c in corpora.items())} ({cfg.src}->{cfg.tgt}), "
        f"cache {prepared.folder}" + (" (reused)" if prepared.reused else ""),
        f"vocabulary: {tok.vocab_size} ({'joint' if joint else 'source'})"
        + ("" if joint else f", {prepared.tgt_tokenizer.vocab_size} (target)")
        + f", {tok.model_type}{f' from {cfg.tokenizer}' if cfg.tokenizer else ''}; pad/unk/bos/eos = "
        f"{tok.pad_id}/{tok.unk_id}/{tok.bos_id}/{tok.eos_id}" + (f"; tags {', '.join(tok.tags)}" if tok.tags else ""),
        "",
        *_training_table(prepared, cfg),
        "",
        f"{'split':<26}{'pairs':>9}{'kept':>9}{'dropped':>9}{'utf8':>6}{'ctrl':>6}{'cut':>5}"
        f"{'src mean/p95':>14}{'tgt mean/p95':>14}{'batches':>9}{'padding':>9}",
    ]
    trains = [example_lengths(prepared.corpora[n][c.train_split]) for n, c in corpora.items()]
    train = np.concatenate(trains)
    train_batches = TokenBatchSampler(train, cfg.max_tokens, seed=cfg.seed, mixture=prepared.mixture,
                                      length_rungs=cfg.length_rungs).all_batches(0)  # fmt: skip
    rows.append(_split_row("train (mix)" if len(corpora) > 1 else cfg.train_split,
                           _training_stats(prepared, cfg, train, train_batches), train_batches, train,
                           cfg.length_rungs))  # fmt: skip
    for name, corpus in corpora.items():
        for split, s in prepared.corpus_stats[name].items():
            if split != corpus.train_split:
                lengths = example_lengths(prepared.corpora[name][split])
                batches = TokenBatchSampler(lengths, cfg.max_tokens, shuffle=False,
                                            length_rungs=cfg.length_rungs).all_batches(0)  # fmt: skip
                rows.append(_split_row(f"{name}/{split}" if len(corpora) > 1 else split, s, batches, lengths,
                                       cfg.length_rungs))  # fmt: skip
    order = np.random.default_rng(cfg.seed).permutation(len(train))
    per_batch = max(1, len(train) // max(len(train_batches), 1))  # sentences per batch, on average
    sentence_batches = [order[i : i + per_batch] for i in range(0, len(order), per_batch)]
    rows.append(
        f"\nmax_tokens={cfg.max_tokens}; the same training pairs in random batches of {per_batch} sentences "
        f"would be {padding_fraction(sentence_batches, train):.1%} padding"
    )
    return "\n".join(rows)


def _training_stats(prepared: PreparedData, cfg: DataConfig, train: np.ndarray, batches: list) -> dict:
    """The training splits' counts summed; lengths those of the pairs one epoch draws (of the mix)."""
    parts = [prepared.corpus_stats[n][c.train_split] for n, c in cfg.all_corpora().items()]
    if len(parts) == 1:
        return parts[0]
    drawn = train[np.concatenate(batches)] - 1  # without EOS/BOS, as prepare's statistics count
    summed = {k: sum(p[k] for p in parts) for k in ("pairs", "kept")}
    summed |= {k: {r: sum(p[k][r] for p in parts) for r in parts[0][k]} for k in ("dropped", "repaired")}
    for i, side in enumerate(("src", "tgt")):
        summed[f"{side}_mean"], summed[f"{side}_p95"] = float(drawn[:, i].mean()), float(np.percentile(drawn[:, i], 95))
    return summed


def _split_row(label: str, s: dict, batches: list, lengths: np.ndarray, length_rungs: int | None) -> str:
    d, r = s["dropped"], s["repaired"]
    return (
        f"{label:<26}{s['pairs']:>9}{s['kept']:>9}{sum(d.values()):>9}"
        f"{r['invalid_utf8']:>6}{r['control_chars']:>6}{r['truncated']:>5}"
        f"{s['src_mean']:>8.1f}/{s['src_p95']:<5.0f}{s['tgt_mean']:>8.1f}/{s['tgt_p95']:<5.0f}"
        f"{len(batches):>9}{padding_fraction(batches, lengths, length_rungs):>9.1%}"
    )


@hydra.main(config_path=str(CONFIGS), config_name="prepare", version_base="1.3")
@one_line_errors
def main(config: DictConfig) -> None:
    datasets.disable_progress_bars()
    cfg = DataConfig.from_dict(OmegaConf.to_container(config.data, resolve=True))
    data = TranslationDataModule(cfg)
    data.prepare_data()  # what a run's first rank prepares: with data.sampling_alpha, the n-best lists too
    print(report(data.prepared, cfg))


def cli() -> None:
    """`python -m transformer.prepare`, and the console script `transformer-prepare`."""
    check_overrides("prepare", sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
