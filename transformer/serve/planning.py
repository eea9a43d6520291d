"""A request's texts as the engine's sentences, and its results back as texts: pure functions, no server state.

A text (its HTML text nodes, or itself) is split into sentences (text.py); a sentence longer than the model reads
is cut at words into several units; the engine translates units; each text is rebuilt from its units' hypotheses."""

from collections.abc import Callable
from dataclasses import dataclass

from .text import html_text_nodes, join_sentences, split_sentences, word_pieces


@dataclass(frozen=True)
class TextPlan:
    """How one text comes back: per node, the indices of its sentences and the separators between them."""

    nodes: list[tuple[range, list[str]]]
    rebuild: Callable[[list[str]], str] | None  # HTML: the markup around the translated nodes; None for plain text


def plan_texts(texts: list[str], html: bool) -> tuple[list[TextPlan], list[str]]:
    """(a plan per text, every text's sentences in order)."""
    plans, sentences = [], []
    for text in texts:
        nodes, rebuild = html_text_nodes(text) if html else ([text], None)
        layout = []
        for node in nodes:
            node_sentences, separators = split_sentences(node)
            layout.append((range(len(sentences), len(sentences) + len(node_sentences)), separators))
            sentences += node_sentences
        plans.append(TextPlan(layout, rebuild))
    return plans, sentences


def engine_units(sentences: list[str], counts: list[int], count_tokens: Callable[[str], int],
                 longest: int) -> tuple[list[str], list[tuple[int, int]]]:  # fmt: skip
    """(the engine's units, per sentence its first unit and number of units): a sentence of more than `longest`
    tokens (`counts`) is cut at words into pieces that fit."""
    units, spans = [], []
    for sentence, count in zip(sentences, counts):
        pieces = [sentence] if count <= longest else word_pieces(sentence, count_tokens, longest)
        spans.append((len(units), len(pieces)))
        units += pieces
    return units, spans


def rebuild_texts(plans: list[TextPlan], spans: list[tuple[int, int]], found: list[list[tuple[float, str]]],
                  nbest: int) -> list[list[tuple[float, str]]]:  # fmt: skip
    """Per text, its nbest hypotheses as (score, text): the rank-th is made of every unit's rank-th hypothesis (or
    its last, if it has fewer), scores summed."""
    results = []
    for plan in plans:
        hypotheses = []
        for rank in range(nbest):
            nodes, score = [], 0.0
            for indices, separators in plan.nodes:
                picked = []
                for start, n in (spans[i] for i in indices):
                    chosen = [h[min(rank, len(h) - 1)] for h in found[start : start + n]]
                    score += sum(s for s, _ in chosen)
                    picked.append(" ".join(t for _, t in chosen))
                nodes.append(join_sentences(picked, separators))
            hypotheses.append((score, plan.rebuild(nodes) if plan.rebuild else nodes[0]))
        results.append(hypotheses)
    return results
