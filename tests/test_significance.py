"""Paired significance (evaluate compare=...): the same system is not significantly different, one sentence in 48
is not enough, half the translations lost is; the scores are sacreBLEU's."""

import random

import pytest
from sacrebleu.metrics import BLEU, CHRF, TER

from transformer.evaluation.significance import paired_tests

from .helpers import WORDS_EN

TRIALS = {"bootstrap_samples": 1000, "randomisation_trials": 1000}  # p down to 1/1001, a tenth of the work


@pytest.fixture(scope="module")
def translations() -> tuple[list[str], list[str]]:
    """48 references and a system's translations of them: every fourth word lost, a BLEU near 18."""
    rng = random.Random(0)
    references = [" ".join(rng.choice(WORDS_EN) for _ in range(rng.randint(4, 9))) for _ in range(48)]
    hypotheses = [" ".join(w for j, w in enumerate(r.split()) if (i + j) % 4) for i, r in enumerate(references)]
    return hypotheses, references


def test_a_system_against_itself_is_not_significantly_different(translations):
    hypotheses, references = translations
    for name, r in paired_tests(hypotheses, list(hypotheses), references, **TRIALS).items():
        assert r["system"] == r["baseline"] and r["system_ci"] == r["baseline_ci"] > 0, name
        assert r["p_bootstrap"] >= 0.5 and r["p_randomisation"] >= 0.5, (name, r)


def test_one_sentence_changed_in_48_is_not_significant_either_way(translations):
    hypotheses, references = translations
    better = [references[7] if i == 7 else h for i, h in enumerate(hypotheses)]  # one sentence now perfect
    for system, baseline in ((better, hypotheses), (hypotheses, better)):
        result = paired_tests(system, baseline, references, **TRIALS)
        assert result["bleu"]["system"] != result["bleu"]["baseline"]
        for name, r in result.items():
            assert r["p_bootstrap"] >= 0.05 and r["p_randomisation"] >= 0.05, (name, r)


def test_half_the_translations_lost_is_significant_and_scored_as_sacrebleu_scores(translations):
    hypotheses, references = translations
    blanked = [h if i % 2 else "" for i, h in enumerate(hypotheses)]
    result = paired_tests(hypotheses, blanked, references, **TRIALS)
    for name, metric in {"bleu": BLEU(), "chrf": CHRF(word_order=2), "ter": TER()}.items():
        r = result[name]
        assert r["system"] == pytest.approx(metric.corpus_score(hypotheses, [references]).score, abs=1e-9)
        assert r["baseline"] == pytest.approx(metric.corpus_score(blanked, [references]).score, abs=1e-9)
        assert r["p_bootstrap"] < 0.05 and r["p_randomisation"] < 0.05, (name, r)
        assert abs(r["system_mean"] - r["system"]) < r["system_ci"]  # the bootstrap's mean: near the score
    assert result["bleu"]["system"] > result["bleu"]["baseline"] and result["ter"]["system"] < result["ter"]["baseline"]
    assert "bs:1000" in result["bleu"]["signature"] and "ar:1000" in result["bleu"]["signature"]
    assert paired_tests(hypotheses, blanked, references, **TRIALS) == result  # seeded: the same p-values again


def test_compare_tests_this_evaluation_s_hypotheses_against_the_baseline_file(translations, monkeypatch):
    from transformer.translators import scores

    hypotheses, references = translations
    result = {"split": "val", "sentences": 48, "hypotheses": hypotheses, "references": references}
    monkeypatch.setattr(scores, "paired_tests", lambda *systems: {"systems": systems})
    baseline = [h.upper() for h in hypotheses]
    found = scores.compare(result, "base.hyp", baseline)
    assert found == {"baseline": "base.hyp", "systems": (hypotheses, baseline, references)}
    with pytest.raises(ValueError, match="compare=short.hyp has 1 lines where split val has 48 sentences"):
        scores.compare(result, "short.hyp", ["one line"])
