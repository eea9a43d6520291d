"""A CTranslate2 model folder written atomically: a failed export leaves whatever was there before."""

import shutil
from pathlib import Path


def write_model(spec, output: Path, quantization: str | None = None) -> Path:
    """The spec validated, quantized (CTranslate2's compute types: int8, int8_float32, bfloat16, ...) and saved as
    the folder `output`; it replaces an earlier export there only once the new one is complete."""
    from ctranslate2.converters.converter import Converter

    class Given(Converter):  # CTranslate2's own validation, quantization and file layout for a spec we built
        def _load(self):
            return spec

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        Given().convert(str(tmp), quantization=quantization, force=True)
        old = output.with_name(f".{output.name}.old")
        if output.exists():
            shutil.rmtree(old, ignore_errors=True)
            output.rename(old)
        tmp.rename(output)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output
