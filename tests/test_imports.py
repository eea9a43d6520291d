"""The package's modules import each other without cycles, and the plain-PyTorch packages pull in no framework."""

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

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
