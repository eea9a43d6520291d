"""Rewrite docs/configuration.md from the config dataclasses and configs/*.yaml: every key with its type, default and
meaning. Meanings are the fields' own comments (trailing, or the comment lines just above), read from the source, so
the reference cannot drift from the code; tests/test_docs.py fails while it is stale.

    python tools/config_reference.py
"""

import ast
import dataclasses
import importlib
import inspect
import io
import re
import sys
import tokenize
import typing
from functools import cache
from pathlib import Path

import pytorch_lightning as pl
import yaml

from transformer.config.schema import FROM_TOKENIZER, EvaluateConfig, ExportConfig, TrainConfig, TranslateConfig
from transformer.config.serve import ServeConfig
from transformer.data.config import CorpusConfig, DataConfig
from transformer.model import ModelConfig, RuntimeConfig
from transformer.model.config import MODEL_SIZES
from transformer.training import OptimConfig, ValidationConfig
from transformer.translators import SearchConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
OUTPUT = ROOT / "docs" / "configuration.md"

# The schema's generated types (transformer/config/schema.py), by the dataclass whose source says what their fields mean
SOURCE_OF = {"DataSchema": DataConfig, "DataChoice": DataConfig, "ModelChoice": ModelConfig}
IGNORED_COMMENTS = ("fmt:", "noqa", "type:")


# ---- comments of a class's fields, from its source


@cache
def _module_comments(path: str) -> tuple[dict[int, str], set[int]]:
    """A source file's comments by line, and the lines holding only a comment."""
    text = Path(path).read_text()
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comment = tok.string.lstrip("#").strip()
            if not comment.startswith(IGNORED_COMMENTS):
                comments[tok.start[0]] = comment
    only = {i for i, line in enumerate(text.splitlines(), 1) if line.strip().startswith("#")}
    return comments, only


