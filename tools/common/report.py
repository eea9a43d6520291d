"""Benchmark sections in the checkout's docs/*.md, written by the benchmarks in tools/ (never by the package)."""

from datetime import date
from pathlib import Path

from .machine import machine

DOCS = Path(__file__).resolve().parents[2] / "docs"
BENCHMARKS = DOCS / "benchmarks.md"


def record(name: str, heading: str, body: str, doc: Path = BENCHMARKS, on_machine: bool = True) -> None:
    """Put a benchmark's section in doc between its markers, replacing its previous run: `## heading`, then
    "Measured DATE on MACHINE" (without " on MACHINE" when on_machine is false) followed by body (which goes on
    from there)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    measured = f"Measured {date.today()}" + (f" on {machine()}" if on_machine else "")
    section = f"{begin}\n## {heading}\n\n{measured}{body}\n{end}"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if begin in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    doc.write_text(text)
    print(f"recorded in {doc}")
