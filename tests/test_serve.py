"""The server in process (FastAPI's test client) over the trained checkpoint: LibreTranslate's API and ours, what
a request's text becomes, batching across requests, and every bad input answered in one line."""

import asyncio
import threading

import pytest
from fastapi.testclient import TestClient

from transformer.config.serve import ServeConfig
from transformer.data.sources import DataError
from transformer.serve.__main__ import load_models
from transformer.serve.app import create_app
from transformer.serve.batcher import Batcher, QueueFull
from transformer.serve.text import join_sentences, split_sentences
from transformer.translators import Decoding, SearchConfig

from .helpers.junk_requests import junk_requests

BEAM = SearchConfig(beam_size=4)


@pytest.fixture(scope="module")
def served(trained):
    """(models, the trained model's test sources): one model, de->en, loaded once for the module."""
    tmp, _, ckpt = trained
    return load_models(ServeConfig(models=[str(ckpt)])), (tmp / "c" / "test.de").read_text().splitlines()


def client(served, **changes) -> TestClient:
    models, _ = served
    return TestClient(create_app(models, ServeConfig(models=[m.path for m in models], **changes)))


def reference(served, texts: list[str], search=BEAM) -> list[str]:
    translator = served[0][0].translator
    return translator.translate(texts, search, translator.trained_precision)


def test_libretranslate_translate_and_languages(served):
    sources = served[1][:3]
    with client(served) as api:
        one = api.post("/translate", json={"q": sources[0], "source": "de", "target": "en"})
        many = api.post("/translate", json={"q": sources, "source": "de", "target": "en", "format": "text"})
        form = api.post("/translate", data={"q": sources[:2], "source": "de", "target": "en"})
        languages = api.get("/languages").json()
    assert one.status_code == many.status_code == form.status_code == 200
    assert one.json() == {"translatedText": reference(served, sources[:1])[0]}
    assert many.json() == {"translatedText": reference(served, sources)}
    assert form.json() == {"translatedText": reference(served, sources[:2])}
    assert languages == [{"code": "de", "name": "German", "targets": ["en"]},  # a target-only language too
                         {"code": "en", "name": "English", "targets": []}]  # fmt: skip


def test_alternatives_are_the_beams_next_best(served):
    source = served[1][0]
    with client(served) as api:
        body = api.post("/translate", json={"q": source, "source": "de", "target": "en", "alternatives": 2}).json()
    translator = served[0][0].translator
    nbest = translator.translate_nbest([source], BEAM, 3, translator.trained_precision)[0]
    assert body == {"translatedText": nbest[0][1], "alternatives": [nbest[1][1], nbest[2][1]]}


def test_sentences_are_split_translated_and_rejoined_with_their_whitespace(served):
    a, b, c = served[1][:3]
    text = f"  {a}  {b}\n\n{c}\n"
    if not b[:1].isupper():  # the split needs a capital after the full stop
        b = b.capitalize()
        text = f"  {a}  {b}\n\n{c}\n"
    with client(served) as api:
        body = api.post("/translate", json={"q": text, "source": "de", "target": "en"}).json()
    ta, tb, tc = reference(served, [a, b, c])
    assert a.endswith(".") and body["translatedText"] == f"  {ta}  {tb}\n\n{tc}\n"


def test_html_text_nodes_are_translated_and_the_markup_kept(served):
    a, b = served[1][:2]
    page = f'<div class="x" data-n="1"><p>{a}</p><!-- note --><p><b>{b}</b> &amp;</p><br/></div>'
    with client(served) as api:
        body = api.post("/translate", json={"q": page, "source": "de", "target": "en", "format": "html"}).json()
    ta, tb, amp = reference(served, [a, b, "&"])
    assert (
        body["translatedText"]
        == f'<div class="x" data-n="1"><p>{ta}</p><!-- note --><p><b>{tb}</b> {amp.replace("&", "&amp;")}</p><br/></div>'
    )


