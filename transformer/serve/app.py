"""The HTTP API: LibreTranslate's /translate and /languages, our /v1/translate, /health, /metrics and the page."""

import json
import math
import re
import time
from collections import defaultdict, deque
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..config.serve import ServeConfig
from ..data.sources import DataError
from ..translators import Decoding, SearchConfig, Translator
from .batcher import Batcher, QueueFull
from .planning import engine_units, plan_texts, rebuild_texts

LANGUAGE_NAMES = {"cs": "Czech", "de": "German", "en": "English", "es": "Spanish", "fr": "French", "it": "Italian",
                  "nl": "Dutch", "pl": "Polish", "pt": "Portuguese", "ru": "Russian", "uk": "Ukrainian", "zh": "Chinese",
                  "ja": "Japanese"}  # fmt: skip
PAGE = (Path(__file__).parent / "page.html").read_text()
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class Refused(Exception):
    """A request the server answers with a 4xx/5xx and one line: {"error": message}."""

    def __init__(self, status: int, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


@dataclass
class ServedModel:
    path: str  # where it was loaded from: the server's own business, never in an answer or a metric
    translator: Translator
    source: str
    target: str
    tag: str | None
    batcher: Batcher | None = None

    @property
    def name(self) -> str:
        """What answers and metric labels call it: its language pair (one model per pair)."""
        return f"{self.source}-{self.target}"


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("requests", "HTTP requests answered", ["endpoint", "status"], registry=self.registry)
        self.sentences = Counter("sentences", "sentences translated", ["model"], registry=self.registry)
        self.batch_sentences = Histogram("batch_sentences", "sentences per engine call", ["model"],
                                         buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=self.registry)  # fmt: skip
        self.queue = Gauge(
            "queue_sentences", "sentences waiting or being translated", ["model"], registry=self.registry
        )
        self.latency = Histogram("request_seconds", "from queueing to results", ["model"], registry=self.registry)


class RateLimit:
    """At most N requests per key (or client address) in any 60 s."""

    def __init__(self, per_minute: int):
        self.per_minute, self.seen = per_minute, defaultdict(deque)

    def check(self, who: str) -> None:
        if not self.per_minute:
            return
        now, seen = time.monotonic(), self.seen[who]
        while seen and seen[0] <= now - 60:
            seen.popleft()
        if len(seen) >= self.per_minute:
            retry = int(seen[0] + 60 - now) + 1
            raise Refused(429, f"Slowdown: {self.per_minute} requests per minute (requests_per_minute)", retry)
        seen.append(now)


class Server:
    """What every route shares: the models by language pair, the settings, the metrics and the rate limit."""

    def __init__(self, models: list[ServedModel], cfg: ServeConfig):
        self.models, self.cfg = models, cfg
        self.pairs = {(m.source, m.target): m for m in models}
        self.metrics, self.limit = Metrics(), RateLimit(cfg.requests_per_minute)

    async def fields(self, request: Request) -> dict:
        """The request's fields, once its key (and the rate limit) let it in."""
        fields = await request_fields(request)
        key, keys = fields.get("api_key"), self.cfg.api_keys
        if keys and not key:
            raise Refused(401, "Missing api_key: this server needs one")
        if keys and key not in keys:
            raise Refused(403, "Invalid API key")
        self.limit.check(key or (request.client.host if request.client else "?"))
        return fields

    def model_for(self, source, target) -> ServedModel:
        if not isinstance(source, str) or not isinstance(target, str):
            raise Refused(400, "Invalid request: source and target must be language codes, e.g. de and en")
        if source == "auto":  # no language detection: the one source served into target, if there is one
            sources = [s for s, t in self.pairs if t == target]
            source = sources[0] if len(sources) == 1 else source
        if (source, target) not in self.pairs:
            served = ", ".join(f"{s}->{t}" for s, t in self.pairs)
            raise Refused(400, f"{source}->{target} is not served; this server translates {served}")
        return self.pairs[(source, target)]

    async def translate(self, model: ServedModel, texts: list[str], html: bool, decoding: Decoding):
        """Each text translated as a whole (planning.py: sentences split and rejoined, HTML's markup kept): per
        text, its hypotheses, best first, as (score, text); and the seconds the engine took."""
        cfg, metrics = self.cfg, self.metrics
        if sum(len(text) for text in texts) > cfg.max_chars:
            raise Refused(413, f"Request too large: more than max_chars={cfg.max_chars} characters")
        plans, sentences = plan_texts(texts, html)
        tokenizer = model.translator.src_tokenizer
        counts = [len(ids) for ids in tokenizer.encode(sentences, decoding.tag)] if sentences else []  # once, here
        units, spans = engine_units(sentences, counts, lambda text: len(tokenizer.encode([text], decoding.tag)[0]),
                                    model.translator.max_source_tokens)  # fmt: skip
        if len(units) > cfg.max_sentences:
            raise Refused(
                413, f"Request too large: {len(units)} sentences, more than max_sentences={cfg.max_sentences}"
            )
        metrics.queue.labels(model.name).set(model.batcher.waiting + len(units))
        try:
            found, seconds = await model.batcher.submit(units, decoding, sum(counts)) if units else ([], 0.0)
        except QueueFull as full:
            raise Refused(503, f"Server busy: {full}; retry shortly", retry_after=1) from None
        finally:
            metrics.queue.labels(model.name).set(model.batcher.waiting)
        metrics.latency.labels(model.name).observe(seconds)
        metrics.sentences.labels(model.name).inc(len(units))
        return rebuild_texts(plans, spans, found, decoding.nbest), seconds

    def languages(self) -> list[dict]:
        """Every language a model reads or writes, with the languages it translates into (a target-only one: none),
        as LibreTranslate lists them."""
        codes = dict.fromkeys(code for pair in self.pairs for code in pair)
        return [{"code": code, "name": LANGUAGE_NAMES.get(code, code), "targets": [t for s, t in self.pairs if s == code]}
                for code in codes]  # fmt: skip

    def ready(self) -> bool:
        return all(
            m.batcher is not None and m.batcher.task is not None and not m.batcher.task.done() for m in self.models
        )


def create_app(models: list[ServedModel], cfg: ServeConfig) -> FastAPI:
    server = Server(models, cfg)
    metrics = server.metrics

    @asynccontextmanager
    async def lifespan(app):
        for model in models:
            model.batcher = batcher_for(model, cfg, metrics)
            model.batcher.start()
        yield
        for model in models:
            await model.batcher.stop()

    app = FastAPI(title="transformer.serve", lifespan=lifespan)

    @app.exception_handler(Refused)
    async def refused(request: Request, error: Refused):
        headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
        metrics.requests.labels(request.url.path, str(error.status)).inc()
        return JSONResponse({"error": str(error)}, status_code=error.status, headers=headers)

    @app.post("/translate")
    async def libretranslate(request: Request):
        fields = await server.fields(request)
        q, texts, form = fields.get("q"), texts_of(fields), fields.get("format", "text")
        if form not in ("text", "html"):
            raise Refused(400, f"Invalid request: format={form!r} is not text or html")
        alternatives = integer(fields.get("alternatives", 0), "alternatives", 0, cfg.max_alternatives)
        model = server.model_for(fields.get("source"), fields.get("target"))
        search = SearchConfig(beam_size=max(cfg.beam_size, alternatives + 1), length_penalty=cfg.length_penalty)
        results, _ = await server.translate(model, texts, form == "html", Decoding(search, alternatives + 1, model.tag))
        metrics.requests.labels("/translate", "200").inc()
        return libretranslate_answer(q, [[text for _, text in hypotheses] for hypotheses in results], alternatives)

    @app.post("/v1/translate")
    async def translate_v1(request: Request):
        fields = await server.fields(request)
        texts, model = texts_of(fields), server.model_for(fields.get("source"), fields.get("target"))
        nbest = integer(fields.get("nbest", 1), "nbest", 1, cfg.max_alternatives + 1)
        search = SearchConfig(beam_size=integer(fields.get("beam_size", cfg.beam_size), "beam_size", nbest, 16),
                              length_penalty=length_penalty(fields.get("length_penalty", cfg.length_penalty)))  # fmt: skip
        tag = checked_tag(model, fields.get("tag", model.tag))
        results, seconds = await server.translate(
            model, texts, fields.get("format") == "html", Decoding(search, nbest, tag)
        )
        metrics.requests.labels("/v1/translate", "200").inc()
        return {"model": model.name, "source": model.source, "target": model.target, "translations": [
            {"text": hypotheses[0][1], "nbest": [{"text": t, "score": s if math.isfinite(s) else None} for s, t in hypotheses],
             "seconds": round(seconds, 6)}
            for hypotheses in results]}  # fmt: skip

    @app.get("/languages")
    async def languages():
        return server.languages()

    @app.get("/health")
    async def health():
        ready = server.ready()
        body = {"status": "ok" if ready else "starting", "models": [f"{m.source}->{m.target}" for m in models]}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return PAGE

    return app


def libretranslate_answer(q, translated: list[list[str]], alternatives: int) -> dict:
    """LibreTranslate's body: one text (q a string) or a list, with the alternatives if asked for."""
    body = {"translatedText": translated[0][0] if isinstance(q, str) else [t[0] for t in translated]}
    if alternatives:
        body["alternatives"] = translated[0][1:] if isinstance(q, str) else [t[1:] for t in translated]
    return body


def length_penalty(value) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 10:
        raise Refused(400, f"Invalid request: length_penalty={value!r} must be a number from 0 to 10")
    return float(value)


def checked_tag(model: ServedModel, tag: str | None) -> str | None:
    if tag is not None:
        try:
            model.translator.src_tokenizer.tag_id(tag)
        except DataError as e:
            raise Refused(400, f"Invalid request: {e}") from None
    return tag


def batcher_for(model: ServedModel, cfg: ServeConfig, metrics: Metrics) -> Batcher:
    translator = model.translator

    def translate(sentences: list[str], decoding: Decoding):
        return translator.translate_nbest(sentences, decoding.search, decoding.nbest, translator.trained_precision,
                                          tag=decoding.tag)  # fmt: skip

    def on_batch(sentences: int, seconds: float) -> None:
        metrics.batch_sentences.labels(model.name).observe(sentences)

    return Batcher(translate, cfg.max_batch_tokens, cfg.max_delay_ms, cfg.max_queue_sentences, on_batch, cfg.workers)


def texts_of(fields: dict) -> list[str]:
    """q, a string or a list of strings, as a list, not all of it blank."""
    q = fields.get("q")
    texts = [q] if isinstance(q, str) else q
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise Refused(400, "Invalid request: q must be a string or a list of strings")
    if not any(t.strip() for t in texts):
        raise Refused(400, "Invalid request: q is empty")
    return texts


def integer(value, name: str, low: int, high: int) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)  # a form's fields are strings
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise Refused(400, f"Invalid request: {name}={value!r} must be an integer from {low} to {high}")
    return value


async def request_fields(request: Request) -> dict:
    """A JSON object or a form (application/x-www-form-urlencoded; q may repeat), as a dict."""
    body = await request.body()
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise Refused(400, "Invalid request: the body is not UTF-8") from None
    kind = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if kind == "application/x-www-form-urlencoded":
        fields = {k: v if k == "q" and len(v) > 1 else v[0] for k, v in parse_qs(text, keep_blank_values=True).items()}
        return fields
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise Refused(400, f"Invalid request: the body is not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(fields, dict):
        raise Refused(400, "Invalid request: the body must be a JSON object")
    # JSON's \ud800 escapes can make halves of a character, which no tokenizer takes: U+FFFD instead
    q = fields.get("q")
    if isinstance(q, str):
        fields["q"] = _LONE_SURROGATE.sub("\ufffd", q)
    elif isinstance(q, list):
        fields["q"] = [_LONE_SURROGATE.sub("\ufffd", t) if isinstance(t, str) else t for t in q]
    return fields
