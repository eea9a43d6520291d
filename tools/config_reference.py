"""Rewrite docs/configuration.md from the config dataclasses and configs/*.yaml (transformer/config/reference.py);
tests/test_docs.py fails while it is stale.

    python tools/config_reference.py
"""

from pathlib import Path

from transformer.config.reference import render

OUTPUT = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT.relative_to(OUTPUT.parents[1])}")
