"""CTranslate2 model folders: converted from a spec, and put in place atomically (a failed export leaves whatever
was there before)."""

import shutil
from pathlib import Path


def convert(spec, folder: Path, quantization: str | None = None) -> Path:
    """The spec validated, quantized (CTranslate2's compute types: int8, int8_float32, bfloat16, ...) and saved as
    `folder`, by CTranslate2's own Converter."""
    from ctranslate2.converters.converter import Converter

    class Given(Converter):  # its validation, quantization and file layout, for a spec built here
        def _load(self):
            return spec

    Given().convert(str(folder), quantization=None if quantization == "float32" else quantization, force=True)
    return Path(folder)


def staging(output: Path) -> Path:
    """An empty folder beside `output` to build an export in."""
    tmp = output.with_name(f".{output.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    return tmp


def put_in_place(built: Path, output: Path) -> Path:
    """`built` becomes `output`, replacing an earlier export only now that the new one is complete."""
    old = output.with_name(f".{output.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if output.exists():
        output.rename(old)
    built.rename(output)
    shutil.rmtree(old, ignore_errors=True)
    return output


def write_model(spec, output: Path, quantization: str | None = None) -> Path:
    """convert() into a staging folder, then put_in_place()."""
    output = Path(output)
    tmp = staging(output)
    try:
        return put_in_place(convert(spec, tmp, quantization), output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