def test_a_sentence_longer_than_the_models_positions_is_translated_in_pieces(served, monkeypatch):
    translator = served[0][0].translator
    monkeypatch.setattr(translator, "max_source_tokens", 6)
    words = " ".join(served[1][:4]).replace(".", "").split()
    with client(served) as api:
        body = api.post("/v1/translate", json={"q": " ".join(words), "source": "de", "target": "en"}).json()
    count = [len(ids) for ids in translator.src_tokenizer.encode([" ".join(words)])][0]
    assert count > 6 and len(body["translations"][0]["text"].split()) > 3  # not cut at the first piece


def test_v1_gives_nbest_with_scores_and_timing(served):
    source = served[1][1]
    with client(served) as api:
        body = api.post("/v1/translate", json={"q": [source], "source": "de", "target": "en", "nbest": 3,
                                               "beam_size": 5, "length_penalty": 0.6}).json()  # fmt: skip
    translator = served[0][0].translator
    want = translator.translate_nbest([source], SearchConfig(beam_size=5, length_penalty=0.6), 3, "32")[0]
    (got,) = body["translations"]
    assert [h["text"] for h in got["nbest"]] == [text for _, text in want] and got["seconds"] >= 0
    assert [h["score"] for h in got["nbest"]] == pytest.approx([score for score, _ in want])
    assert got["text"] == want[0][1] and (body["model"], body["source"], body["target"]) == ("de-en", "de", "en")
    with client(served) as api:  # greedy search scores nothing: null, not NaN (which is not JSON)
        greedy = api.post("/v1/translate", json={"q": source, "source": "de", "target": "en", "beam_size": 1}).json()
    assert greedy["translations"][0]["nbest"] == [{"text": translator.translate([source], SearchConfig(beam_size=1))[0],
                                                   "score": None}]  # fmt: skip


@pytest.mark.parametrize(
    "request_kwargs, status, message",
    [
        (dict(content=b"{not json", headers={"content-type": "application/json"}), 400, "the body is not JSON"),
        (dict(content=b'{"q": "\xff\xfe", "source": "de"}', headers={"content-type": "application/json"}), 400,
         "the body is not UTF-8"),
        (dict(json=["q"]), 400, "the body must be a JSON object"),
        (dict(json={"q": 5, "source": "de", "target": "en"}), 400, "q must be a string or a list of strings"),
        (dict(json={"q": ["a", 2], "source": "de", "target": "en"}), 400, "q must be a string or a list of strings"),
        (dict(json={"q": "   ", "source": "de", "target": "en"}), 400, "q is empty"),
        (dict(json={"q": "Hallo", "source": "fr", "target": "en"}), 400, "fr->en is not served; this server translates de->en"),
        (dict(json={"q": "Hallo", "source": ["de"], "target": "en"}), 400, "source and target must be language codes"),
        (dict(json={"q": "Hallo", "source": "de", "target": "en", "alternatives": 9}), 400, "alternatives=9 must be an integer from 0 to 3"),
        (dict(json={"q": "Hallo", "source": "de", "target": "en", "format": "pdf"}), 400, "format='pdf' is not text or html"),
        (dict(json={"q": "x" * 5001, "source": "de", "target": "en"}), 413, "more than max_chars=5000"),
        (dict(json={"q": ". ".join(["Ein Satz"] * 201), "source": "de", "target": "en"}), 413, "more than max_sentences=200"),
    ],
)  # fmt: skip
def test_bad_requests_get_a_4xx_and_one_line(served, request_kwargs, status, message):
    with client(served) as api:
        response = api.post("/translate", **request_kwargs)
        good = api.post("/translate", json={"q": served[1][0], "source": "de", "target": "en"})
    assert response.status_code == status and message in response.json()["error"], response.text
    assert "\n" not in response.json()["error"] and good.status_code == 200


def test_api_keys_and_the_rate_limit(served):
    with client(served, api_keys=["k1"], requests_per_minute=2) as api:
        ask = lambda **key: api.post("/translate", json={"q": "Hallo", "source": "de", "target": "en", **key})  # noqa: E731
        assert ask().status_code == 401 and ask(api_key="k2").status_code == 403
        assert ask(api_key="k1").status_code == ask(api_key="k1").status_code == 200
        third = ask(api_key="k1")
    assert third.status_code == 429 and 1 <= int(third.headers["Retry-After"]) <= 61
    assert "requests_per_minute" in third.json()["error"]


