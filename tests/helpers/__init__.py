"""What several test modules share: small corpora made on the spot, and the real config composed for a run."""

from .corpora import MULTI30K, ROOT, WORDS_DE, WORDS_EN, config, write_text_corpus, write_word_for_word_corpus
from .runs import (
    RECORD,
    LossFile,
    LossRecorder,
    SignalAt,
    callback,
    compose_command,
    compose_train,
    run_command,
    run_train,
    tiny_data,
)

__all__ = [
    "MULTI30K", "RECORD", "ROOT", "WORDS_DE", "WORDS_EN", "LossFile", "LossRecorder", "SignalAt", "callback", "compose_command", "compose_train",
    "config", "run_command", "run_train", "tiny_data", "write_text_corpus", "write_word_for_word_corpus",
]  # fmt: skip
