"""python -m transformer.translate ckpt_path=PATH [input=FILE]: translate lines, one output line per input line."""

import os
import sys
import warnings
from collections.abc import Iterator

import hydra
from omegaconf import DictConfig, OmegaConf

from .cli.command import CONFIGS, check_overrides, one_line_errors
from .model import RuntimeConfig
from .translators import Decoding, SearchConfig, check_nbest, checkpoint_paths, open_translator
from .translators.corpus import CorpusOutput, translate_corpus


def arriving_lines(fd: int, max_lines: int) -> Iterator[list[str]]:
    """Lines from a file descriptor in batches of whatever has arrived (at most max_lines): a file or pipe is
    read in large batches, a terminal line by line. Bytes that are not UTF-8 become U+FFFD."""
    pending = b""
    while chunk := os.read(fd, 1 << 16):
        *lines, pending = (pending + chunk).split(b"\n")
        for start in range(0, len(lines), max_lines):
            yield [
                line.decode("utf-8", errors="replace").removesuffix("\r") for line in lines[start : start + max_lines]
            ]
    if pending:
        yield [pending.decode("utf-8", errors="replace")]


@hydra.main(config_path=str(CONFIGS), config_name="translate", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    plain = OmegaConf.to_container(cfg, resolve=True)
    translator = open_translator(plain["ckpt_path"], cfg.device, RuntimeConfig(**plain["runtime"]), cfg.ema)
    search = SearchConfig.pick(plain)
    precision = str(cfg.precision or translator.trained_precision)  # Hydra reads 32 as a number
    if cfg.max_lines < 1:
        raise ValueError(f"max_lines={cfg.max_lines} must be at least 1")
    if cfg.input and not os.path.isfile(cfg.input):
        raise FileNotFoundError(f"input={cfg.input} is not a file; give a text file, or none to read standard input")
    if cfg.tag is not None:
        translator.src_tokenizer.tag_id(cfg.tag)  # an unknown tag fails here, before any input is read
    if cfg.nbest is not None:
        check_nbest(cfg.nbest, search)  # before any input is read
    if cfg.output is not None:
        if not cfg.input:
            raise ValueError(f"output={cfg.output} writes a corpus from a file: give input=FILE")
        paths = checkpoint_paths(plain["ckpt_path"])  # which weights: a retrained checkpoint is another model
        about = {
            "ckpt_path": plain["ckpt_path"],
            "ema": cfg.ema,
            "checkpoints": [[os.path.getsize(p), os.path.getmtime(p)] for p in paths if os.path.isfile(p)],
        }
        output = CorpusOutput(cfg.output, cfg.split, cfg.chunk_lines, cfg.min_score)
        translate_corpus(translator, cfg.input, output, Decoding(search, cfg.nbest or 1, cfg.tag), precision, about)
        return
    fd = os.open(cfg.input, os.O_RDONLY) if cfg.input else sys.stdin.fileno()
    done = 0  # input lines so far: the nbest lines' index
    for lines in arriving_lines(fd, cfg.max_lines):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = translator.translate_nbest(lines, search, cfg.nbest or 1, precision, tag=cfg.tag)
        for warning in caught:
            print(f"warning: {warning.message}", file=sys.stderr)
        if cfg.nbest is None:  # one line each: any line separator a translation holds becomes a space
            out = [" ".join(hyps[0][1].splitlines()) if hyps else "" for hyps in found]
        else:
            out = [f"{done + i}\t{score:.4f}\t{' '.join(text.splitlines())}" for i, hyps in enumerate(found)
                   for score, text in hyps]  # fmt: skip
        done += len(lines)
        try:
            sys.stdout.write("".join(line + "\n" for line in out))
            sys.stdout.flush()
        except BrokenPipeError:  # the reader has gone (e.g. `| head`)
            sys.stderr.close()
            os._exit(0)


def cli() -> None:
    """`python -m transformer.translate`, and the console script `transformer-translate`."""
    check_overrides("translate", sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
