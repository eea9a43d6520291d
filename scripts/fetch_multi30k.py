"""Put the Multi30k raw files (task 1) into data/multi30k: downloaded, or copied from a folder.

python scripts/fetch_multi30k.py                  # download from the dataset's public repository
python scripts/fetch_multi30k.py --from DIR       # copy {train,val,test_2016_flickr}.{de,en,fr,cs}.gz from DIR
"""

import argparse
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path

URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw"
SPLITS = ("train", "val", "test_2016_flickr")
LANGS = ("de", "en", "fr", "cs")
FILES = [f"{split}.{lang}.gz" for split in SPLITS for lang in LANGS]


def fetch(dest: Path, source: Path | None, url: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        tmp = dest / (name + ".part")
        if source is not None:
            if not (source / name).is_file():
                raise SystemExit(
                    f"error: {source / name} does not exist; --from needs a folder holding {', '.join(FILES[:2])}, ..."
                )
            shutil.copyfile(source / name, tmp)
        else:
            try:
                with urllib.request.urlopen(f"{url}/{name}", timeout=30) as response, open(tmp, "wb") as out:
                    shutil.copyfileobj(response, out)
            except (urllib.error.URLError, OSError) as e:
                tmp.unlink(missing_ok=True)
                raise SystemExit(
                    f"error: cannot download {url}/{name} ({getattr(e, 'reason', e)}); with no network, copy the files "
                    f"from a folder: python scripts/fetch_multi30k.py --from DIR"
                ) from None
        tmp.replace(dest / name)  # a file is either whole or absent
    print(f"{len(FILES)} files in {dest}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--from", dest="source", type=Path, help="copy the files from this folder instead of downloading"
    )
    parser.add_argument(
        "--to", dest="dest", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "multi30k"
    )
    parser.add_argument("--url", default=URL, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dest.is_symlink():
        sys.exit(f"error: {args.dest} is a link to {args.dest.resolve()}; the data is already there")
    fetch(args.dest, args.source, args.url)


if __name__ == "__main__":
    main()
