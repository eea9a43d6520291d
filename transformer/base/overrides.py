"""Hydra's command-line overrides as text: their keys, and one list laid over another."""


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