def test_a_full_queue_answers_503_with_retry_after(served):
    a, b = served[1][:2]
    with client(served, max_queue_sentences=1) as api:
        response = api.post("/translate", json={"q": [a, b], "source": "de", "target": "en"})
        one = api.post("/translate", json={"q": a, "source": "de", "target": "en"})
    assert response.status_code == 503 and response.headers["Retry-After"] == "1" and one.status_code == 200


def test_health_metrics_and_the_page(served):
    with client(served) as api:
        api.post("/translate", json={"q": served[1][:3], "source": "de", "target": "en"})
        health, metrics, page = api.get("/health"), api.get("/metrics").text, api.get("/")
    assert health.status_code == 200 and health.json() == {"status": "ok", "models": ["de->en"]}
    assert 'sentences_total{model="de-en"} 3.0' in metrics and "batch_sentences_bucket" in metrics  # its pair
    assert served[0][0].path not in metrics  # never its path on the server's disk
    assert 'requests_total{endpoint="/translate",status="200"} 1.0' in metrics
    assert page.status_code == 200 and '<button id="translate">' in page.text


def test_random_and_malformed_requests_never_take_the_server_down(served):
    with client(served, max_chars=300) as api:
        for path, body, kind in junk_requests(0, 400, 300):
            response = api.post(path, content=body, headers={"content-type": kind})
            assert response.status_code < 500 and "error" in response.json() or response.status_code == 200, body
        good = api.post("/translate", json={"q": served[1][0], "source": "de", "target": "en"})
    assert good.json() == {"translatedText": reference(served, served[1][:1])[0]}


def test_the_batcher_makes_one_engine_call_for_requests_waiting_together():
    calls = []

    def translate(sentences, decoding):
        calls.append(list(sentences))
        if any("BAD" in s for s in sentences):
            raise RuntimeError("cannot translate BAD")
        return [[(0.0, s.upper())] for s in sentences]

    async def scenario():
        batcher = Batcher(translate, 10_000, 50.0, 100, lambda n, t: None)
        batcher.start()
        greedy = Decoding(SearchConfig(beam_size=1))
        requests = [["a", "b"], ["c"], ["BAD"], ["d", "e", "f"]]
        results = await asyncio.gather(*(batcher.submit(r, greedy, len(r)) for r in requests), return_exceptions=True)
        with pytest.raises(QueueFull, match="max_queue_sentences=100"):
            await batcher.submit(["x"] * 101, greedy, 101)
        await batcher.stop()
        return results

    results = asyncio.run(scenario())
    assert calls[0] == ["a", "b", "c", "BAD", "d", "e", "f"]  # one call for all four requests
    assert [r[0] for r in (results[0], results[1], results[3])] == [[[(0.0, "A")], [(0.0, "B")]], [[(0.0, "C")]],
                                                                    [[(0.0, "D")], [(0.0, "E")], [(0.0, "F")]]]  # fmt: skip
    assert isinstance(results[2], RuntimeError)  # only the request with the bad sentence failed


def test_requests_arriving_while_the_engine_is_busy_share_its_next_call():
    """No wait for company (max_delay_ms=0): a lone request goes to the engine at once, and requests that arrive
    while every engine thread is busy make up the next call. With workers=2 that call starts beside the first."""
    greedy = Decoding(SearchConfig(beam_size=1))

    async def scenario(workers: int) -> tuple[list[list[str]], int]:
        calls, started, release = [], threading.Event(), threading.Event()

        def translate(sentences, decoding):
            calls.append(list(sentences))
            started.set()
            release.wait(10)
            return [[(0.0, s.upper())] for s in sentences]

        batcher = Batcher(translate, 10_000, 0.0, 100, lambda n, t: None, workers)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit(["a"], greedy, 1))
        assert await asyncio.to_thread(started.wait, 10)  # the engine holds "a"
        rest = [asyncio.ensure_future(batcher.submit([s], greedy, 1)) for s in "bc"]
        await asyncio.sleep(0.2)
        in_flight = len(calls)
        release.set()
        results = await asyncio.gather(first, *rest)
        await batcher.stop()
        assert [r[0] for r in results] == [[[(0.0, "A")]], [[(0.0, "B")]], [[(0.0, "C")]]]
        return calls, in_flight

    assert asyncio.run(scenario(1)) == ([["a"], ["b", "c"]], 1)
    assert asyncio.run(scenario(2)) == ([["a"], ["b", "c"]], 2)


