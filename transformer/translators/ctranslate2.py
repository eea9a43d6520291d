"""An exported folder as a translator: CTranslate2 decodes, with the folder's own sentencepiece models and the
checkpoint's search settings and max-length rule. It answers what CheckpointTranslator answers for translate and
evaluate."""

import json
import warnings
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from ..data.tokenizer import SentencePiece
from .interface import check_nbest, decoded_nbest

VMAP_FILE = "vmap.txt"  # a folder's shortlist (transformer/export/shortlist.py), which CTranslate2 loads itself


def is_export(path: str | Path) -> bool:
    return (Path(path) / "model.bin").is_file() and (Path(path) / "model_card.json").is_file()


@dataclass(frozen=True)
class CTranslate2Search:
    """A CTranslate2 engine searched as our searches search, in its own pieces: each hypothesis decoded with
    SearchConfig `search` and its max-length rule, int(a * (source tokens + EOS) + b), never beyond the model's
    max_positions. As in our search, EOS may come first (min_decoding_length=0) and counts in the length that
    normalises scores (return_end_token). CTranslate2 stops a sentence at beam_size finished hypotheses: ours does
    with search.early_stopping. use_vmap: each batch's outputs restricted to its shortlist (the folder's vmap.txt).
    barred: target pieces never generated (pad, BOS: as our searches bar them, CTranslate2 disables them before the
    log-softmax). never_sampled: target pieces sampling never draws besides (our translators': the byte pieces)."""

    engine: object  # a ctranslate2.Translator
    src_pieces: list[str]
    tgt_pieces: list[str]
    eos_piece: str
    max_positions: int | None = None
    use_vmap: bool = False
    barred: tuple[str, ...] = ()
    never_sampled: tuple[str, ...] = ()

    @classmethod
    def of(cls, engine, src: SentencePiece, tgt: SentencePiece, max_positions: int, use_vmap: bool = False):
        """The engine with our tokenizers' pieces and rules."""
        pieces = tgt.pieces()
        return cls(engine, src.pieces(), pieces, pieces[tgt.eos_id], max_positions, use_vmap,
                   tuple(pieces[i] for i in tgt.barred_ids), tuple(pieces[i] for i in tgt.byte_ids))  # fmt: skip

    def best(self, sources: list[list[int]], search) -> list[list[int]]:
        """The best hypothesis's token ids per source (ids without EOS)."""
        return [hyps[0][1] for hyps in self.nbest(sources, search, 1)]

    def nbest(self, sources: list[list[int]], search, nbest: int) -> list[list[tuple[float, list[int]]]]:
        """The nbest best hypotheses per source, (score, token ids without EOS).

        CTranslate2 takes one max_decoding_length a call, so all sources decode in one call to the longest limit.
        Greedy hypotheses are then cut at each sentence's own (a greedy prefix does not depend on the limit). A beam
        search depends on its limit only if it reaches it: the search ends on the step its K-th hypothesis
        finishes, and among the K hypotheses returned, the longest (EOS included) finished on that step. A sentence
        whose longest is shorter than its own limit decoded as it would have under it; the few others decode again,
        one call per limit."""
        limits = [int(search.max_len_a * (len(s) + 1) + search.max_len_b) for s in sources]
        limits = limits if self.max_positions is None else [min(limit, self.max_positions) for limit in limits]
        found: list[list[tuple[float, list[int]]]] = [[] for _ in sources]
        tgt_ids = {piece: i for i, piece in enumerate(self.tgt_pieces)}
        calls = [(max(limits, default=0), list(range(len(sources))))]
        suppressed = [*self.barred, *self.never_sampled] if search.sampling_topk else list(self.barred)
        options = {"suppress_sequences": [[piece] for piece in suppressed] or None}
        if search.sampling_topk:  # CTranslate2's topk 0 is all tokens, 1 greedy search
            warnings.warn("an exported folder samples from generators that seed= does not reach (CTranslate2 issue "
                          "#1757): its samples differ between runs; sample with the training checkpoint to reproduce "
                          "them", stacklevel=2)  # fmt: skip
            options.update(sampling_topk=max(search.sampling_topk, 0), sampling_temperature=search.temperature)
        while calls:
            max_length, group = calls.pop()
            results = self.engine.translate_batch(
                [[self.src_pieces[t] for t in sources[i]] for i in group], beam_size=search.beam_size,
                num_hypotheses=search.beam_size, length_penalty=search.length_penalty, max_decoding_length=max_length,
                min_decoding_length=0, return_end_token=True, return_scores=True, max_batch_size=8192, batch_type="tokens",
                use_vmap=self.use_vmap, **options,
            )  # fmt: skip
            again = []
            for i, result in zip(group, results):
                exact = search.beam_size == 1 or max_length == limits[i]
                if not exact and max(map(len, result.hypotheses)) >= limits[i]:
                    again.append(i)
                    continue
                found[i] = [
                    (score, [tgt_ids[p] for p in (h[:-1] if h and h[-1] == self.eos_piece else h)[: limits[i]]])
                    for score, h in zip(result.scores[:nbest], result.hypotheses[:nbest])
                ]
            calls += [
                (limit, list(g)) for limit, g in groupby(sorted(again, key=limits.__getitem__), key=limits.__getitem__)
            ]
        return found


class CTranslate2Translator:
    """A Translator over a CTranslate2 folder: what translate and evaluate use."""

    def __init__(self, folder: str | Path, device: str = "cpu", threads: int = 0, workers: int = 1,
                 compute_type: str = "default"):  # fmt: skip
        """compute_type: CTranslate2's (default: the folder's quantization, as the device supports it)."""
        import ctranslate2

        folder = Path(folder)
        card = json.loads((folder / "model_card.json").read_text())
        self.engine = ctranslate2.Translator(str(folder), device=device, intra_threads=threads,
                                            inter_threads=workers, compute_type=compute_type)  # fmt: skip
        self.src_tokenizer = SentencePiece(folder / "source.spm.model")
        self.tgt_tokenizer = SentencePiece(folder / "target.spm.model")
        self.data, self.quantization = card["data"], card["quantization"]
        self.trained_precision = "32"  # the folder's own compute type decides; precision= does not apply
        max_positions = card["model"]["max_positions"]
        self.max_source_tokens = max_positions - 1  # one position for EOS
        # a folder exported with shortlist=true decodes with its shortlist
        self.searcher = CTranslate2Search.of(self.engine, self.src_tokenizer, self.tgt_tokenizer, max_positions,
                                           use_vmap=(folder / VMAP_FILE).is_file())  # fmt: skip

    def translate(self, texts: list[str], search, precision: str = "32", target_lengths=None,
                  tag: str | None = None) -> list[str]:  # fmt: skip
        """As Translator.translate: one translation per text, empty texts give empty translations."""
        return [h[0][1] for h in self.translate_nbest(texts, search, 1, precision, target_lengths, tag)]

    def translate_nbest(self, texts: list[str], search, nbest: int, precision: str = "32", target_lengths=None,
                        tag: str | None = None) -> list[list[tuple[float, str]]]:  # fmt: skip
        """As Translator.translate_nbest."""
        check_nbest(nbest, search)
        ids = self.src_tokenizer.encode(texts, tag)
        found = self.searcher.nbest(ids, search, nbest)
        return decoded_nbest(self.tgt_tokenizer, texts, found)
