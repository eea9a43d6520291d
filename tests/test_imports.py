"""The package's modules and subpackages import each other without cycles, the commands sit on top (at the package root, imported by
no module, one another included) with a console script each, and the plain-PyTorch packages pull in no framework."""

import ast
import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers.prerequisites import require

PACKAGE = Path(__file__).parents[1] / "transformer"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports anywhere in it (functions and `if TYPE_CHECKING:` included): for
    `from X import a`, X.a when that is a module, else X."""
    package = module_name(path).split(".") if path.name == "__init__.py" else module_name(path).split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            # `from .x import` is relative to the module's package, `from ..x import` to the one above it
            above = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*above, *filter(None, [node.module])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imported(path, set(paths)) - {name} for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other in a circle: strongly connected components of more than one
    module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_is_read_from_the_source():
    graph = import_graph()
    assert "transformer.data.tokenizer" in graph["transformer.data.datamodule"]  # a relative `from .x import`
    assert "transformer.model" in graph["transformer.training.module"]  # `from ..x import`: a package
    assert "transformer.model.embedding" in graph["transformer.export.spec"]  # `from ..x.y import` in a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_of_the_package_imports_itself_through_others():
    found = cycles(import_graph())
    assert not found, f"modules that import each other (one should only use the other): {found}"


# what users run: the package root holds these and nothing else (export and serve: packages run by __main__)
COMMANDS = {"transformer.train", "transformer.prepare", "transformer.evaluate", "transformer.translate", "transformer.score",
            "transformer.average", "transformer.import_model", "transformer.export.__main__",
            "transformer.serve.__main__"}  # fmt: skip


def package_of(module: str) -> str:
    """A module's subpackage (transformer.data for transformer.data.prepare); a command stands for itself."""
    return module if module in COMMANDS else ".".join(module.split(".")[:2])


def test_no_subpackage_imports_back_up_through_another():
    """Subpackages, not only modules, form no circle: what a lower package uses imports nothing above it (model's and
    data's configs once imported config/check.py, whose package also holds schema.py, which imports both)."""
    graph = {}
    for name, imports in import_graph().items():
        graph.setdefault(package_of(name), set()).update({package_of(m) for m in imports} - {package_of(name)})
    for imports in list(graph.values()):
        for package in imports:
            graph.setdefault(package, set())
    found = cycles(graph)
    assert not found, f"subpackages that import each other (the shared part belongs below both): {found}"


MAINTAINER_ONLY = {"unittest", "pytest", "common", "config_reference"}  # test doubles, the tools/ tree


def test_the_package_holds_the_runtime_only():
    """Benchmark helpers, the docs generator and test instrumentation live in tools/ (never in the wheel): no module
    of the package imports them, nor a test framework."""
    importing = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            found = {name.split(".")[0] for name in names} & MAINTAINER_ONLY
            if found:
                importing.setdefault(module_name(path), set()).update(found)
    assert importing == {}, "the package is the runtime: what only benchmarks, docs or tests use belongs in tools/"


def test_the_package_root_holds_the_commands_and_nothing_else():
    modules = {f"transformer.{path.stem}" for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    run_as_packages = {f"transformer.{path.parent.name}.__main__" for path in PACKAGE.glob("*/__main__.py")}
    assert modules | run_as_packages == COMMANDS


def test_no_module_imports_a_command_and_no_command_another():
    importing = {name: sorted(COMMANDS & imports) for name, imports in import_graph().items() if COMMANDS & imports}
    assert importing == {}, "what two commands share belongs in a subpackage below both"


def test_every_command_has_a_console_script_that_runs_it():
    section = (PACKAGE.parent / "pyproject.toml").read_text().split("[project.scripts]")[1].split("\n[")[0]
    targets = {name: target.split(":") for name, target in re.findall(r'^([\w-]+) = "([\w.:]+)"', section, re.M)}
    assert {module for module, _ in targets.values()} == COMMANDS
    assert all(name == "transformer-" + module.split(".")[1].replace("_", "-") for name, (module, _) in targets.items())
    found = {name: shutil.which(name) for name in ("transformer-average", "transformer-translate")}
    require(None not in found.values(), "the console scripts", 'install the package: pip install -e ".[dev]"')
    run = subprocess.run([found["transformer-average"], "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "transformer.average" in run.stdout  # the command's own usage
    run = subprocess.run([found["transformer-translate"], "--cfg", "job", "ckpt_path=x"], capture_output=True,
                         text=True, cwd=PACKAGE.parent.parent)  # fmt: skip  # Hydra finds configs/ from anywhere
    assert run.returncode == 0 and "ckpt_path: x" in run.stdout, run.stderr[-2000:]


FRAMEWORKS = ("lightning", "pytorch_lightning", "hydra", "omegaconf")
PLAIN_PYTORCH = ("transformer.model", "transformer.decoding")


@functools.cache
def frameworks_imported() -> dict[str, list[str]]:
    """{package: the framework modules loaded once it is imported}, for each of PLAIN_PYTORCH in that order
    (transformer.decoding imports transformer.model), in a fresh interpreter: this one has imported everything. One
    interpreter start (~4 s) for both."""
    code = (
        "import importlib, json, sys\n"
        f"seen = {{}}\nfor name in {PLAIN_PYTORCH!r}:\n"
        "    importlib.import_module(name)\n"
        f"    seen[name] = sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r})\n"
        "print(json.dumps(seen))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("package", PLAIN_PYTORCH)
def test_the_model_and_decoding_packages_import_neither_lightning_nor_hydra(package):
    assert frameworks_imported()[package] == []
