"""A regular install: the wheel `pip wheel .` builds, installed into a fresh environment, runs a command from a
folder outside the checkout; the configs and the server's page travel inside the package."""

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from .helpers.corpora import write_text_corpus
from .helpers.runs import tiny_data

ROOT = Path(__file__).resolve().parents[1]


def build_wheel(folder: Path) -> Path:
    """The wheel of a copy of the sources (setuptools' build/ in the checkout would keep files since deleted)."""
    source = folder / "source"
    for name in ("transformer", "configs"):  # transformer/configs links to ../configs, copied as the link
        shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(folder / "dist"), str(source)], check=True, capture_output=True)  # fmt: skip
    return next((folder / "dist").glob("transformer-*.whl"))


@pytest.mark.slow
def test_the_installed_wheel_trains_from_another_folder(tmp_path):
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "transformer/configs/train.yaml" in names and "transformer/serve/page.html" in names
    assert len([n for n in names if n.startswith("transformer/configs/")]) == len(
        list((ROOT / "configs").rglob("*.yaml"))
    )
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    # the dependencies from this environment, which a .pth adds after the new one's own packages (its editable
    # install's finder is not run: only a site folder's .pth files are)
    site = Path(subprocess.run([str(env / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install", "--no-deps", "-q",
                    str(wheel)], check=True, capture_output=True)  # fmt: skip
    elsewhere = tmp_path / "elsewhere"
    write_text_corpus(elsewhere / "corpus")
    where = subprocess.run([str(env / "bin" / "python"), "-c", "import transformer; print(transformer.__file__)"],
                           cwd=elsewhere, capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert where.startswith(str(site)), where
    run = subprocess.run([str(env / "bin" / "transformer-train"), *tiny_data(elsewhere / "corpus", elsewhere / "cache"),
                          "data.language_id=false", "model=tiny", "trainer.max_steps=1", "trainer.limit_val_batches=0",
                          "trainer.enable_progress_bar=false", "~logger", "hydra.run.dir=run"],
                         cwd=elsewhere, capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert (elsewhere / "run" / "checkpoints" / "last.ckpt").is_file()
