"""The parity gate: an exported folder decodes as the checkpoint does, or the export is not deployed."""

from dataclasses import dataclass, replace

from sacrebleu.metrics import BLEU

from ..translators import CheckpointTranslator, SearchConfig
from ..translators.ctranslate2 import CTranslate2Search


@dataclass
class Parity:
    search: str  # "greedy" or "beam 5, length_penalty 1.0"
    sentences: int
    identical: int  # hypotheses token for token the same
    bleu_ours: float | None  # None: no references
    bleu_export: float | None
    signature: str | None
    first_different: list[int]  # indices of the first sentences that differ

    def failure(self, exact: bool, bleu_tolerance: float) -> str | None:
        """Why this export fails the gate, or None. An exact one (float32, every target piece) is the same model: at
        least 99% of hypotheses identical and BLEU within 0.1; a quantized or shortlisted one: BLEU within
        bleu_tolerance (its hypotheses may differ)."""
        limit = 0.1 if exact else bleu_tolerance
        if exact and 100 * self.identical < 99 * self.sentences:  # in integers: 990 of 1000 is 99%, exactly
            return f"{self.search}: {self.identical} of {self.sentences} hypotheses identical, under 99%"
        # rounded: a gap of exactly the limit (30.1 against 30.0) is within it, whatever the floats' last bits say
        if self.bleu_ours is not None and round(abs(self.bleu_export - self.bleu_ours), 9) > limit:
            return f"{self.search}: BLEU {self.bleu_export:.2f} against the checkpoint's {self.bleu_ours:.2f}, over {limit}"
        return None


def gate_searches(search: SearchConfig) -> list[SearchConfig]:
    """Greedy, then `search`'s beam if it has one; both under CTranslate2's rule of stopping a sentence at
    beam_size finished hypotheses (early_stopping), which is what the export decodes."""
    greedy = replace(search, beam_size=1, early_stopping=True)
    return [greedy] + ([replace(search, early_stopping=True)] if search.beam_size > 1 else [])


def parity(translator: CheckpointTranslator, engine, sources: list[str], references: list[str] | None,
           search: SearchConfig, tag: str | None = None, use_vmap: bool = False) -> Parity:  # fmt: skip
    """Both engines decode `sources` with the same search settings and max-length rule (the export with its
    shortlist if use_vmap)."""
    src, tgt = translator.src_tokenizer, translator.tgt_tokenizer
    ids = src.encode(sources, tag)
    ours = [h[0].tokens if h else [] for h in translator.search(ids, search)]
    theirs = CTranslate2Search.of(engine, src, tgt, translator.model_config.max_positions, use_vmap).best(ids, search)
    name = "greedy" if search.beam_size == 1 else f"beam {search.beam_size}, length_penalty {search.length_penalty}"
    bleu = BLEU()
    scores = [None, None] if references is None else [bleu.corpus_score(tgt.decode(h), [references]).score
                                                       for h in (ours, theirs)]  # fmt: skip
    signature = None if references is None else str(bleu.get_signature())
    different = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    return Parity(name, len(ids), len(ids) - len(different), *scores, signature, different[:5])