@pytest.mark.parametrize("max_delay_ms, calls", [(0.0, [["a"], ["b"]]), (60_000.0, [["a", "b"]])])
def test_max_delay_ms_holds_a_batch_open_for_later_requests(max_delay_ms, calls):
    """A request that arrives 50 ms after another joins its batch only if the batch waits for company; it waits
    until max_batch_tokens (2 here) are queued, however long max_delay_ms."""
    seen = []

    def translate(sentences, decoding):
        seen.append(list(sentences))
        return [[(0.0, s)] for s in sentences]

    async def scenario():
        batcher = Batcher(translate, 2, max_delay_ms, 100, lambda n, t: None)
        batcher.start()
        greedy = Decoding(SearchConfig(beam_size=1))
        first = asyncio.ensure_future(batcher.submit(["a"], greedy, 1))
        await asyncio.sleep(0.05)
        await asyncio.gather(first, batcher.submit(["b"], greedy, 1))
        await batcher.stop()

    asyncio.run(scenario())
    assert seen == calls


@pytest.mark.parametrize(
    "text, sentences",
    [
        ("Es gibt z. B. Hunde. Und Katzen!", ["Es gibt z. B. Hunde.", "Und Katzen!"]),
        ("Dr. Müller kommt. Er geht.", ["Dr. Müller kommt.", "Er geht."]),
        ("  Nr. 5 ist da.\n\nEr sagte: „Komm.“ Dann ging er.  ", ["Nr. 5 ist da.", "Er sagte: „Komm.“", "Dann ging er."]),
        ("Ein Hund läuft. zwei Katzen... Drei? Ja", ["Ein Hund läuft. zwei Katzen...", "Drei?", "Ja"]),
        ("Am 3. Mai kam er. Gut.", ["Am 3. Mai kam er.", "Gut."]),
        ("I said no. He left, etc. It was 2023. Done.", ["I said no.", "He left, etc.", "It was 2023.", "Done."]),
    ],
)  # fmt: skip
def test_sentences_split_at_ends_not_after_abbreviations_and_rejoin_exactly(text, sentences):
    found, separators = split_sentences(text)
    assert found == sentences and join_sentences(found, separators) == text


def test_a_models_tag_comes_from_its_corpus_unless_tags_says_otherwise(served, monkeypatch):
    translator = served[0][0].translator
    path = served[0][0].path
    monkeypatch.setattr("transformer.serve.__main__.open_translator", lambda *args, **kwargs: translator)
    monkeypatch.setattr(translator, "data", {**translator.data, "tag": "__bt__"})
    with pytest.raises(DataError, match=r"^tag='__bt__' is not a reserved piece of this tokenizer"):
        load_models(ServeConfig(models=[path]))  # the corpus's tag, which this tokenizer lacks
    (model,) = load_models(ServeConfig(models=[path], tags={path: None}))
    assert model.tag is None
    monkeypatch.setattr(translator.src_tokenizer, "tag_id", lambda tag: 7)  # as if it had every tag
    assert [m.tag for m in load_models(ServeConfig(models=[path]))] == ["__bt__"]
    assert [m.tag for m in load_models(ServeConfig(models=[path], tags={path: "__x__"}))] == ["__x__"]
    with pytest.raises(ValueError, match=r"^tags: other.ckpt is not in models"):
        load_models(ServeConfig(models=[path], tags={"other.ckpt": "__bt__"}))