@cache
def field_comments(cls: type) -> dict[str, str]:
    """What each field of cls (not its bases) means: its trailing comment, the comment lines just above it, or, for a
    default taken from another dataclass's field (`SearchConfig.beam_size`), that field's meaning. Comment lines
    between two fields that both have trailing comments continue the first one's."""
    path = inspect.getsourcefile(cls)
    comments, only = _module_comments(path)
    tree = ast.parse(Path(path).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    body = [s for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    trailing, above = {}, {}
    for stmt in body:
        name = stmt.target.id
        trailing[name] = [
            comments[i] for i in range(stmt.lineno, stmt.end_lineno + 1) if i in comments and i not in only
        ]
        block, line = [], stmt.lineno - 1
        while line in only:
            block.insert(0, comments.get(line, ""))
            line -= 1
        above[name] = (block, line)  # line: the code line the block follows
    meanings, previous, previous_end = {}, None, 0
    for stmt in body:
        name = stmt.target.id
        block, after = above[name]
        continues = block and previous is not None and trailing[previous] and trailing[name] and after == previous_end
        if continues:
            meanings[previous] += " " + " ".join(block)
            block = []
        meanings[name] = " ".join([*block, *trailing[name]]).strip()
        if not meanings[name]:
            meanings[name] = _borrowed_meaning(stmt.value, sys.modules[cls.__module__])
        previous, previous_end = name, stmt.end_lineno
    return meanings


def _borrowed_meaning(default: ast.expr | None, module) -> str:
    """The meaning of `Other.field` when a field's default is that: the same setting, passed on."""
    if isinstance(default, ast.Attribute) and isinstance(default.value, ast.Name):
        other = getattr(module, default.value.id, None)
        if dataclasses.is_dataclass(other):
            return meaning(other, default.attr)
    return ""


def meaning(cls: type, name: str) -> str:
    """A field's meaning, from the first class in cls's MRO that says one."""
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass) and name in klass.__dict__.get("__annotations__", {}):
            found = field_comments(klass).get(name, "")
            if found:
                return found
    return ""


def type_name(cls: type, name: str) -> str:
    """A field's annotation as its source writes it."""
    for klass in cls.__mro__:
        annotation = klass.__dict__.get("__annotations__", {}).get(name)
        if annotation is not None:
            return annotation if isinstance(annotation, str) else _annotation(annotation)
    raise KeyError(name)


def _annotation(annotation) -> str:
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("transformer.data.config.", "")


# ---- rendering


def value(v) -> str:
    """A default as an override would write it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if v == {}:
        return "{}"
    return str(v) if v != "" else '""'


def default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return value(f.default)  # MISSING (???): a key the command requires
    if f.default_factory is not dataclasses.MISSING:
        return value(f.default_factory())
    return "(required)"


def cell(text: str) -> str:
    """Text for a Markdown table cell: pipes escaped, and < outside code spans, so that <bt> is not read as HTML."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p.replace("<", "&lt;") if i % 2 == 0 else p for i, p in enumerate(parts))


def fields_table(cls: type, prefix: str, skip: tuple = ()) -> list[str]:
    rows = ["", "| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind, said = cell(f"`{type_name(cls, f.name)}`"), cell(meaning(cls, f.name))
        rows.append(f"| `{prefix}{f.name}` | {kind} | `{default(f)}` | {said} |")
    return rows


def docstring(cls: type) -> list[str]:
    """The class's own docstring as a paragraph (dataclasses without one get a generated signature: left out)."""
    doc = inspect.getdoc(cls) if "__doc__" in cls.__dict__ and cls.__doc__ else None
    return ["", " ".join(doc.split())] if doc and not doc.startswith(cls.__name__ + "(") else []


def unexplained() -> list[str]:
    """The dataclass fields of every command whose source says nothing about what they mean."""
    missing = []
    for cls, skip in ((DataConfig, ()), (CorpusConfig, ()), (ModelConfig, FROM_TOKENIZER), (RuntimeConfig, ()),
                      (OptimConfig, ()), (ValidationConfig, ()), (TrainConfig, ()), (EvaluateConfig, ()),
                      (TranslateConfig, ()), (ExportConfig, ()), (ServeConfig, ())):  # fmt: skip
        for f in dataclasses.fields(cls):
            described = dataclasses.is_dataclass(f.default_factory()) if callable(f.default_factory) else False
            if f.name not in skip and not described and f.type is not typing.Any and not meaning(cls, f.name):
                missing.append(f"{cls.__name__}.{f.name}")
    return missing


# ---- YAML files: keys, values and their comments


def yaml_entries(path: Path) -> list[tuple[str, object, str]]:
    """(dotted key, value, comment) of every leaf key in a YAML file (the defaults list left out), the comment being
    the key's trailing one or the comment lines just above it; a parent key's comment goes with its first leaf."""
    values = yaml.safe_load(path.read_text()) or {}
    comments, stack, pending = {}, [], []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("# @package"):
            pending = [] if not stripped else pending
            continue
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        if ":" not in stripped or stripped.startswith("-"):
            pending = []
            continue
        indent = len(line) - len(line.lstrip())
        stack = [(i, k) for i, k in stack if i < indent]
        key = stripped.split(":", 1)[0].strip()
        stack.append((indent, key))
        trailing = stripped.split(" #", 1)[1].strip() if " #" in stripped else ""
        comments[".".join(k for _, k in stack)] = " ".join([*pending, trailing]).strip()
        pending = []
    # the file's opening comment says what the file is, not what its first key means
    first = next(iter(comments), None)
    if first and _header(path) and comments[first].startswith(_header(path)):
        comments[first] = comments[first][len(_header(path)) :].strip()
    entries, told = [], set()

    def walk(node, keys):
        for k, v in node.items():
            if k == "defaults" and not keys:
                continue
            if isinstance(v, dict) and v:
                walk(v, [*keys, str(k)])
                continue
            path_keys = [*keys, str(k)]
            parents = [".".join(path_keys[:n]) for n in range(1, len(path_keys))]
            said = [comments[p] for p in parents if comments.get(p) and p not in told]  # on a group's first key
            told.update(parents)
            entries.append((".".join(path_keys), v, " ".join([*said, comments.get(".".join(path_keys), "")]).strip()))

    walk(values, [])
    return entries


def _header(path: Path) -> str:
    """A YAML file's opening comment lines, joined: what the file is."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def yaml_table(path: Path, prefix: str, target: type | None = None) -> list[str]:
    """A YAML file's keys; where the file says nothing, the meaning is the first sentence the class given the keys
    (`target`, or each entry's `_target_`) documents for that argument."""
    entries = yaml_entries(path)
    targets = {key.rsplit(".", 1)[0]: _import(v) for key, v, _ in entries if key.endswith("._target_")}
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for key, v, comment in entries:
        owner, _, name = key.rpartition(".")
        cls = target or targets.get(owner)
        if not comment and cls is not None:
            comment = _first_sentence(inspect.getdoc(cls)) if name == "_target_" else argument_docs(cls).get(name, "")
        rows.append(f"| `{prefix}{key}` | `{cell(value(v))}` | {cell(comment)} |")
    return rows


def _import(dotted: str) -> type:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def argument_docs(cls: type) -> dict[str, str]:
    """The first sentence of each argument in the `Args:` sections of cls's (and its bases') docstrings."""
    found = {}
    for klass in reversed(cls.__mro__):
        for doc in (klass.__dict__.get("__doc__"), getattr(klass.__dict__.get("__init__"), "__doc__", None)):
            lines = inspect.cleandoc(doc or "").splitlines()
            if "Args:" not in lines:
                continue
            start = lines.index("Args:") + 1
            indent = len(lines[start]) - len(lines[start].lstrip()) if start < len(lines) else 0
            name, text = None, {}
            for line in lines[start:]:
                if line.strip() and len(line) - len(line.lstrip()) < indent:
                    break
                head = line[indent:]
                if head and not head[0].isspace() and ":" in head:
                    name, rest = head.split(":", 1)
                    name = name.split(" ")[0]
                    text[name] = [rest.strip()]
                elif name is not None:
                    text[name].append(line.strip())
            found.update({k: _first_sentence("\n".join(v)) for k, v in text.items()})
    return found


def _first_sentence(doc: str | None) -> str:
    """A docstring's first sentence, its reStructuredText markup made plain."""
    paragraph = " ".join((doc or "").split("\n\n")[0].split())
    paragraph = re.sub(r"`([^`<]+?) <[^>]+>`_", r"\1", paragraph).replace("``", "`")
    sentence = re.split(r"(?<=\.)\s", paragraph, maxsplit=1)[0]
    return sentence.rstrip(":.")


def presets(group: str) -> list[str]:
    rows = ["| option | what it is |", "|---|---|"]
    for path in sorted((CONFIGS / group).glob("*.yaml")):
        rows.append(f"| [`{group}={path.stem}`](../configs/{group}/{path.name}) | {cell(_header(path))} |")
    return rows


def sizes() -> list[str]:
    keys = [f.name for f in dataclasses.fields(ModelConfig) if any(f.name in size for size in MODEL_SIZES.values())]
    rows = ["| `model.size` | " + " | ".join(f"`{k}`" for k in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, size in MODEL_SIZES.items():
        base = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
        rows.append(f"| `{name}` | " + " | ".join(value(size.get(k, base[k])) for k in keys) + " |")
    return rows


# ---- the page


def command_table(schema: type, groups: dict[str, str]) -> list[str]:
    """A command's top-level keys; the dataclass-valued ones point at their section."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(schema):
        if f.name in groups:
            rows.append(f"| `{f.name}.*` | group | | [{groups[f.name]}](#{anchor(groups[f.name])}) |")
            continue
        kind, said = cell(f"`{type_name(schema, f.name)}`"), cell(meaning(schema, f.name))
        rows.append(f"| `{f.name}` | {kind} | `{default(f)}` | {said} |")
    return rows


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading."""
    kept = "".join(c for c in heading.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _check_groups(schema: type, described: set[str]) -> None:
    """Every dataclass-valued field of a command's schema must have a section, so that a new group cannot go
    unlisted; a generated group must hold only fields of the dataclass its section describes."""
    for f in dataclasses.fields(schema):
        made = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if not dataclasses.is_dataclass(made):
            continue
        if f.name not in described:
            raise ValueError(f"{schema.__name__}.{f.name} is a config group the reference does not describe yet")
        source = SOURCE_OF.get(type(made).__name__, type(made))
        extra = {g.name for g in dataclasses.fields(made)} - {g.name for g in dataclasses.fields(source)} - {"size"}
        if extra:
            raise ValueError(f"{schema.__name__}.{f.name} has fields {sorted(extra)} that {source.__name__} lacks")


def render() -> str:
    train_groups = {
        "data": "data",
        "model": "model",
        "runtime": "runtime",
        "optim": "optim",
        "validation": "validation",
        "trainer": "trainer",
        "callbacks": "callbacks",
        "logger": "logger",
    }
    for schema, described in ((TrainConfig, train_groups), (EvaluateConfig, {"data", "runtime"}),
                              (TranslateConfig, {"runtime"})):  # fmt: skip
        _check_groups(schema, set(described))
    search = {f.name for f in dataclasses.fields(SearchConfig)}
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python tools/config_reference.py` from the config dataclasses and configs/*.yaml;",
        "     edit those, not this file (tests/test_docs.py fails when it is stale). -->",
        "",
        "Every command is configured by Hydra: `key=value` changes a key, `group=option` picks a preset file from",
        "`configs/GROUP/`, and `+key=value` adds a key the config does not have yet (a new `data.corpora.NAME`).",
        "An unknown key or a wrong type stops the command in one line. The defaults live in dataclasses (named in",
        "each section); `configs/` holds only presets and the changes an experiment makes.",
        "`python -m transformer.train --cfg job [overrides]` prints the composed config without running it.",
        "",
        "- [train](#train): [data](#data), [data.corpora.NAME](#datacorporaname), [model](#model),"
        " [runtime](#runtime), [optim](#optim), [validation](#validation), [trainer](#trainer),"
        " [callbacks](#callbacks), [logger](#logger), [presets](#presets)",
        "- [evaluate](#evaluate), [translate](#translate), [export](#export), [serve](#serve), [prepare](#prepare)",
        "",
        "## train",
        "",
        "`python -m transformer.train [group=option ...] [key=value ...]` (`configs/train.yaml`, schema `TrainConfig`"
        " in `transformer/config/schema.py`). Top-level keys:",
        "",
        *command_table(TrainConfig, train_groups),
        "",
        "## data",
        "",
        "`DataConfig` (`transformer/data/config.py`); `configs/data/multi30k.yaml` (the default) keeps its defaults.",
        *docstring(DataConfig),
        *fields_table(DataConfig, "data."),
        "",
        "## data.corpora.NAME",
        "",
        "`CorpusConfig` (`transformer/data/config.py`), one per extra corpus: `+data.corpora.NAME.path=DIR` adds one"
        " from the command line.",
        *docstring(CorpusConfig),
        *fields_table(CorpusConfig, "data.corpora.NAME."),
        "",
        "## model",
        "",
        "`ModelConfig` (`transformer/model/config.py`): what the model is, saved in its checkpoints. `model.size` (or"
        " `model=SIZE`) picks a named size, and any field below overrides it; vocabulary sizes and the pad id come"
        " from the tokenizer. The table's defaults are `ModelConfig`'s; a size sets these:",
        "",
        *sizes(),
        *docstring(ModelConfig),
        *fields_table(ModelConfig, "model.", skip=FROM_TOKENIZER),
        "",
        "## runtime",
        "",
        "`RuntimeConfig` (`transformer/model/config.py`), taken by `train`, `evaluate` and `translate` alike.",
        *docstring(RuntimeConfig),
        *fields_table(RuntimeConfig, "runtime."),
        "",
        "## optim",
        "",
        "`OptimConfig` (`transformer/training/config.py`): AdamW, its schedule and the training loss.",
        *docstring(OptimConfig),
        *fields_table(OptimConfig, "optim."),
        "",
        "## validation",
        "",
        "`ValidationConfig` (`transformer/training/config.py`): what each validation decodes and scores.",
        *docstring(ValidationConfig),
        *fields_table(ValidationConfig, "validation."),
        "",
        "## trainer",
        "",
        "Any plain-valued argument of `pytorch_lightning.Trainer` (see [Lightning's Trainer reference]"
        "(https://lightning.ai/docs/pytorch/stable/common/trainer.html#trainer-flags)), at Lightning's default except"
        " where `configs/trainer/default.yaml` changes it:",
        "",
        *yaml_table(CONFIGS / "trainer" / "default.yaml", "trainer.", pl.Trainer),
        "",
        "`trainer=ddp` (`configs/trainer/ddp.yaml`) sets:",
        "",
        *yaml_table(CONFIGS / "trainer" / "ddp.yaml", "trainer.", pl.Trainer),
        "",
        "## callbacks",
        "",
        "`configs/callbacks/default.yaml`: each entry is a callback, its `_target_` class given the keys listed"
        " (`callbacks.NAME.KEY=VALUE` changes one; `+callbacks.NAME.KEY=VALUE` passes another of its arguments).",
        "",
        *yaml_table(CONFIGS / "callbacks" / "default.yaml", "callbacks."),
        "",
        "## logger",
        "",
        *yaml_table(CONFIGS / "logger" / "tensorboard.yaml", "logger."),
        "",
        "## presets",
        "",
        "Files of `configs/` picked with `group=option`: a preset changes only what it names.",
        "",
        "### experiment",
        "",
        *presets("experiment"),
        "",
        "### data",
        "",
        *presets("data"),
        "",
        "### model",
        "",
        *presets("model"),
        "",
        "### trainer and debug",
        "",
        *presets("trainer")[:],
        *presets("debug")[2:],
        "",
        "## evaluate",
        "",
        "`python -m transformer.evaluate ckpt_path=PATH [key=value ...]` (`configs/evaluate.yaml`, schema"
        " `EvaluateConfig` in `transformer/config/schema.py`; the search keys are `SearchConfig`'s, in"
        " `transformer/translators/interface.py`). `data.*` takes any [data](#data) key, null by default: the checkpoint's own;"
        " `runtime.*` as for [train](#runtime).",
        *fields_table(EvaluateConfig, "", skip=("data", "runtime")),
        "",
        "## translate",
        "",
        "`python -m transformer.translate ckpt_path=PATH [key=value ...]` (`configs/translate.yaml`, schema"
        " `TranslateConfig`): the search keys (`beam_size` ... `use_cache`) as for [evaluate](#evaluate), `runtime.*`"
        " as for [train](#runtime), and:",
        *fields_table(TranslateConfig, "", skip=("runtime", *search)),
        "",
        "## export",
        "",
        "`python -m transformer.export ckpt_path=PATH [key=value ...]` (`configs/export.yaml`, schema `ExportConfig`).",
        *fields_table(ExportConfig, ""),
        "",
        "## serve",
        "",
        "`python -m transformer.serve models=[PATH,...] [key=value ...]` (`configs/serve.yaml`, schema `ServeConfig` in"
        " `transformer/config/serve.py`; the API: [serve.md](serve.md)).",
        *fields_table(ServeConfig, ""),
        "",
        "## prepare",
        "",
        "`python -m transformer.prepare [experiment=...] [data=...] [data.KEY=VALUE ...]` (`configs/prepare.yaml`)"
        " takes the `experiment=` and [data](#data) overrides [train](#train) takes, and prepares the data that"
        " training run reads.",
        "",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
