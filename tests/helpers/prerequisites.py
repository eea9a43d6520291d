"""What a test needs from outside the repository (a linked corpus, an optional package): missing, the test is skipped
where a developer runs it, and fails under CI=true, so that a green CI has run every test."""

import importlib
import os

import pytest


def on_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def require(present: bool, what: str, how_to_get_it: str) -> None:
    """Skip (fail under CI=true) unless `present`: `what` is missing, `how_to_get_it` says how to provide it. Also at
    a module's top level, where it skips or fails the whole module."""
    __tracebackhide__ = True  # pytest -rs lists the skip at the line that called this
    if present:
        return
    message = f"{what} is missing; {how_to_get_it}"
    if on_ci():
        pytest.fail(f"{message} (CI=true: a missing prerequisite fails)", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def require_module(name: str, how_to_get_it: str):
    """The module `name`, imported; require()'s skip or failure where it is not installed."""
    __tracebackhide__ = True
    try:
        return importlib.import_module(name)
    except ImportError:
        require(False, f"the Python package {name}", how_to_get_it)
