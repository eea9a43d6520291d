"""Starting a training from a model (init_from: a folder transformer.import_model wrote, or any checkpoint): its
architecture, weights and tokenizers, with a fresh optimizer, schedule and step count."""

import os
from dataclasses import replace
from pathlib import Path

from torch import Tensor

from ..data import DataConfig
from ..model import ModelConfig

# what a fine-tuning may change (model.<field>=... with init_from): regularisation, not the weights' shapes or meaning
TUNABLE = ("dropout", "attention_dropout", "activation_dropout", "token_dropout")
CHECKPOINT_NAME = "model.ckpt"  # transformer.import_model's, in its output folder


def initial_checkpoint_path(init_from: str) -> str:
    """init_from's checkpoint file: the path itself, or a folder's model.ckpt."""
    path = Path(init_from)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"init_from={init_from}: no such checkpoint (a folder needs a {CHECKPOINT_NAME}); give "
                                "a folder transformer.import_model wrote, or a checkpoint file")  # fmt: skip
    return str(path)


def holds_training_state(checkpoint: dict) -> bool:
    """Whether a run can resume from it (a training's checkpoint), or only start from its weights (an imported or
    averaged model)."""
    return "optimizer_states" in checkpoint


def initial_model(checkpoint: dict, choice: dict, init_from: str) -> ModelConfig:
    """The checkpoint's ModelConfig with the command line's regularisation (TUNABLE) over it. The `model:` group's
    other non-null fields must agree with it: they would change the weights' shapes or meaning."""
    saved = ModelConfig.from_dict(checkpoint["hyper_parameters"]["model"])
    given = {k: v for k, v in choice.items() if k != "size" and v is not None}
    for name, value in given.items():
        if name not in TUNABLE and value != getattr(saved, name):
            raise ValueError(f"model.{name}={value} but init_from={init_from} has {name}={getattr(saved, name)}; drop "
                             f"the override (with init_from only {', '.join(TUNABLE)} may change)")  # fmt: skip
    return replace(saved, **{k: v for k, v in given.items() if k in TUNABLE})


def initial_weights(checkpoint: dict) -> dict[str, Tensor]:
    """The model's weights, as EncoderDecoder.load_state_dict takes them."""
    return {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}


def with_checkpoint_tokenizers(data: DataConfig, checkpoint: dict, folder: Path, init_from: str) -> DataConfig:
    """data with the checkpoint's sentencepiece models as its tokenizer (data.tokenizer), written into `folder` (the
    run's tokenizer/): vocabulary training is skipped and the corpus encoded as the model was trained."""
    trained = checkpoint.get("data", {})
    if (trained.get("src"), trained.get("tgt")) != (data.src, data.tgt):
        raise ValueError(f"init_from={init_from} translates {trained.get('src')}->{trained.get('tgt')}, but data.src="
                         f"{data.src} data.tgt={data.tgt}; set data.src={trained.get('src')} "
                         f"data.tgt={trained.get('tgt')}")  # fmt: skip
    if data.tokenizer is not None:
        raise ValueError(f"data.tokenizer={data.tokenizer} and init_from={init_from}: the model's own tokenizer is "
                         "used; drop data.tokenizer")  # fmt: skip
    tokenizers = checkpoint["tokenizers"]
    folder.mkdir(parents=True, exist_ok=True)
    joint = tokenizers["src"] == tokenizers["tgt"]
    for side, lang in (("src", data.src), ("tgt", data.tgt)):
        path = folder / ("spm.model" if joint else f"spm.{lang}.model")
        if not path.is_file() or path.read_bytes() != tokenizers[side]:
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # its own: every DDP rank writes them
            tmp.write_bytes(tokenizers[side])
            tmp.replace(path)
    return replace(data, tokenizer=str(folder))


def check_vocabulary(model: ModelConfig, src_vocab_size: int, tgt_vocab_size: int, pad_id: int) -> None:
    """The tokenizers the data module loaded fit the model's embeddings."""
    for name, value in (("src_vocab_size", src_vocab_size), ("tgt_vocab_size", tgt_vocab_size), ("pad_id", pad_id)):
        if getattr(model, name) != value:
            raise ValueError(f"the tokenizer gives {name}={value} but the initial model has {getattr(model, name)}")
