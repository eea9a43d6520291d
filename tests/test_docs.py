"""The docs stay true: the configuration reference is the config's, every relative link lands, every override a
command in the docs shows names a real key, and CI runs the test commands the README gives."""

import re
import shlex
from functools import cache
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import config_reference
from transformer.config.schema import register_configs

from .helpers import ROOT

PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
COMMANDS = ("train", "prepare", "evaluate", "translate", "score", "export", "serve")


def test_the_configuration_reference_is_the_config_s():
    written = (ROOT / "docs" / "configuration.md").read_text()
    assert written == config_reference.render(), "docs/configuration.md is stale: python tools/config_reference.py"


def test_every_config_field_says_what_it_means():
    assert config_reference.unexplained() == [], "give each field a trailing comment in its dataclass"


# ---- links


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its text without markup, lower case, punctuation dropped, spaces as -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images keep their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen, found = {}, set()
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", text, re.M):
        anchor = github_anchor(heading)
        found.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
        seen[anchor] = seen.get(anchor, 0) + 1
    return found | set(re.findall(r'<a (?:name|id)="([^"]+)"', page.read_text()))


def without_code(text: str) -> str:
    """Markdown text with fenced code blocks and code spans blanked out (a # inside them is no heading or link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "``", text)


def relative_links(page: Path) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", without_code(page.read_text()))
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_lands_on_a_file_and_heading(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert broken == []


def test_the_link_checker_sees_a_broken_link_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## Its `second` part\n\n[x](b.md) [y](#its-second-part) [z](#nope)\n")
    assert relative_links(tmp_path / "a.md") == ["b.md", "#its-second-part", "#nope"]
    assert anchors(tmp_path / "a.md") == {"a-page", "its-second-part"}


# ---- commands


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(page, command, arguments) of every `python -m transformer.COMMAND ...` the pages show, in code blocks or
    code spans, continued lines joined; what follows a comment, a pipe or a redirection is left out."""
    found = []
    for page in PAGES:
        text = page.read_text().replace("\\\n", " ")
        for match in re.finditer(r"-m transformer\.(\w+)([^\n`]*)", text):
            command, rest = match.groups()
            if command in COMMANDS:
                rest = re.split(r"\s#|[|<>;]|&&", rest)[0]
                found.append((page.name, command, shlex.split(rest)))
    return found


@cache
def composed(command: str, groups: tuple[str, ...] = ()):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(command, overrides=list(groups), return_hydra_config=True)


def unknown_keys(command: str, args: list[str]) -> list[str]:
    """The overrides among args that name no key of the command's config (or, with +, one it already has), or a
    group option the command does not have. The command is composed once as it is, and again with the line's
    group options only where a key is not found without them (an experiment's corpora)."""
    overrides = [a for a in args if re.match(r"(\+\+|\+|~)?[a-z_][\w.]*=", a) or a.startswith("~")]
    choices = composed(command).hydra.runtime.choices
    groups = tuple(a for a in overrides if a.split("=")[0] in choices)
    wrong = [g for g in groups if not (ROOT / "configs" / g.split("=")[0] / f"{g.split('=')[1]}.yaml").is_file()]
    for arg in overrides:
        key = arg.split("=")[0].lstrip("+~")
        if arg in groups or key.startswith("hydra.") or arg.startswith("++"):
            continue
        found = has_key(composed(command), key) or bool(
            not wrong and groups and has_key(composed(command, groups), key)
        )
        if found == arg.startswith("+"):
            wrong.append(arg)
    return wrong


def has_key(cfg, dotted: str) -> bool:
    parent, _, last = dotted.rpartition(".")
    node = OmegaConf.select(cfg, parent, throw_on_missing=False) if parent else cfg
    return OmegaConf.is_dict(node) and last in node.keys()  # `in node` is False for a ??? value


def test_every_documented_command_names_real_keys():
    commands = documented_commands()
    assert len(commands) > 30 and {c for _, c, _ in commands} == set(COMMANDS)
    wrong = [f"{page}: {command} {' '.join(unknown)}" for page, command, args in commands
             if (unknown := unknown_keys(command, args))]  # fmt: skip
    assert wrong == []


def test_the_key_check_sees_a_misspelt_key_and_a_needless_plus():
    assert unknown_keys("train", ["optim.lr=1", "optim.lrr=1", "+optim.lr=2", "+data.corpora.bt.path=x"]) == [
        "optim.lrr=1",
        "+optim.lr=2",
    ]
    assert unknown_keys("train", ["experiment=multi30k_en_de", "data.corpora.news.weight=1"]) == [
        "data.corpora.news.weight=1"
    ]
    assert unknown_keys("train", ["experiment=mix_de_en_cpu", "data.corpora.news.weight=1"]) == []
    assert unknown_keys("train", ["experiment=nope", "model=base"]) == ["experiment=nope"]
    assert unknown_keys("evaluate", ["ckpt_path=x", "data.path=d", "model=base"]) == ["model=base"]


def test_ci_runs_the_test_commands_the_readme_gives():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()

    def test_commands(text: str) -> list[str]:
        return [line.split("#")[0].strip() for line in text.splitlines() if line.startswith("python -m pytest")]

    assert test_commands(ci) and test_commands(ci) == test_commands(readme)
    torch_pin = re.search(r"pip install -q (torch==\S+)", ci).group(1)
    assert f"pip install {torch_pin} " in readme  # the set-up command installs the torch CI tests with
