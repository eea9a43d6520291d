"""python -m transformer.export ckpt_path=PATH [output=DIR] [quantization=int8]: a checkpoint as a CTranslate2
model folder (model, both sentencepiece models, model_card.json), deployed only if it passes the parity gate."""

import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import hydra
from omegaconf import DictConfig

from ..cli import check_overrides, one_line_errors
from ..data import load_corpus
from ..data.sources import file_sha256
from ..evaluate import data_config
from ..inference import Translator
from .folder import convert, put_in_place, staging
from .parity import greedy_parity
from .spec import checkpoint_spec


def export(cfg: DictConfig) -> tuple[Path, str | None]:
    """The export folder and why it failed the gate (None: it passed and is in place at `output`)."""
    translator = Translator.from_path(cfg.ckpt_path)
    output = Path(cfg.output or Path(cfg.ckpt_path).parent.parent / "export" / cfg.quantization)
    tmp = staging(output)
    try:
        return _build_and_check(cfg, translator, tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed export leaves nothing half-written


def _build_and_check(cfg: DictConfig, translator: Translator, tmp: Path, output: Path):
    import ctranslate2

    src, tgt = translator.src_tokenizer, translator.tgt_tokenizer
    checkpoint = Path(cfg.ckpt_path)
    built = convert(checkpoint_spec(translator), tmp, cfg.quantization)
    (built / "source.spm.model").write_bytes(src.sp.serialized_model_proto())
    (built / "target.spm.model").write_bytes(tgt.sp.serialized_model_proto())

    data = data_config(translator.data, {})  # the checkpoint's test split, with its references
    corpus = data.all_corpora()[data.main_name]
    test = load_corpus(corpus, data.src, data.tgt, data.cache_dir)[0][data.test_split]
    n = min(cfg.parity_sentences, len(test))
    engine = ctranslate2.Translator(str(built), device="cpu", compute_type=cfg.quantization)
    parity = greedy_parity(translator, engine, list(test["src"][:n]), list(test["tgt"][:n]), corpus.tag)
    del engine
    failure = parity.failure(cfg.quantization, cfg.bleu_tolerance)
    card = {
        "checkpoint": str(checkpoint), "checkpoint_sha256": file_sha256(checkpoint).hexdigest(), "quantization": cfg.quantization,
        "model": asdict(translator.model_config), "data": translator.data,
        "parity": {"split": data.test_split, **asdict(parity), "passed": failure is None, "failure": failure},
    }  # fmt: skip
    (built / "model_card.json").write_text(json.dumps(card, indent=2) + "\n")
    if failure is not None:  # kept aside for inspection; an earlier good export at `output` stays
        return put_in_place(built, output.with_name(f"{output.name}.failed")), failure
    return put_in_place(built, output), None


@hydra.main(config_path="../../configs", config_name="export", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    folder, failure = export(cfg)
    card = json.loads((folder / "model_card.json").read_text())["parity"]
    print(f"greedy on {card['split']}'s first {card['sentences']}: {card['identical']} identical; BLEU "
          f"{card['bleu_export']:.2f} exported, {card['bleu_ours']:.2f} the checkpoint ({card['signature']})")  # fmt: skip
    if failure is not None:
        print(f"error: the export fails the parity gate: {failure} (first differing sentences: "
              f"{card['first_different']}); it is in {folder}, not deployed", file=sys.stderr)  # fmt: skip
        sys.exit(1)
    print(f"exported to {folder}")


if __name__ == "__main__":
    check_overrides("export", sys.argv[1:])
    main()
