"""Paired significance of two systems' translations of the same references, as WMT papers report it: sacreBLEU's
paired bootstrap resampling (with 95% confidence intervals) and approximate randomisation, on BLEU, chrF++, TER."""

from sacrebleu.metrics import BLEU, CHRF, TER
from sacrebleu.significance import PairedTest


def metrics() -> dict:
    """The metrics evaluate reports, by name, with sacreBLEU's defaults (chrF++: chrF with word bigrams)."""
    return {"bleu": BLEU(), "chrf": CHRF(word_order=2), "ter": TER()}


def paired_tests(system: list[str], baseline: list[str], references: list[str], bootstrap_samples: int = 1000,
                 randomisation_trials: int = 10000) -> dict:  # fmt: skip
    """Per metric: both scores, their bootstrap means and 95% confidence intervals, and the p-values of `system`
    against `baseline` (null hypothesis: they score alike) under paired bootstrap resampling and approximate
    randomisation. sacreBLEU's seed (SACREBLEU_SEED, default 12345) makes it repeatable."""
    named = [("baseline", baseline), ("system", system)]
    signatures, bs = PairedTest(named, metrics(), [references], test_type="bs", n_samples=bootstrap_samples)()
    _, ar = PairedTest(named, metrics(), [references], test_type="ar", n_samples=randomisation_trials)()
    result = {}
    for name, key in zip(metrics(), [k for k in bs if k != "System"]):  # keys: "System", then the metrics'
        (base, ours), ar_ours = bs[key], ar[key][1]
        result[name] = {
            "baseline": float(base.score), "system": float(ours.score),
            "baseline_mean": float(base.mean), "baseline_ci": float(base.ci),
            "system_mean": float(ours.mean), "system_ci": float(ours.ci),
            "p_bootstrap": float(ours.p_value), "p_randomisation": float(ar_ours.p_value), "signature": str(signatures[key]),
        }  # fmt: skip
    return result
