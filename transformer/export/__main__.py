"""python -m transformer.export ckpt_path=PATH [output=DIR] [quantization=int8]: a checkpoint as a CTranslate2
model folder (model, both sentencepiece models, model_card.json), deployed only if it passes the parity gate."""

import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import hydra
from omegaconf import DictConfig

from ..cli.command import CONFIGS, check_overrides, exit_with, one_line_errors, read_lines
from ..data import DataConfig, load_corpus
from ..data.sources import file_sha256
from ..translators import CheckpointTranslator, SearchConfig
from ..translators.ctranslate2 import VMAP_FILE
from .folder import convert, put_in_place, staging
from .parity import gate_searches, parity
from .shortlist import shortlist, write_vmap
from .spec import checkpoint_spec


def export(cfg: DictConfig) -> tuple[Path, str | None]:
    """The export folder and why it failed the gate (None: it passed and is in place at `output`)."""
    if cfg.shortlist and cfg.shortlist_per_source < 1:
        raise ValueError(f"shortlist_per_source={cfg.shortlist_per_source} must be at least 1")
    if cfg.shortlist and cfg.shortlist_frequent < 0:
        raise ValueError(f"shortlist_frequent={cfg.shortlist_frequent} must be at least 0")
    translator = CheckpointTranslator.from_path(cfg.ckpt_path, ema=cfg.ema)
    output = Path(cfg.output or Path(cfg.ckpt_path).parent.parent / "export" / cfg.quantization)
    tmp = staging(output)
    try:
        return _build_and_check(cfg, translator, tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed export leaves nothing half-written


def parity_sentences(
    cfg: DictConfig, translator: CheckpointTranslator
) -> tuple[str, list[str], list[str] | None, str | None]:
    """What the gate decodes: (its name, the first parity_sentences sources, their references or None, the corpus
    tag to put before each): parity_input's lines (and parity_references'), or the checkpoint's test split."""
    if cfg.parity_sentences < 1:
        raise ValueError(f"parity_sentences={cfg.parity_sentences} must be at least 1")
    if cfg.parity_input is None:
        if cfg.parity_references is not None:
            raise ValueError(
                "parity_references is given without parity_input; give both, or neither for the test split"
            )
        data, corpus, splits = main_corpus(translator)  # the checkpoint's test split, with its references
        test = splits[data.test_split]
        n = min(cfg.parity_sentences, len(test))
        return data.test_split, list(test["src"][:n]), list(test["tgt"][:n]), corpus.tag
    sources = read_lines(cfg.parity_input, "parity_input")[: cfg.parity_sentences]
    if cfg.parity_references is None:
        if not exact_export(cfg):
            setting = "shortlist=true" if cfg.shortlist else f"quantization={cfg.quantization}"
            raise ValueError(f"{setting} is gated on BLEU: give parity_references=FILE, the references of "
                             f"parity_input={cfg.parity_input}")  # fmt: skip
        return cfg.parity_input, sources, None, None
    references = read_lines(cfg.parity_references, "parity_references")[: cfg.parity_sentences]
    if len(references) != len(sources):
        raise ValueError(f"parity_references={cfg.parity_references} has {len(references)} lines where "
                         f"parity_input={cfg.parity_input} has {len(sources)}; give line-aligned files")  # fmt: skip
    return cfg.parity_input, sources, references, None


def main_corpus(translator: CheckpointTranslator):
    """(the checkpoint's DataConfig, its main corpus, that corpus's splits)."""
    data = DataConfig.from_checkpoint(translator.data, {})
    corpus = data.all_corpora()[data.main_name]
    return data, corpus, load_corpus(corpus, data.src, data.tgt, data.cache_dir)[0]


def exact_export(cfg: DictConfig) -> bool:
    """Whether the export computes what the checkpoint computes (gated on identical hypotheses), or approximates
    it (int8, a shortlist: gated on BLEU)."""
    return cfg.quantization == "float32" and not cfg.shortlist


def shortlist_file(cfg: DictConfig, translator: CheckpointTranslator, folder: Path) -> dict | None:
    """With cfg.shortlist, folder/vmap.txt from the training pairs of the checkpoint's main corpus; what the model
    card records of it."""
    if not cfg.shortlist:
        return None
    _, corpus, splits = main_corpus(translator)
    train = splits["train"]
    src, tgt = translator.src_tokenizer, translator.tgt_tokenizer
    vocab_size = max(src.vocab_size, tgt.vocab_size)
    fixed, per_source = shortlist(src.encode(list(train["src"])), tgt.encode(list(train["tgt"])), vocab_size,
                                  cfg.shortlist_frequent, cfg.shortlist_per_source)  # fmt: skip
    write_vmap(folder / VMAP_FILE, fixed, per_source, src.pieces(), tgt.pieces())
    return {
        "pairs": len(train),
        "corpus": corpus.path,
        "frequent": cfg.shortlist_frequent,
        "per_source": cfg.shortlist_per_source,
    }


def _build_and_check(cfg: DictConfig, translator: CheckpointTranslator, tmp: Path, output: Path):
    import ctranslate2

    name, sources, references, tag = parity_sentences(cfg, translator)
    src, tgt = translator.src_tokenizer, translator.tgt_tokenizer
    checkpoint = Path(cfg.ckpt_path)
    built = convert(checkpoint_spec(translator), tmp, cfg.quantization)
    (built / "source.spm.model").write_bytes(src.sp.serialized_model_proto())
    (built / "target.spm.model").write_bytes(tgt.sp.serialized_model_proto())
    shortlisted = shortlist_file(cfg, translator, built)

    engine = ctranslate2.Translator(str(built), device="cpu", compute_type=cfg.quantization)
    searches = gate_searches(SearchConfig.pick(cfg))
    results = [parity(translator, engine, sources, references, search, tag, use_vmap=cfg.shortlist)
               for search in searches]  # fmt: skip
    del engine
    failure = next(filter(None, (r.failure(exact_export(cfg), cfg.bleu_tolerance) for r in results)), None)
    card = {
        "checkpoint": str(checkpoint), "checkpoint_sha256": file_sha256(checkpoint).hexdigest(), "ema": cfg.ema,
        "quantization": cfg.quantization, "shortlist": shortlisted,
        "model": asdict(translator.model_config), "data": translator.data,
        "parity": {"input": name, "searches": [asdict(r) for r in results], "passed": failure is None, "failure": failure},
    }  # fmt: skip
    (built / "model_card.json").write_text(json.dumps(card, indent=2) + "\n")
    if failure is not None:  # kept aside for inspection; an earlier good export at `output` stays
        return put_in_place(built, output.with_name(f"{output.name}.failed")), failure
    return put_in_place(built, output), None


@hydra.main(config_path=str(CONFIGS), config_name="export", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    folder, failure = export(cfg)
    card = json.loads((folder / "model_card.json").read_text())["parity"]
    for result in card["searches"]:
        bleu = "" if result["bleu_ours"] is None else (
            f"; BLEU {result['bleu_export']:.2f} exported, {result['bleu_ours']:.2f} the checkpoint ({result['signature']})")  # fmt: skip
        print(
            f"{result['search']} on {card['input']}'s first {result['sentences']}: {result['identical']} identical{bleu}"
        )
    if failure is not None:
        first = next(r["first_different"] for r in card["searches"] if failure.startswith(r["search"]))
        exit_with(f"the export fails the parity gate: {failure} (first differing sentences: {first}); it is in "
                  f"{folder}, not deployed", status=1)  # fmt: skip
    print(f"exported to {folder}")


def cli() -> None:
    """`python -m transformer.export`, and the console script `transformer-export`."""
    check_overrides("export", sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
