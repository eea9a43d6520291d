"""An exported folder as a translator: CTranslate2 decodes, with the folder's own sentencepiece models and the
checkpoint's search settings and max-length rule. It answers what Translator answers for translate and evaluate."""

import json
from itertools import groupby
from pathlib import Path

from ..data.tokenizer import SentencePiece
from .spec import pieces


def is_export(path: str | Path) -> bool:
    return (Path(path) / "model.bin").is_file() and (Path(path) / "model_card.json").is_file()


def ctranslate2_search(engine, src_pieces: list[str], tgt_pieces: list[str], sources: list[list[int]], search) -> list:
    """The best hypothesis's token ids per source (ids without EOS), each decoded with SearchConfig `search` and
    its max-length rule, int(a * (source tokens + EOS) + b). CTranslate2 takes one max_decoding_length a call:
    greedy decodes all at once to the longest limit and cuts each hypothesis at its own (a greedy prefix does not
    depend on the limit); beam search, whose finished hypotheses do, is called once per limit."""
    limits = [int(search.max_len_a * (len(s) + 1) + search.max_len_b) for s in sources]
    found: list[list[int]] = [[] for _ in sources]
    tgt_ids = {piece: i for i, piece in enumerate(tgt_pieces)}
    if search.beam_size == 1:
        calls = [(max(limits, default=0), list(range(len(sources))))]
    else:
        order = sorted(range(len(sources)), key=limits.__getitem__)
        calls = [(limit, list(group)) for limit, group in groupby(order, key=limits.__getitem__)]
    for max_length, group in calls:
        results = engine.translate_batch(
            [[src_pieces[t] for t in sources[i]] for i in group], beam_size=search.beam_size,
            length_penalty=search.length_penalty, max_decoding_length=max_length, max_batch_size=8192,
            batch_type="tokens",
        )  # fmt: skip
        for i, result in zip(group, results):
            found[i] = [tgt_ids[p] for p in result.hypotheses[0][: limits[i]]]
    return found


class ExportedTranslator:
    """The parts of Translator that translate and evaluate use, over a CTranslate2 folder."""

    def __init__(self, folder: str | Path, device: str = "cpu", threads: int = 0):
        import ctranslate2

        folder = Path(folder)
        card = json.loads((folder / "model_card.json").read_text())
        self.engine = ctranslate2.Translator(str(folder), device=device, intra_threads=threads)
        self.src_tokenizer = SentencePiece(folder / "source.spm.model")
        self.tgt_tokenizer = SentencePiece(folder / "target.spm.model")
        self.pieces = pieces(self.src_tokenizer), pieces(self.tgt_tokenizer)
        self.data, self.quantization = card["data"], card["quantization"]
        self.trained_precision = "32"  # the folder's own compute type decides; precision= does not apply

    def translate(self, texts: list[str], search, precision: str = "32", target_lengths=None,
                  tag: str | None = None) -> list[str]:  # fmt: skip
        """As Translator.translate: one translation per text, empty texts give empty translations."""
        ids = self.src_tokenizer.encode(texts, tag)
        outputs = self.tgt_tokenizer.decode(ctranslate2_search(self.engine, *self.pieces, ids, search))
        return ["" if not text.strip() else out for text, out in zip(texts, outputs)]
