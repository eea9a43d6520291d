"""python -m transformer.evaluate ckpt_path=PATH [split=... | input=SRC references=REF]: decode a split, or a pair of
text files, and score it with sacreBLEU."""

import json
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from .cli.command import CONFIGS, check_overrides, one_line_errors, read_lines
from .data import DataConfig
from .model import RuntimeConfig
from .translators import SearchConfig, open_translator
from .translators.scores import check_pair, compare, evaluate, score


def print_comparison(found: dict) -> None:
    print(f"paired significance against {found['baseline']} (bootstrap: mean ± 95% CI):")
    for name, label in (("bleu", "BLEU"), ("chrf", "chrF2++"), ("ter", "TER")):
        r = found[name]
        print(f"{label:8} this {r['system']:.2f} ({r['system_mean']:.2f} ± {r['system_ci']:.2f})  baseline "
              f"{r['baseline']:.2f} ({r['baseline_mean']:.2f} ± {r['baseline_ci']:.2f})  p = {r['p_bootstrap']:.4f} "
              f"(paired bootstrap), {r['p_randomisation']:.4f} (approximate randomisation)")  # fmt: skip


@hydra.main(config_path=str(CONFIGS), config_name="evaluate", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    plain = OmegaConf.to_container(cfg, resolve=True)
    pair = None if cfg.input is None and cfg.references is None else check_pair(cfg.input, cfg.references, cfg.split)
    translator = open_translator(plain["ckpt_path"], cfg.device, RuntimeConfig(**plain["runtime"]), cfg.ema)
    data = DataConfig.from_checkpoint(translator.data, plain["data"])
    search = SearchConfig.pick(plain, max_tokens=cfg.max_tokens or data.max_tokens)
    baseline = None if cfg.compare is None else read_lines(cfg.compare, "compare")  # before decoding
    precision = str(cfg.precision or translator.trained_precision)
    if pair is None:
        result = evaluate(translator, data, cfg.split or data.test_split, search, precision)
        name = result["split"].replace("/", ".")
    else:
        result = {"input": cfg.input, **score(translator, *pair, search, precision)}
        name = Path(cfg.input).name
    if cfg.compare is not None:
        result["compare"] = compare(result, cfg.compare, baseline)
    out = Path(HydraConfig.get().runtime.output_dir)
    name = f"{name}.beam{search.beam_size}"
    del result["references"]
    if pair is not None:
        result = {"input": cfg.input, "references": cfg.references, **result}
    (out / f"{name}.hyp").write_text("".join(" ".join(h.splitlines()) + "\n" for h in result.pop("hypotheses")))
    (out / f"{name}.json").write_text(json.dumps({"checkpoint": plain["ckpt_path"], **result}, indent=2) + "\n")
    for line in ("bleu_line", "bleu_lowercase_line", "chrf_line", "ter_line"):
        print(result[line])
    if "compare" in result:
        print_comparison(result["compare"])
    print(f"hypotheses and scores: {out / name}.hyp, .json")


def cli() -> None:
    """`python -m transformer.evaluate`, and the console script `transformer-evaluate`."""
    check_overrides("evaluate", sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
