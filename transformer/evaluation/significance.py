"""Paired significance of two systems' translations of the same references, as WMT papers report it: paired
bootstrap resampling (with 95% confidence intervals) and approximate randomisation, on BLEU, chrF++ and TER, from
sacreBLEU's sufficient statistics per sentence.

Not sacreBLEU's PairedTest: it counts a resample against the null hypothesis only when its difference is strictly
larger than the observed one, so a system compared with itself (every difference 0) gets p = 1 / (samples + 1),
"significant", and under approximate randomisation so does one that differs in a single sentence (every shuffle
differs by exactly the observed amount). Here a tie counts for the null hypothesis."""

import numpy as np
from sacrebleu.metrics import BLEU, CHRF, TER
from sacrebleu.significance import estimate_ci

SEED = 12345  # sacreBLEU's default seed for its significance tests
TIE = 1e-9  # score differences this close are equal (sums of the same statistics in another order)


def metrics() -> dict:
    """The metrics evaluate reports, by name, with sacreBLEU's defaults (chrF++: chrF with word bigrams)."""
    return {"bleu": BLEU(), "chrf": CHRF(word_order=2), "ter": TER()}


def paired_tests(system: list[str], baseline: list[str], references: list[str], bootstrap_samples: int = 1000,
                 randomisation_trials: int = 10000, seed: int = SEED) -> dict:  # fmt: skip
    """Per metric: both scores, their bootstrap means and 95% confidence intervals, and the two-sided p-values of
    `system` against `baseline` (null hypothesis: they score alike):

    - paired bootstrap: both systems scored on the same `bootstrap_samples` resamples of the sentences; p is twice
      the share of resamples in which the difference is zero or has the other sign than the majority's (so p < 0.05
      exactly when the difference's 95% percentile interval excludes zero);
    - approximate randomisation: each sentence's two translations swapped between the systems at random; p is the
      share of `randomisation_trials` shuffles that differ by at least the observed difference.

    Both add one to the counts, so p > 0; `seed` makes them repeatable."""
    rng = np.random.default_rng(seed)
    n = len(references)
    counts = rng.multinomial(n, np.full(n, 1 / n), size=bootstrap_samples).astype(np.float64)  # copies per sentence
    swapped = rng.integers(2, size=(randomisation_trials, n)).astype(bool)
    result = {}
    for name, metric in metrics().items():
        # sacreBLEU's significance module works on these; they have no public names
        base, ours = (np.asarray(metric._extract_corpus_statistics(h, [references]), np.float64)
                      for h in (baseline, system))  # fmt: skip

        def scores(summed: np.ndarray) -> np.ndarray:  # a score per row of summed statistics
            return np.array([metric._compute_score_from_stats(row).score for row in summed])

        base_score, our_score = scores(np.stack([base.sum(0), ours.sum(0)]))
        base_samples, our_samples = scores(counts @ base), scores(counts @ ours)
        higher = our_samples - base_samples
        other_side = min(np.sum(higher <= TIE), np.sum(higher >= -TIE))
        shuffled = _randomised_differences(base, ours, swapped, scores)
        at_least = np.sum(shuffled >= abs(our_score - base_score) - TIE)
        (base_mean, base_ci), (our_mean, our_ci) = estimate_ci(base_samples), estimate_ci(our_samples)
        signature = metric.get_signature()
        for key, value in (("seed", seed), ("bs", bootstrap_samples), ("ar", randomisation_trials)):
            signature.update(key, value)
        result[name] = {
            "baseline": float(base_score), "system": float(our_score),
            "baseline_mean": float(base_mean), "baseline_ci": float(base_ci),
            "system_mean": float(our_mean), "system_ci": float(our_ci),
            "p_bootstrap": min(1.0, 2 * float(other_side + 1) / (bootstrap_samples + 1)),
            "p_randomisation": float((at_least + 1) / (randomisation_trials + 1)), "signature": str(signature),
        }  # fmt: skip
    return result


def _randomised_differences(base: np.ndarray, ours: np.ndarray, swapped: np.ndarray, scores) -> np.ndarray:
    """|score difference| of the two systems with the sentences in `swapped` (trials x sentences) exchanged: only
    the sentences whose statistics differ move anything, a block of trials at a time (bounded memory)."""
    changed = np.flatnonzero(np.any(base != ours, axis=1))
    step = ours[changed] - base[changed]
    found = []
    for start in range(0, len(swapped), 1000):
        moved = swapped[start : start + 1000, changed].astype(np.float64) @ step
        found.append(np.abs(scores(ours.sum(0) - moved) - scores(base.sum(0) + moved)))
    return np.concatenate(found) if found else np.zeros(0)
