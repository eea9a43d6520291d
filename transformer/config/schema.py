"""The config tree's types. Every default lives in a dataclass (DataConfig, ModelConfig's named sizes, RuntimeConfig,
OptimConfig, ValidationConfig, SearchConfig); registered here with Hydra's ConfigStore, they are the schema that
configs/*.yaml extend, so the YAML holds only presets and changes, and Hydra rejects unknown keys and wrong types
while composing."""

import inspect
import typing
from dataclasses import MISSING as MISSING_FIELD
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any

import pytorch_lightning as pl
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from ..base.typecheck import accepted
from ..data import DataConfig
from ..model import ModelConfig, RuntimeConfig
from ..training import OptimConfig, ValidationConfig
from ..training.resume import launch_record, run_dir_for
from ..translators import SearchConfig
from .serve import ServeConfig

FROM_TOKENIZER = ("src_vocab_size", "tgt_vocab_size", "pad_id")


def optional_fields(cls: type, name: str, first: tuple = ()) -> type:
    """cls's fields, each optional and null by default: null keeps the value that comes from elsewhere (a named
    size, the checkpoint)."""
    optional = [(f.name, f.type | None, None) for f in fields(cls) if f.name not in FROM_TOKENIZER]
    return make_dataclass(name, [*first, *optional])


def retyped(cls: type, name: str, **types) -> type:
    """cls's fields and defaults, some with another type for Hydra."""
    made = []
    for f in fields(cls):
        default = {"default": f.default} if f.default is not MISSING_FIELD else {"default_factory": f.default_factory}
        made.append((f.name, types.get(f.name, f.type), field(**default)))
    return make_dataclass(name, made)


# data.corpora's entries are plain mappings while composing, so that `+data.corpora.news.path=...` can create one
# (OmegaConf cannot create a typed entry key by key); CorpusConfig checks them once composed
DataSchema = retyped(DataConfig, "DataSchema", corpora=dict[str, Any])

# model.size picks a named size (MODEL_SIZES); any other model.* field overrides it
ModelChoice = optional_fields(ModelConfig, "ModelChoice", first=(("size", str, "small"),))
DataChoice = optional_fields(DataSchema, "DataChoice")  # evaluate: null = the checkpoint's own data config


@dataclass
class TrainConfig:
    data: DataSchema = field(default_factory=DataSchema)
    model: ModelChoice = field(default_factory=ModelChoice)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    trainer: Any = MISSING  # pytorch_lightning.Trainer arguments, checked against its signature
    callbacks: Any = None
    logger: Any = None
    seed: int = 1  # seeds Python, NumPy and torch (weights, dropout); the data's order follows data.seed
    compile: bool = False  # torch.compile the model (in place: checkpoints keep the plain parameter names)
    # torch.compile's mode: null (its default), reduce-overhead (CUDA graphs: each step replayed without the host's
    # launches, one recording per batch shape, so it needs data.length_rungs) or max-autotune
    compile_mode: str | None = None
    # resume: a checkpoint file, or `last` (the run folder's checkpoints/last.ckpt); the overrides its run was launched
    # with apply, the command line's on top
    ckpt_path: str | None = None
    # start from a model: a folder transformer.import_model wrote, or a checkpoint; its architecture, weights and
    # tokenizers, a fresh optimizer (model.dropout and the like may change). A resumed run needs it no more: its
    # checkpoint names the model's tokenizers.
    init_from: str | None = None


@dataclass(frozen=True)
class EvaluateConfig(SearchConfig):
    ckpt_path: Any = MISSING  # a training checkpoint, a folder transformer.export wrote, or [a,b,...]: an ensemble
    split: str | None = None  # null: the checkpoint's test split; a split of its main corpus, or corpus/split
    input: str | None = None  # a text file of sources to score instead of a split (with references=)
    references: str | None = None  # input's references, one line per input line
    max_tokens: int | None = None  # padded tokens a batch holds x beam_size; null: the checkpoint's data.max_tokens
    compare: str | None = None  # a baseline's hypotheses of the split: paired significance of this one against it
    precision: str | None = None  # 32 or bf16; null: as the checkpoint was trained
    ema: bool = False  # the weights' moving average (a checkpoint trained with optim.ema_decay)
    device: str = "cpu"  # cpu, cuda, cuda:1, ...
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    data: DataChoice = field(default_factory=DataChoice)


@dataclass(frozen=True)
class TranslateConfig(SearchConfig):
    ckpt_path: Any = MISSING  # a training checkpoint, a folder transformer.export wrote, or [a,b,...]: an ensemble
    input: str | None = None  # a text file (with output=, .gz too); null: standard input
    output: str | None = None  # a corpus folder to write from input=: {split}.{src}.gz, {split}.{tgt}.gz; resumable
    split: str = "train"  # output='s split name
    chunk_lines: int = 10_000  # output='s lines per chunk: a killed run resumes at its first chunk not written
    min_score: float | None = None  # output='s pairs scored below it left out (beam scores: log-prob per token)
    max_lines: int = 256  # lines per batch at most
    tag: str | None = None  # a corpus tag the model was trained with, e.g. <news>: put before every input line
    nbest: int | None = None  # N: the N best of each line, as TSV lines `line index<TAB>score<TAB>translation`
    precision: str | None = None  # 32 or bf16; null: as the checkpoint was trained
    ema: bool = False  # the weights' moving average (a checkpoint trained with optim.ema_decay)
    device: str = "cpu"  # cpu, cuda, cuda:1, ...
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


