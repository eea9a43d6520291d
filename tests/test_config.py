"""The config tree: dataclasses are the one source of defaults; YAML files hold only presets and changes."""

from dataclasses import asdict, fields
from pathlib import Path

import pytest
import pytorch_lightning as pl
import yaml
from omegaconf import OmegaConf

from transformer.cli.command import check_overrides
from transformer.config.schema import trainer_arguments
from transformer.data import DataConfig
from transformer.data.config import CorpusConfig
from transformer.model import ModelConfig, RuntimeConfig
from transformer.training import OptimConfig, ValidationConfig
from transformer.translators import SearchConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def compose(name: str, overrides: list[str]) -> dict:
    cfg = check_overrides(name, overrides)
    return OmegaConf.to_container(cfg, resolve=False)


def one_line_error(name: str, overrides: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        check_overrides(name, overrides)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    return lines[0]


def test_composed_defaults_are_the_dataclasses_defaults():
    cfg = compose("train", [])
    assert DataConfig(**cfg["data"]) == DataConfig()
    assert OptimConfig(**cfg["optim"]) == OptimConfig()
    assert ValidationConfig(**cfg["validation"]) == ValidationConfig()
    assert RuntimeConfig(**cfg["runtime"]) == RuntimeConfig()
    assert cfg["model"]["size"] == "small" and all(v is None for k, v in cfg["model"].items() if k != "size")
    evaluate = compose("evaluate", ["ckpt_path=x"])
    assert SearchConfig.pick(evaluate, max_tokens=1) == SearchConfig(max_tokens=1)
    assert SearchConfig.pick(compose("translate", ["ckpt_path=x"])) == SearchConfig()


def test_every_model_field_but_the_tokenizer_s_can_be_overridden():
    cfg = compose("train", ["model=base", "model.dropout=0.3", "model.window=8"])
    settable = {f.name for f in fields(ModelConfig)} - {"src_vocab_size", "tgt_vocab_size", "pad_id"}
    assert set(cfg["model"]) == settable | {"size"}
    assert (cfg["model"]["size"], cfg["model"]["dropout"], cfg["model"]["window"]) == ("base", 0.3, 8)


def leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if key != "defaults":
            out |= leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}
    return out


def test_group_files_hold_no_copy_of_a_default():
    """A value equal to the schema's default would be a second copy of it, free to drift."""
    schema = {"data": asdict(DataConfig()), "trainer": asdict(trainer_arguments(pl.Trainer)())}
    for group, defaults in schema.items():
        for path in sorted((CONFIGS / group).glob("*.yaml")):
            values = yaml.safe_load(path.read_text()) or {}
            base = dict(defaults)
            for parent in values.get("defaults", []):  # a preset extending another: its changes to that one
                if (CONFIGS / group / f"{parent}.yaml").exists():
                    base |= leaves(yaml.safe_load((CONFIGS / group / f"{parent}.yaml").read_text()))
            corpus = asdict(CorpusConfig(path="x"))
            for key, value in leaves(values).items():
                against = base
                if group == "data" and key.startswith("corpora."):  # an added corpus: against CorpusConfig's defaults
                    key, against = key.split(".", 2)[2], corpus
                assert key in against and value != against[key], f"{path}: {key}={value!r}"
    for path in sorted((CONFIGS / "model").glob("*.yaml")):
        assert set(leaves(yaml.safe_load(path.read_text()))) == {"size"}, path


@pytest.mark.parametrize("path", sorted((CONFIGS / "experiment").glob("*.yaml")) + [CONFIGS / "debug" / "fast.yaml"],
                         ids=lambda p: p.stem)  # fmt: skip
def test_experiment_files_hold_only_what_they_change(path):
    """Against the config its own group choices make (`override /data: mix_de_en`...), not the plain default."""
    values = yaml.safe_load(path.read_text())
    choices = [f"{key.split()[1].lstrip('/')}={option}" for entry in values.get("defaults", []) if isinstance(entry, dict)
               for key, option in entry.items() if key.startswith("override ")]  # fmt: skip
    base = leaves(compose("train", choices))
    for key, value in leaves(values).items():
        assert base.get(key, "(unset)") != value, f"{path}: {key}={value!r} is already the default"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.vocab_size=abc"], "error: data.vocab_size='abc' must be one of: int"),
        (["optim.lr=fast"], "error: optim.lr='fast' must be one of: float"),
        (["validation.bleu_max_sentences=1.5"], "error: validation.bleu_max_sentences=1.5 must be one of: int, null"),
        (["trainer.max_epochs=abc"], "error: trainer.max_epochs='abc' must be one of: int, null"),
        (
            ["runtime.padding_free_attention=maybe"],
            "error: runtime.padding_free_attention='maybe' must be one of: bool",
        ),
        (["model.nope=1"], "error: Could not override 'model.nope'. To append to your config use +model.nope=1"),
    ],
)
def test_a_wrong_override_is_one_line_naming_key_value_and_types(overrides, message, capsys):
    assert one_line_error("train", overrides, capsys) == message


def test_evaluate_and_translate_share_the_search_schema(capsys):
    assert one_line_error("evaluate", ["ckpt_path=x", "beam_size=abc"], capsys) == (
        "error: beam_size='abc' must be one of: int"
    )
    assert one_line_error("translate", [], capsys) == "error: ckpt_path is required: add ckpt_path=..."
    assert compose("evaluate", ["ckpt_path=x", "data.path=elsewhere"])["data"]["path"] == "elsewhere"


@pytest.mark.parametrize("metric", ["bleu", "chrf"])
def test_best_checkpoints_are_kept_by_the_validation_metric_asked(metric):
    cfg = check_overrides("train", [f"validation.best_metric={metric}"])
    assert OmegaConf.select(cfg, "callbacks.best_checkpoint.monitor") == f"val/{metric}"
    assert OmegaConf.select(cfg, "callbacks.best_checkpoint.filename").endswith(f"-{metric}{{val/{metric}:.2f}}")
    with pytest.raises(ValueError, match="validation.best_metric='ter' is not one of bleu, chrf"):
        ValidationConfig(best_metric="ter")


def test_loader_workers_start_only_in_a_way_python_knows():
    assert DataConfig(worker_start="forkserver").worker_start == "forkserver"
    with pytest.raises(ValueError, match="data.worker_start='thread' is not one of fork, forkserver, spawn"):
        DataConfig(worker_start="thread")
