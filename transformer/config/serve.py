"""The server's settings: python -m transformer.serve models=[...] key=value ..."""

from dataclasses import dataclass, field

from omegaconf import MISSING


@dataclass(frozen=True)
class ServeConfig:
    models: list[str] = MISSING  # exported CTranslate2 folders or training checkpoints, one per language pair
    # +tags={PATH: __bt__}: the tag put before that model's sources (default: its main corpus's; null: none)
    tags: dict[str, str | None] = field(default_factory=dict)  # model path: its tag
    host: str = "127.0.0.1"  # 0.0.0.0 to listen on every interface
    port: int = 5000  # LibreTranslate's
    device: str = "cpu"  # cpu, cuda, cuda:1, ...
    threads: int = 0  # an exported model's intra-op threads per engine call (0: CTranslate2's default)
    workers: int = 1  # engine calls in flight at once per model, one batch each (CTranslate2's inter_threads)
    beam_size: int = 4  # /translate's search; /v1/translate takes its own
    length_penalty: float = 1.0  # /translate's: scores are log-probabilities / length**length_penalty
    max_batch_tokens: int = 4096  # source tokens of one engine call, from every waiting request together
    max_delay_ms: float = 0.0  # how long a batch waits for more requests once one has arrived (0: none)
    max_queue_sentences: int = 4096  # per model: beyond, requests get 503 with Retry-After
    max_chars: int = 5000  # per request (all of q), beyond: 413
    max_sentences: int = 200  # per request, after splitting, beyond: 413
    max_alternatives: int = 3  # /translate's alternatives, /v1/translate's nbest - 1
    api_keys: list[str] = field(default_factory=list)  # empty: open; else a request names one (401 none, 403 other)
    requests_per_minute: int = 0  # per API key (or client address without keys); 0: no limit
    shutdown_timeout_s: float = 30.0  # after SIGTERM: how long accepted requests may still take

    def __post_init__(self):
        for name, value, low in (("port", self.port, 1), ("workers", self.workers, 1), ("beam_size", self.beam_size, 1),
                                 ("max_batch_tokens", self.max_batch_tokens, 1), ("max_chars", self.max_chars, 1),
                                 ("max_queue_sentences", self.max_queue_sentences, 1),
                                 ("max_sentences", self.max_sentences, 1), ("max_delay_ms", self.max_delay_ms, 0),
                                 ("max_alternatives", self.max_alternatives, 0),
                                 ("requests_per_minute", self.requests_per_minute, 0)):  # fmt: skip
            if value < low:
                raise ValueError(f"{name}={value} must be at least {low}")