@dataclass(frozen=True)
class ScoreConfig:
    ckpt_path: str = MISSING  # the model that scores each target given its source
    reverse_ckpt_path: str | None = None  # a model of the other direction: adds each source's score given its target
    # and the dual conditional cross-entropy (Junczys-Dowmunt 2018), and its own side to the margin prepare filters by
    split: str = "train"  # the split of the checkpoint's corpus, or of data.path's, to score
    output: str | None = None  # the scores' TSV; null: {split}.{src}-{tgt}.scores.tsv in the corpus folder
    chunk_pairs: int = 10_000  # pairs scored and written at a time: a killed run resumes at its first chunk not written
    max_tokens: int | None = None  # padded tokens per batch; null: the checkpoint's data.max_tokens
    precision: str | None = None  # 32 or bf16; null: as the checkpoint was trained
    ema: bool = False  # the weights' moving average (checkpoints trained with optim.ema_decay)
    device: str = "cpu"  # cpu, cuda, cuda:1, ...
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    data: DataChoice = field(default_factory=DataChoice)


@dataclass(frozen=True)
class ExportConfig:
    ckpt_path: str = MISSING  # a training checkpoint, or an average of them
    output: str | None = None  # the CTranslate2 folder; null: RUN/export/{quantization} beside the checkpoint
    quantization: str = "float32"  # a CTranslate2 compute type: float32, int8, int8_float32, bfloat16, ...
    parity_input: str | None = None  # a text file of sources for the gate; null: the checkpoint's test split
    parity_references: str | None = None  # parity_input's references (BLEU); a quantized export needs them
    parity_sentences: int = 1000  # the first N sentences, decoded by both engines
    ema: bool = False  # export the weights' moving average (a checkpoint trained with optim.ema_decay)
    bleu_tolerance: float = 0.5  # a quantized or shortlisted export's BLEU may be this far from the checkpoint's
    shortlist: bool = False  # a lexical shortlist (vmap.txt) from the training pairs: outputs use only its pieces
    shortlist_frequent: int = 100  # the shortlist's target pieces that every sentence may use: the most frequent
    shortlist_per_source: int = 20  # and those each source piece adds: its best partners by Dice over the pairs
    # the gate's beam search (greedy is always checked too); beam_size=1: greedy only
    beam_size: int = SearchConfig.beam_size
    length_penalty: float = SearchConfig.length_penalty
    max_len_a: float = SearchConfig.max_len_a
    max_len_b: int = SearchConfig.max_len_b


def trainer_arguments(trainer_class) -> type:
    """A schema of the Trainer's plain-valued arguments with Lightning's own defaults, so that configs/trainer/ holds
    only what this project changes and any argument can still be overridden (trainer.limit_train_batches=10).
    Annotations OmegaConf cannot check (unions, literals) become Any: check_trainer_args judges those."""
    hints = typing.get_type_hints(trainer_class.__init__)
    found = []
    for name, param in inspect.signature(trainer_class.__init__).parameters.items():
        if name in ("self", "callbacks", "logger", "plugins", "default_root_dir"):
            continue  # built from the callbacks and logger groups, and the run folder
        if param.default is not None and not isinstance(param.default, bool | int | float | str):
            continue
        types = [t for t in accepted(hints.get(name)) or [] if t is not type(None)]
        simple = len(types) == 1 and types[0] in (bool, int, float, str)
        found.append((name, (types[0] | None) if simple else Any, param.default))
    return make_dataclass("TrainerArguments", found)


def _writable(node: DictConfig) -> DictConfig:
    """Frozen dataclasses become read-only nodes, which overrides could not change: the schema's values are
    checked for type, not frozen (the dataclasses are built from them once composed)."""
    OmegaConf.set_readonly(node, None)
    for key in node:
        if not OmegaConf.is_missing(node, key) and isinstance(node[key], DictConfig):
            _writable(node[key])
    return node


def register_configs() -> None:
    """Called by every entry point before Hydra composes (and by tests that compose the real config)."""
    store = ConfigStore.instance()
    for name, schema in (("train", TrainConfig), ("evaluate", EvaluateConfig), ("translate", TranslateConfig),
                         ("score", ScoreConfig), ("export", ExportConfig), ("serve", ServeConfig)):  # fmt: skip
        store.store(name=f"{name}_schema", node=_writable(OmegaConf.structured(schema)))
    store.store(group="trainer", name="schema", node=OmegaConf.structured(trainer_arguments(pl.Trainer)))
    # hydra.run.dir: a resumed run continues in its checkpoint's run folder, and evaluation writes there too
    OmegaConf.register_new_resolver("run_dir_for", run_dir_for, replace=True)
    OmegaConf.register_new_resolver("launch_record", launch_record, replace=True)
