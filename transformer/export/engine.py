"""An exported folder as a translator: CTranslate2 decodes, with the folder's own sentencepiece models and the
checkpoint's search settings and max-length rule. It answers what Translator answers for translate and evaluate."""

import json
from itertools import groupby
from pathlib import Path

from ..data.tokenizer import SentencePiece


def is_export(path: str | Path) -> bool:
    return (Path(path) / "model.bin").is_file() and (Path(path) / "model_card.json").is_file()


def ctranslate2_search(engine, src: SentencePiece, tgt: SentencePiece, sources: list[list[int]], search) -> list:
    """The best hypothesis's token ids per source (ids without EOS), each decoded with SearchConfig `search` and
    its max-length rule, int(a * (source tokens + EOS) + b): CTranslate2 takes one max_decoding_length a batch, so
    sources are batched by length."""
    found: list[list[int]] = [[] for _ in sources]
    limit = lambda i: int(search.max_len_a * (len(sources[i]) + 1) + search.max_len_b)  # noqa: E731
    for max_length, group in groupby(sorted(range(len(sources)), key=limit), key=limit):
        group = list(group)
        results = engine.translate_batch(
            [[src.sp.id_to_piece(t) for t in sources[i]] for i in group], beam_size=search.beam_size,
            length_penalty=search.length_penalty, max_decoding_length=max_length, max_batch_size=64,
        )  # fmt: skip
        for i, result in zip(group, results):
            found[i] = [tgt.sp.piece_to_id(p) for p in result.hypotheses[0]]
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
        self.data, self.quantization = card["data"], card["quantization"]
        self.trained_precision = "32"  # the folder's own compute type decides; precision= does not apply

    def translate(self, texts: list[str], search, precision: str = "32", target_lengths=None,
                  tag: str | None = None) -> list[str]:  # fmt: skip
        """As Translator.translate: one translation per text, empty texts give empty translations."""
        ids = self.src_tokenizer.encode(texts)
        if tag is not None:
            ids = [[self.src_tokenizer.tag_id(tag)] + s for s in ids]
        outputs = self.tgt_tokenizer.decode(ctranslate2_search(self.engine, self.src_tokenizer, self.tgt_tokenizer,
                                                               ids, search))  # fmt: skip
        return ["" if not text.strip() else out for text, out in zip(texts, outputs)]
