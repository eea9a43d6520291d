"""What a request's text becomes for the engine, and back: sentences split and rejoined with their whitespace kept,
sentences too long for the model cut at words, and HTML whose text nodes are translated with the markup kept."""

import html
import re
from collections.abc import Callable
from html.parser import HTMLParser

# a sentence ends at . ! ? … (closing quotes or brackets may follow) before whitespace and a capital; a line break
# always ends one
_CLOSERS = "\"'”’“‘»«)]"  # English, German („…“) and French/Swiss (« » or » «) quotes close a sentence too
_BOUNDARY = re.compile(rf"(?<=[.!?…])[{re.escape(_CLOSERS)}]*\s+|\s*\n\s*")
# ... but not after an initial, a day's ordinal ("am 3. Mai") or a common abbreviation, which a capital often
# follows in German ("z. B. Hunde", "Dr. Müller"); "Plan B. Er ..." stays one sentence, translated as one
_ABBREVIATION = re.compile(
    r"(?:[^\W\d_]|\d{1,2}|Dr|Prof|Nr|St|Hr|Fr|Mr|Mrs|Ms|Str|Jh|bzw|ca|vgl|evtl|ggf|inkl|e\.g|i\.e|vs)\."
)


def split_sentences(text: str) -> tuple[list[str], list[str]]:
    """(sentences, separators): text == separators[0] + sentences[0] + separators[1] + ... + separators[-1], every
    sentence non-empty without outer whitespace, and len(separators) == len(sentences) + 1."""
    start = len(text) - len(text.lstrip())  # the first sentence's
    sentences, separators = [], [text[:start]]
    body_end = len(text.rstrip())
    for match in _BOUNDARY.finditer(text, start, body_end):
        end = match.start() + len(match.group(0)) - len(match.group(0).lstrip(_CLOSERS))
        if "\n" not in match.group(0):
            if not text[match.end() : match.end() + 8].lstrip("\"'„“‘«([¿¡")[:1].isupper():
                continue  # "Nr. 5", "z. B. hier": a sentence starts with a capital
            # the word the full stop ends (8 characters hold the longest abbreviation and what precedes it)
            if _ABBREVIATION.fullmatch(re.split(r"[\s(]", text[max(start, match.start() - 8) : match.start()])[-1]):
                continue
        if end > start:
            sentences.append(text[start:end])
            separators.append(text[end : match.end()])
            start = match.end()
    if start < body_end:
        sentences.append(text[start:body_end])
        separators.append(text[body_end:])
    elif sentences:
        separators[-1] += text[body_end:]
    else:
        separators = [text]
    return sentences, separators


def join_sentences(translations: list[str], separators: list[str]) -> str:
    return separators[0] + "".join(t + s for t, s in zip(translations, separators[1:]))


def word_pieces(sentence: str, count_tokens: Callable[[str], int], max_tokens: int) -> list[str]:
    """The sentence cut between words into pieces of at most max_tokens tokens each (a single word longer than that
    is a piece of its own, which the engine then cuts): a model translates no more than its positions hold."""
    if count_tokens(sentence) <= max_tokens:
        return [sentence]
    pieces, current = [], []
    for word in sentence.split():
        if current and count_tokens(" ".join([*current, word])) > max_tokens:
            pieces.append(" ".join(current))
            current = []
        current.append(word)
    return pieces + ([" ".join(current)] if current else [])


class _Markup(HTMLParser):
    """HTML as a list of parts, each (is_text, source): tags, comments and declarations as written, text decoded."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[tuple[bool, str]] = []
        self.raw_text_depth = 0  # inside <script> or <style>: not prose

    def handle_starttag(self, tag, attrs):
        self.parts.append((False, self.get_starttag_text()))
        self.raw_text_depth += tag in ("script", "style")

    def handle_startendtag(self, tag, attrs):
        self.parts.append((False, self.get_starttag_text()))

    def handle_endtag(self, tag):
        self.parts.append((False, f"</{tag}>"))
        self.raw_text_depth -= tag in ("script", "style") and self.raw_text_depth > 0

    def handle_data(self, data):
        self.parts.append((self.raw_text_depth == 0, data))

    def handle_comment(self, data):
        self.parts.append((False, f"<!--{data}-->"))

    def handle_decl(self, decl):
        self.parts.append((False, f"<!{decl}>"))

    def handle_pi(self, data):
        self.parts.append((False, f"<?{data}>"))

    def unknown_decl(self, data):
        self.parts.append((False, f"<![{data}]>"))


def html_text_nodes(document: str) -> tuple[list[str], Callable[[list[str]], str]]:
    """(the text nodes to translate, a function from their translations to the document with the markup as it was):
    tags and their attributes, comments and scripts untouched; translated text escaped again (&amp;, &lt;)."""
    parser = _Markup()
    parser.feed(document)
    parser.close()
    texts = [source for is_text, source in parser.parts if is_text and source.strip()]

    def rebuild(translations: list[str]) -> str:
        done = iter(translations)
        out = []
        for is_text, source in parser.parts:
            if is_text and source.strip():
                out.append(html.escape(next(done), quote=False))
            else:
                out.append(html.escape(source, quote=False) if is_text else source)
        return "".join(out)

    return texts, rebuild
