"""Scoring given pairs with a checkpoint (`python -m transformer.score`): each target's mean log-probability per token
given its source, teacher-forced as training computes its loss, and a whole corpus split scored in chunks, each
written whole, so that a killed run resumes at its first chunk not written."""

import contextlib
import json
import math
import shutil
from pathlib import Path

import datasets
import numpy as np
import torch
import torch.nn.functional as F

from ..data.batching import Collate, TokenBatchSampler
from ..data.cleaning import CONTROL
from ..data.scores import COLUMNS, FORWARD_COLUMNS, card_path, dual_score, margin_score, other_pairs
from ..model.loss import target_logits, target_positions
from .checkpoint import CheckpointTranslator
from .corpus import check_settings, synced, write_atomically


@torch.no_grad()
def mean_log_probs(translator: CheckpointTranslator, sources: list[str], targets: list[str], max_tokens: int,
                   precision: str = "32") -> np.ndarray:  # fmt: skip
    """Per pair, log P(target | source) / its tokens (the target's pieces and EOS, as training's loss counts them):
    minus the model's cross-entropy per token without label smoothing. Sides longer than the model's positions are
    cut to them."""
    model, src_tok, tgt_tok = translator.model, translator.src_tokenizer, translator.tgt_tokenizer
    longest = translator.max_source_tokens
    src_ids = [np.array(ids[:longest], np.int64) for ids in src_tok.encode([CONTROL.sub(" ", t) for t in sources])]
    tgt_ids = [np.array(ids[:longest], np.int64) for ids in tgt_tok.encode([CONTROL.sub(" ", t) for t in targets])]
    collate = Collate(tgt_tok.pad_id, tgt_tok.bos_id, tgt_tok.eos_id)
    lengths = np.array([[len(s) + 1, len(t) + 1] for s, t in zip(src_ids, tgt_ids)]).reshape(-1, 2)
    found = np.zeros(len(sources))
    autocast = (
        torch.autocast(translator.device.type, torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    )
    for rows in TokenBatchSampler(lengths, max_tokens, shuffle=False).all_batches(0):
        batch = collate([(src_ids[i], tgt_ids[i], i) for i in rows])
        src, tgt_in, tgt_out = (batch[k].to(translator.device) for k in ("src", "tgt_in", "tgt_out"))
        with autocast:
            logits, labels = target_logits(model, src, tgt_in, tgt_out)  # (N, V) float32, (N,)
        log_probs = -F.cross_entropy(logits, labels, reduction="none")  # (N,)
        row = target_positions(tgt_out, model.pad_id) // tgt_out.size(1)  # (N,) each token's row of the batch
        summed = torch.zeros(len(rows), dtype=torch.float64, device=log_probs.device).index_add_(
            0, row, log_probs.double()
        )
        found[rows] = (summed.cpu() / torch.from_numpy(lengths[rows, 1])).numpy()
    return found


def score_split(ds: datasets.Dataset, output: Path, settings: dict, forward: CheckpointTranslator,
                reverse: CheckpointTranslator | None, max_tokens: int, chunk_pairs: int, precision: str) -> dict:  # fmt: skip
    """Scores every pair of ds (columns src, tgt) into output (data/scores.py's TSV) and its card (settings, pairs);
    chunk by chunk under {output}.parts/, which a run given the same settings resumes. Returns the card."""
    card = {**settings, "pairs": len(ds)}
    if output.is_file() and card_path(output).is_file():
        check_settings(card_path(output), card, "was scored")
        return card
    parts = output.with_name(output.name + ".parts")
    parts.mkdir(parents=True, exist_ok=True)
    check_settings(parts / "card.json", card, "holds chunks scored")
    write_atomically(parts / "card.json", json.dumps(card, indent=2) + "\n")
    for index in range(math.ceil(len(ds) / chunk_pairs)):
        part = parts / f"{index:06d}.tsv"
        if part.exists():
            continue
        start = index * chunk_pairs
        pairs = ds[start : start + chunk_pairs]
        others = ds[other_pairs(len(ds))[start : start + chunk_pairs].tolist()]  # their stand-ins, for the margin
        columns = [mean_log_probs(forward, pairs["src"], pairs["tgt"], max_tokens, precision)]
        margin = margin_score(columns[0], mean_log_probs(forward, others["src"], pairs["tgt"], max_tokens, precision))
        if reverse is not None:
            columns.append(mean_log_probs(reverse, pairs["tgt"], pairs["src"], max_tokens, precision))
            columns.append(dual_score(*columns))
            margin += margin_score(columns[1], mean_log_probs(reverse, others["tgt"], pairs["src"], max_tokens,
                                                              precision))  # fmt: skip
        rows = zip(range(start + 1, start + len(pairs["src"]) + 1), *columns, margin)
        write_atomically(part, "".join("\t".join([str(line)] + [f"{v:.6f}" for v in values]) + "\n"
                                       for line, *values in rows))  # fmt: skip
    header = COLUMNS if reverse is not None else FORWARD_COLUMNS
    partial = output.with_name(output.name + ".partial")
    with partial.open("w") as out:
        out.write("\t".join(header) + "\n")
        for part in sorted(parts.glob("*.tsv")):
            out.write(part.read_text())
    synced(partial).replace(output)
    write_atomically(card_path(output), json.dumps(card, indent=2) + "\n")
    shutil.rmtree(parts)
    return card
