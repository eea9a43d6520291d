"""python -m transformer.import_model SOURCE output=DIR [src=LANG tgt=LANG]: an OPUS-MT (Marian) model in the Hugging
Face format as a checkpoint of this project. SOURCE is a folder save_pretrained wrote (config.json, the weights,
source.spm, target.spm, vocab.json) or a hub name (Helsinki-NLP/opus-mt-de-en), downloaded through huggingface_hub.

DIR/model.ckpt is what evaluate, translate, export and serve take (ckpt_path=DIR/model.ckpt) and what training starts
from (init_from=DIR); DIR/tokenizer/ holds its sentencepiece models, rewritten so that their ids are vocab.json's.
The languages come from the model's tokenizer_config.json or its name, or from src= and tgt=.
"""

import sys
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path

from .base.errors import first_line
from .cli.command import exit_with
from .data import DataConfig
from .data.prepare import write_tokenizer_folder
from .pretrained import marian
from .training import OptimConfig, TranslationModule
from .training.checkpoint import AtomicCheckpointIO

USAGE = "python -m transformer.import_model SOURCE output=DIR [src=LANG tgt=LANG]"
OPTIONS = ("output", "src", "tgt")
TOKENIZER_FILES = [
    "config.json",
    "source.spm",
    "target.spm",
    "vocab.json",
    "target_vocab.json",
    "tokenizer_config.json",
]


def parse(argv: list[str]) -> tuple[str, dict[str, str]]:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    source, options = argv[0], {}
    for pair in argv[1:]:
        key, equals, value = pair.partition("=")
        if not equals or key not in OPTIONS or not value:
            raise ValueError(f"{pair!r} is not one of {', '.join(f'{o}=...' for o in OPTIONS)}; usage: {USAGE}")
        options[key] = value
    if "output" not in options:
        raise ValueError(f"output=DIR is required: the folder to write the checkpoint into; usage: {USAGE}")
    return source, options


def local_folder(source: str) -> Path:
    """SOURCE itself if it is a folder, else the hub model of that name, downloaded (config, weights, tokenizer
    files only; safetensors where the model has them) into huggingface_hub's cache."""
    if Path(source).is_dir():
        return Path(source)
    if Path(source).exists() or source.count("/") != 1:
        raise FileNotFoundError(f"SOURCE={source} is neither a folder nor a hub model name such as "
                                "Helsinki-NLP/opus-mt-de-en")  # fmt: skip
    try:
        from huggingface_hub import list_repo_files, snapshot_download
        from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError
    except ImportError:
        raise ValueError('downloading a hub model needs huggingface_hub: pip install -e ".[import]"') from None
    try:
        files = list_repo_files(source)
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise FileNotFoundError(f"SOURCE={source}: {type(e).__name__} on the hub (a misspelt name, or a private "
                                "model without a token: huggingface-cli login); give an OPUS-MT name or a folder") from None  # fmt: skip
    except Exception:  # offline (HF_HUB_OFFLINE=1, no network): whichever weights the cache holds
        weights = list(marian.WEIGHT_FILES)
    else:
        weights = [name for name in marian.WEIGHT_FILES if name in files][:1]
        if not weights:
            raise FileNotFoundError(f"{source} on the hub has neither {' nor '.join(marian.WEIGHT_FILES)}")
    try:
        return Path(snapshot_download(source, allow_patterns=[*weights, *TOKENIZER_FILES]))
    except Exception as e:  # no network and nothing cached, a hub error: its first line
        reason = first_line(e, 200)
        raise FileNotFoundError(f"SOURCE={source} could not be downloaded ({reason}); check the network, or give a "
                                "folder save_pretrained wrote") from None  # fmt: skip


def checkpoint(folder: Path, name: str, src: str | None, tgt: str | None, tokenizer_dir: Path) -> dict:
    """The checkpoint a training would have written, less its training state: hyperparameters, weights (float32),
    both tokenizers and a data config naming the languages and the tokenizer folder."""
    hf, weights = marian.read_folder(folder)
    cfg = marian.model_config(hf)
    src_spm, tgt_spm = marian.tokenizers(folder, hf, cfg)
    named = marian.languages(folder, name)
    src, tgt = src or named[0], tgt or named[1]
    if src is None or tgt is None:
        raise ValueError(f"{name} does not name its languages (no tokenizer_config.json source_lang and target_lang, "
                         "no opus-mt-XX-YY name); add src=LANG tgt=LANG")  # fmt: skip
    data = DataConfig(src=src, tgt=tgt, tokenizer=str(tokenizer_dir))
    state = {f"model.{k}": v.float().contiguous() for k, v in marian.state_dict(weights, cfg).items()}
    return {
        "hyper_parameters": TranslationModule.hyperparameters(cfg, OptimConfig()), "state_dict": state,
        "tokenizers": {"src": src_spm, "tgt": tgt_spm}, "data": asdict(data), "precision": "32-true",
        "pytorch-lightning_version": version("pytorch_lightning"), "imported_from": name,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    try:
        source, options = parse(sys.argv[1:] if argv is None else argv)
        output = Path(options["output"])
        imported = checkpoint(local_folder(source), source, options.get("src"), options.get("tgt"),
                              output / "tokenizer")  # fmt: skip
    except (ValueError, FileNotFoundError) as e:  # UnsupportedMarian is a ValueError
        exit_with(e)
    except KeyError as e:
        exit_with(f"{source} lacks {e} (in config.json or the weights); it is not a Marian model in the Hugging Face "
                  "format")  # fmt: skip
    model, data = imported["hyper_parameters"]["model"], imported["data"]
    models = imported["tokenizers"]["src"], imported["tokenizers"]["tgt"]
    write_tokenizer_folder(output / "tokenizer", data["src"], data["tgt"], models)
    AtomicCheckpointIO().save_checkpoint(imported, output / "model.ckpt")
    print(f"imported {source} ({data['src']}->{data['tgt']}, d_model {model['d_model']}, "
          f"{model['n_encoder_layers']}+{model['n_decoder_layers']} layers, {model['src_vocab_size']} pieces) into "
          f"{output / 'model.ckpt'}; fine-tune with: python -m transformer.train init_from={output} data.path=...")  # fmt: skip


if __name__ == "__main__":
    main()
