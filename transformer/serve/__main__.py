"""python -m transformer.serve models=[FOLDER_OR_CHECKPOINT,...] [host=... port=... key=value ...]: a translation
server with LibreTranslate's API, ours (/v1/translate), /health, /metrics and a page at /."""

import sys
from pathlib import Path

import hydra
import uvicorn
from omegaconf import DictConfig, OmegaConf

from ..cli.command import CONFIGS, check_overrides, one_line_errors
from ..config.serve import ServeConfig
from ..translators import open_translator
from .app import ServedModel, create_app


def load_models(cfg: ServeConfig) -> list[ServedModel]:
    """Every model, or one line naming the one that cannot be served."""
    if not cfg.models:
        raise ValueError("models=[] serves nothing; give exported folders or checkpoints: models=[deploy/de-en]")
    if unknown := [path for path in cfg.tags if path not in cfg.models]:
        raise ValueError(f"tags: {unknown[0]} is not in models; key a tag by the model's path as models= gives it")
    models, pairs = [], {}
    for path in cfg.models:
        if not Path(path).exists():
            raise FileNotFoundError(f"models: {path} does not exist; give an exported folder or a checkpoint")
        translator = open_translator(path, cfg.device, threads=cfg.threads, workers=cfg.workers)
        source, target = translator.data.get("src"), translator.data.get("tgt")
        if (source, target) in pairs:
            raise ValueError(f"models: {pairs[(source, target)]} and {path} both translate {source}->{target}")
        pairs[(source, target)] = path
        tag = cfg.tags[path] if path in cfg.tags else translator.data.get("tag")  # its main corpus's by default
        if tag is not None:
            translator.src_tokenizer.tag_id(tag)  # one line if the model has no such tag
        models.append(ServedModel(path, translator, source, target, tag))
    return models


@hydra.main(config_path=str(CONFIGS), config_name="serve", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    serve = ServeConfig(**OmegaConf.to_container(cfg, resolve=True))
    app = create_app(load_models(serve), serve)
    print(f"serving on http://{serve.host}:{serve.port}/", file=sys.stderr)
    uvicorn.run(app, host=serve.host, port=serve.port, log_level="warning",
                timeout_graceful_shutdown=serve.shutdown_timeout_s)  # fmt: skip


def cli() -> None:
    """`python -m transformer.serve`, and the console script `transformer-serve`."""
    check_overrides("serve", sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
