"""Which frameworks a package pulls in, imported in a fresh interpreter (this one has imported everything)."""

import functools
import json
import subprocess
import sys

FRAMEWORKS = ("lightning", "pytorch_lightning", "hydra", "omegaconf")
PACKAGES = ("transformer.model", "transformer.decoding")


@functools.cache
def frameworks_imported() -> dict[str, list[str]]:
    """{package: the framework modules loaded once it is imported}, for every package of PACKAGES, in that order
    (transformer.decoding imports transformer.model): one interpreter start (~2 s) for all of them."""
    code = (
        "import importlib, json, sys\n"
        f"seen = {{}}\nfor name in {PACKAGES!r}:\n"
        "    importlib.import_module(name)\n"
        f"    seen[name] = sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r})\n"
        "print(json.dumps(seen))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.splitlines()[-1])
