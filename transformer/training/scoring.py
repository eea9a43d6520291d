"""Validation BLEU and chrF++: greedy translations of the validation sources against their raw references."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..data import SentencePiece
from ..decoding import greedy_search
from ..evaluation.significance import metrics
from ..machine.distributed import every_rank
from ..model import EncoderDecoder
from .config import ValidationConfig


@dataclass(frozen=True)
class Score:
    bleu: float
    chrf: float  # chrF++
    signature: str  # sacreBLEU's BLEU signature, e.g. nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.5.1
    examples: list[tuple[str, str, str]]  # (source, reference, hypothesis) of the first sentences by index


class BleuScorer:
    """Collects greedy translations batch by batch and scores them once per validation (sacreBLEU defaults, on
    detokenized text), gathered across ranks. Given all it needs: the target tokenizer, the validation texts
    by example index (a validation batch's `index`), and the ValidationConfig."""

    def __init__(self, tokenizer: SentencePiece, sources: Sequence[str], references: Sequence[str],
                 cfg: ValidationConfig):  # fmt: skip
        self.tokenizer, self.sources, self.references, self.cfg = tokenizer, sources, references, cfg
        self._hypotheses: dict[int, list[int]] = {}  # target ids without BOS/EOS, by example index

    def add(self, model: EncoderDecoder, src: Tensor, index: Tensor) -> None:
        """Translate the sentences of a padded source batch (B, S) whose index (B,) is below bleu_max_sentences."""
        limit = self.cfg.bleu_max_sentences
        rows = torch.arange(len(index)) if limit is None else torch.nonzero(index < limit)[:, 0]
        if len(rows):
            tok, cfg = self.tokenizer, self.cfg
            hypotheses = greedy_search(model, src[rows], tok.bos_id, tok.eos_id, cfg.max_len_a, cfg.max_len_b,
                                       barred=tok.barred_ids)  # fmt: skip
            self._hypotheses.update(zip(index[rows].tolist(), hypotheses))

    def score(self, world_size: int) -> Score | None:
        """Every rank's translations of this validation, scored; None when there were none (limit_val_batches
        left out every sentence below bleu_max_sentences). Starts the next validation afresh."""
        hypotheses, self._hypotheses = _gather(self._hypotheses, world_size), {}
        if not hypotheses:
            return None
        index = sorted(hypotheses)
        texts = self.tokenizer.decode([hypotheses[i] for i in index])
        references = [self.references[i] for i in index]
        used = metrics()  # evaluate's: BLEU and chrF++
        bleu, chrf = used["bleu"], used["chrf"]
        bleu_score = bleu.corpus_score(texts, [references]).score
        chrf_score = chrf.corpus_score(texts, [references]).score
        shown = range(min(self.cfg.text_examples, len(index)))
        examples = [(self.sources[index[i]], references[i], texts[i]) for i in shown]
        return Score(bleu_score, chrf_score, str(bleu.get_signature()), examples)


def _gather(hypotheses: dict[int, list[int]], world_size: int) -> dict[int, list[int]]:
    if world_size == 1:
        return hypotheses
    return {i: h for part in every_rank(hypotheses) for i, h in part.items()}
