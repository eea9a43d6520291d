"""Hydra's command-line overrides as text: their keys, one list laid over another, and the flags beside them."""

# Hydra's flags that take a value, which argparse reads from the next argument (`--cfg job`, `-cn train`), and those
# that may (`--info defaults`), with the values they take: told apart from the overrides around them by these.
_TAKES_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir",
                "-cd", "--experimental-rerun"}  # fmt: skip
_INFO_CHOICES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}
_MAY_TAKE_VALUE = {"--info": _INFO_CHOICES, "-i": _INFO_CHOICES}
_LONG = ("--help", "--hydra-help", "--version", "--cfg", "--resolve", "--package", "--run", "--multirun",
         "--shell-completion", "--config-path", "--config-name", "--config-dir", "--experimental-rerun", "--info")  # fmt: skip


def flag_name(arg: str) -> str:
    """The flag an argument names, as Hydra's argparse reads it: a long flag's unambiguous abbreviation (`--config-n`,
    `--multi`) stands for the flag; any other argument is itself."""
    if not arg.startswith("--") or arg in _LONG:
        return arg
    matches = [flag for flag in _LONG if flag.startswith(arg)]
    return matches[0] if len(matches) == 1 else arg


def override_key(override: str) -> str:
    """`model.dropout` of `model.dropout=0.2`, `+callbacks.x.step=2`, `++k=v`, `~logger`."""
    return override.split("=", 1)[0].lstrip("~+")


def _prefix(override: str) -> str:
    return override[: len(override) - len(override.lstrip("~+"))]


# Which earlier overrides of the same key a later one replaces, so that Hydra accepts the list: a deletion (~k)
# replaces only an earlier deletion (deleting twice fails) and follows whatever added k; an addition (+k) replaces
# what set k (adding an existing key fails); a value (k=, ++k=) replaces all but an earlier addition, which must
# come first for it to have a k to set.
_REPLACES = {"~": ("~",), "+": ("+", "++", ""), "++": ("", "++", "~"), "": ("", "++", "~")}


def laid_over(earlier: list[str], later: list[str]) -> list[str]:
    """`earlier` with `later` on top: what Hydra composes as `later` overriding `earlier`."""
    replaced = {(override_key(o), p) for o in later for p in _REPLACES[_prefix(o)]}
    return [*(o for o in earlier if (override_key(o), _prefix(o)) not in replaced), *later]


def split_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """(Hydra's flags with their values, the overrides) of a command line, each in its order."""
    flags, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-"):
            overrides.append(arg)
            i += 1
            continue
        name = flag_name(arg)
        with_value = name in _TAKES_VALUE or (i + 1 < len(argv) and argv[i + 1] in _MAY_TAKE_VALUE.get(name, ()))
        width = 2 if with_value else 1
        flags.extend(argv[i : i + width])
        i += width
    return flags, overrides
