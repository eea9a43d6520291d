"""python -m transformer.train [experiment=...] [key=value ...]: train a model, every knob a Hydra override."""

import shutil
from pathlib import Path

import hydra
import pytorch_lightning as pl
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from .cli import one_line_errors
from .data import DataConfig, TranslationDataModule
from .model import ModelConfig
from .training import OptimConfig, TranslationModule


def model_config(model: dict, data: TranslationDataModule) -> ModelConfig:
    """The named size with overrides; vocabulary sizes and pad id come from the tokenizer, nowhere else."""
    src, tgt = data.data.src_tokenizer, data.data.tgt_tokenizer
    overrides = {k: v for k, v in model.items() if k != "size" and v is not None}  # null: the size's value
    return ModelConfig.from_size(
        model.get("size", "small"), **overrides,
        src_vocab_size=src.vocab_size, tgt_vocab_size=tgt.vocab_size, pad_id=src.pad_id,
    )  # fmt: skip


def train(cfg: DictConfig, run_dir: Path) -> pl.Trainer:
    pl.seed_everything(cfg.seed, workers=True)
    plain = OmegaConf.to_container(cfg, resolve=True)
    data = TranslationDataModule(DataConfig.from_dict(plain["data"]))
    data.setup()
    module = TranslationModule(
        **TranslationModule.hyperparameters(model_config(plain["model"], data), OptimConfig(**plain["optim"]))
    )
    tokenizers = run_dir / "tokenizer"
    tokenizers.mkdir(parents=True, exist_ok=True)
    for tok in {data.data.src_tokenizer.path, data.data.tgt_tokenizer.path}:
        shutil.copy2(tok, tokenizers / tok.name)  # the run folder holds the tokenizer it was trained with
    trainer = pl.Trainer(
        **plain["trainer"],
        default_root_dir=str(run_dir),
        callbacks=[hydra.utils.instantiate(c) for c in cfg.callbacks.values()],
        logger=[hydra.utils.instantiate(c) for c in cfg.logger.values()],
    )
    trainer.fit(module, datamodule=data, ckpt_path=cfg.ckpt_path)
    return trainer


@hydra.main(config_path="../configs", config_name="train", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    train(cfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
