"""sentencepiece models: trained on the training split, special ids fixed at training and read back."""

import functools
import hashlib
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm

from .sources import DataError

SPECIAL_IDS = dict(pad_id=0, unk_id=1, bos_id=2, eos_id=3)


class SentencePiece:
    """One sentencepiece model. Special ids and vocabulary size come from the model file."""

    def __init__(self, path: str | Path | None = None, model: bytes | None = None):
        """From a model file, or from the file's bytes (as a checkpoint holds them)."""
        self.path = Path(path) if path is not None else None
        self.sp = (
            spm.SentencePieceProcessor(model_file=str(path))
            if model is None
            else spm.SentencePieceProcessor(model_proto=model)
        )
        self.vocab_size = self.sp.get_piece_size()
        self.pad_id, self.unk_id = self.sp.pad_id(), self.sp.unk_id()
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()

    @property
    def barred_ids(self) -> tuple[int, ...]:
        """The ids no translation holds, which searches never generate: pad, and BOS (one id in a Marian model's
        tokenizer, whose decoder starts from <pad>)."""
        return tuple(dict.fromkeys(i for i in (self.pad_id, self.bos_id) if i >= 0))

    @functools.cached_property
    def byte_ids(self) -> tuple[int, ...]:
        """The byte-fallback pieces (<0x00>..<0xFF>): alone or out of order, a byte decodes to U+FFFD."""
        return tuple(i for i in range(self.vocab_size) if self.sp.is_byte(i))

    def _trainer_spec(self):
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self.sp.serialized_model_proto())
        return proto.trainer_spec

    @functools.cached_property
    def tags(self) -> list[str]:
        """The reserved pieces (sentencepiece's user-defined symbols) that mark a corpus, e.g. <bt>, or a Marian
        model's target language, e.g. >>fra<<."""
        return list(self._trainer_spec().user_defined_symbols)

    def tag_id(self, tag: str) -> int:
        if tag not in self.tags:
            reserved = ", ".join(self.tags) or "none"
            raise DataError(
                f"tag={tag!r} is not a reserved piece of this tokenizer (reserved: {reserved}); use one of those, "
                "or train with that tag on a corpus (data.corpora.<name>.tag)"
            )
        return self.sp.piece_to_id(tag)

    def encode(self, texts: list[str], tag: str | None = None) -> list[list[int]]:
        """Token ids per text, without special tokens; a corpus tag's id first when given (as in training). A text
        that starts with a reserved piece (`<bt> ...`, Marian's `>>fra<< ...`) is encoded as that tag given apart,
        so that the tag is one id, not preceded by a word boundary's."""
        ids = self._with_leading_tags(texts, self.sp.encode, _first)
        if tag is None:
            return ids
        first = [self.tag_id(tag)]
        return [first + s for s in ids]

    @property
    def model_type(self) -> str:
        """unigram or bpe (or char, word), as trained."""
        spec = self._trainer_spec()
        return spec.ModelType.Name(spec.model_type).lower()

    @property
    def piece_scores(self) -> np.ndarray:
        """(vocab_size,) each piece's log-probability in a unigram model (0 for byte and special pieces)."""
        return np.array([self.sp.get_score(i) for i in range(self.vocab_size)], np.float32)

    def _with_leading_tags(self, texts: list[str], encode, put_first):
        """encode(texts), but a text that starts with a reserved piece is put_first(its id, encode(the rest))."""
        found = encode(texts)
        tagged = [i for i, text in enumerate(texts) if text.startswith(self.leading)] if self.leading else []
        if tagged:
            tags = [next(t for t in self.leading if texts[i].startswith(t)) for i in tagged]
            rests = encode([texts[i][len(t) :] for i, t in zip(tagged, tags)])  # one call, as for the others
            for i, t, rest in zip(tagged, tags, rests):
                found[i] = put_first(self.sp.piece_to_id(t), rest)
        return found

    @functools.cached_property
    def leading(self) -> tuple[str, ...]:
        """The reserved pieces, longest first (of two that start a text alike, the longer is the text's)."""
        return tuple(sorted(self.tags, key=len, reverse=True))

    def nbest(self, text: str, n: int) -> list[np.ndarray]:
        """A unigram model's n best segmentations of a text, best first (fewer where the text has fewer); a leading
        tag as encode takes it."""
        return self._with_leading_tags(
            [text], lambda ts: [self.sp.nbest_encode(t, nbest_size=n, out_type="numpy") for t in ts],
            lambda first, hyps: [np.insert(h, 0, first) for h in hyps],
        )[0]  # fmt: skip

    def sample(self, texts: list[str], alpha: float, nbest_size: int) -> list[list[int]]:
        """One segmentation per text drawn by sentencepiece itself (BPE-dropout, or unigram sampling over the whole
        lattice; a leading tag as encode takes it): its generator takes no seed, so the draw differs in every
        process."""
        return self._with_leading_tags(
            texts, lambda ts: self.sp.encode(ts, enable_sampling=True, alpha=alpha, nbest_size=nbest_size), _first
        )

    def pieces(self) -> list[str]:
        """The piece of each id: what CTranslate2 reads and writes."""
        return [self.sp.id_to_piece(i) for i in range(self.vocab_size)]

    def decode(self, ids: list[list[int]]) -> list[str]:
        return [self.sp.decode(x) for x in ids]  # one by one: sentencepiece reads a batch of empty lists as one


def _first(first: int, ids: list[int]) -> list[int]:
    return [first, *ids]


def vocabulary_fingerprint(model: bytes) -> str:
    """A hash of what decides tokenization (pieces, scores, normalization), not of training details such as
    the temporary path recorded in the file: a tokenizer retrained on the same data has the same fingerprint."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    proto.ClearField("trainer_spec")
    return hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()


def train_sentencepiece(sentences: Iterable[str], prefix: Path, vocab_size: int, model_type: str,
                        tags: Sequence[str] = (), max_sentences: int = 5_000_000) -> SentencePiece:  # fmt: skip
    """Train a model on `sentences` (sentencepiece samples max_sentences of them), written to prefix.model; byte
    fallback keeps every character encodable; tags become reserved pieces, never split."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = prefix.with_name(f"{prefix.name}.tmp-{os.getpid()}")  # its own: processes may train one at once

    def non_empty() -> Iterator[str]:
        return (s for s in sentences if s.strip())

    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=non_empty(), model_prefix=str(tmp), vocab_size=vocab_size, model_type=model_type,
            byte_fallback=True, character_coverage=1.0, input_sentence_size=max_sentences, shuffle_input_sentence=True,
            num_threads=2, minloglevel=2, **SPECIAL_IDS, **({"user_defined_symbols": list(tags)} if tags else {}),
        )  # fmt: skip
    except RuntimeError as e:
        too_big = re.search(r"Please set it to a value <= (\d+)", str(e))
        if too_big:
            raise DataError(
                f"data.vocab_size={vocab_size} is larger than this corpus allows (at most {too_big.group(1)}); "
                "lower data.vocab_size"
            ) from None
        too_small = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
        if too_small:
            raise DataError(
                f"data.vocab_size={vocab_size} is too small: the 256 byte pieces and this corpus's characters need "
                f"at least {too_small.group(1)}; raise data.vocab_size"
            ) from None
        raise
    for ext in (".model", ".vocab"):
        Path(str(tmp) + ext).replace(str(prefix) + ext)  # renamed into place: never a half-written model
    return SentencePiece(str(prefix) + ".model")
