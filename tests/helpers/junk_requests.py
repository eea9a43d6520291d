"""Random, oversized and malformed requests for the server's fuzz tests: (path, body, content type)."""

import json
import random

JUNK = [b"", b"null", b"[]", b'{"q": null}', b'{"q": {}}', b'{"q": "a", "alternatives": "x"}', b"\x00" * 50,
        json.dumps({"q": "\ud800", "source": "de", "target": "en"}).encode(), b'{"q": "' + b"\xff" * 20 + b'"}',
        b'{"q": ["a", 1], "source": "de", "target": "en"}', b'{"q": "a", "nbest": 99, "beam_size": "x"}']  # fmt: skip


def junk_requests(seed: int, n: int, max_chars: int):
    """n requests: a third hand-picked junk, a third random bytes, a third JSON with random fields, of which some
    hold more than max_chars characters."""
    rng = random.Random(seed)
    for i in range(n):
        if i % 3 == 0:
            body = rng.choice(JUNK)
        elif i % 3 == 1:
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        else:
            fields = {"q": "".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(rng.randrange(0, 2 * max_chars))),
                      "source": rng.choice(["de", "en", "auto", "", None, 1]), "target": rng.choice(["en", "de"]),
                      "format": rng.choice(["text", "html", "x"]), "alternatives": rng.choice([0, 1, -1, 4, "2"]),
                      "beam_size": rng.choice([1, 2, 0, 17, None])}  # fmt: skip
            body = json.dumps({k: v for k, v in fields.items() if v is not None or rng.random() < 0.5}).encode()
        kind = rng.choice(["application/json", "application/x-www-form-urlencoded", "text/plain"])
        yield rng.choice(["/translate", "/v1/translate"]), body, kind
