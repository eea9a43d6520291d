"""The parity gate: an exported folder decodes as the checkpoint does, or the export is not deployed."""

from dataclasses import dataclass

from sacrebleu.metrics import BLEU

from ..inference import SearchConfig, Translator
from .engine import ctranslate2_search
from .spec import pieces


@dataclass
class Parity:
    sentences: int
    identical: int  # hypotheses token for token the same
    bleu_ours: float
    bleu_export: float
    signature: str
    first_different: list[int]  # indices of the first sentences that differ

    @property
    def identical_fraction(self) -> float:
        return self.identical / max(self.sentences, 1)

    def failure(self, quantization: str, bleu_tolerance: float) -> str | None:
        """Why this export fails the gate, or None. float32 is the same model: at least 99% of greedy hypotheses
        identical and BLEU within 0.1; a quantized one: BLEU within bleu_tolerance."""
        exact = quantization == "float32"
        limit = 0.1 if exact else bleu_tolerance
        if exact and self.identical_fraction < 0.99:
            return f"{self.identical} of {self.sentences} greedy hypotheses identical, under 99%"
        if abs(self.bleu_export - self.bleu_ours) > limit:
            return f"BLEU {self.bleu_export:.2f} against the checkpoint's {self.bleu_ours:.2f}, over {limit}"
        return None


def greedy_parity(translator: Translator, engine, sources: list[str], references: list[str],
                  tag: str | None = None) -> Parity:  # fmt: skip
    """Both engines decode `sources` greedily with one max-length rule."""
    src, tgt = translator.src_tokenizer, translator.tgt_tokenizer
    ids = src.encode(sources, tag)
    search = SearchConfig(beam_size=1)
    ours = [h[0].tokens if h else [] for h in translator.search(ids, search)]
    theirs = ctranslate2_search(engine, pieces(src), pieces(tgt), ids, search)
    bleu = BLEU()
    scores = [bleu.corpus_score(tgt.decode(h), [references]).score for h in (ours, theirs)]
    different = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    return Parity(len(ids), len(ids) - len(different), *scores, str(bleu.get_signature()), different[:5])
