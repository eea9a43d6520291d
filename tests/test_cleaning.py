"""Cleaning of real sentences: language identification, untranslated copies, duplicates and repeated sources, the
list of dropped pairs; the Arrow computations equal their Python definitions in tests/test_scale.py."""

import gzip

import pytest

from transformer import prepare
from transformer.data import DataError, prepare_data
from transformer.data.cleaning import wrong_languages
from transformer.data.language import judged_languages, wrong_language
from transformer.data.prepare import dropped_file

from .helpers import MULTI30K, compose_command, config
from .test_commands import one_line_error


def captions(split: str, lang: str, n: int | None = None) -> list[str]:
    with gzip.open(MULTI30K / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f][:n]


def test_another_language_is_found_and_real_captions_are_kept():
    de, en, fr, cs = (captions("val", lang) for lang in ("de", "en", "fr", "cs"))
    assert wrong_language(de, "de", 0.1, 15).mean() < 0.005 and wrong_language(en, "en", 0.1, 15).mean() < 0.005
    for other in (fr, cs, de):  # French, Czech, or German untranslated, where English belongs
        assert wrong_language(other, "en", 0.1, 15).mean() > 0.95
    short = ["Tom blinzelte.", "Kein Problem.", "Hallo, Tom."]  # real German, read as Italian, English, English
    assert wrong_language(short, "de", 0.1, 0).all() and not wrong_language(short, "de", 0.1, 15).any()


def test_either_side_in_another_language_drops_the_pair():
    import datasets

    de, en, fr = (captions("val", lang, 40) for lang in ("de", "en", "fr"))
    ds = datasets.Dataset.from_dict({"src": de[:20] + fr[20:30] + de[30:], "tgt": en[:10] + fr[10:20] + en[20:]})
    wrong = wrong_languages(ds, ("de", "en"), 0.1, 15)
    assert wrong[10:30].all() and not wrong[:10].any() and not wrong[30:].any()


def test_languages_are_judged_where_the_identifier_knows_both_codes():
    assert judged_languages("de", "en", None) == ("de", "en") == judged_languages("de", "en", True)
    assert judged_languages("de", "en", False) is None
    assert judged_languages("german", "en", None) is None  # a column name, say: not judged, not an error
    with pytest.raises(DataError, match=r"does not know data.src='german'.*data.language_id=false"):
        judged_languages("german", "en", True)


def test_an_unknown_language_code_stops_prepare_in_one_line(tmp_path, capsys):
    for split in ("train", "val", "test_2016_flickr"):
        for lang, named in (("de", "xx"), ("en", "en")):
            (tmp_path / f"{split}.{named}.gz").symlink_to(MULTI30K / f"{split}.{lang}.gz")
    overrides = [f"data.path={tmp_path}", f"data.cache_dir={tmp_path}", "data.src=xx", "data.language_id=true"]
    cfg = compose_command("prepare", overrides)
    err = one_line_error(capsys, prepare.main, cfg)
    assert "data.src='xx'" in err and "data.language_id=false" in err


@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    """Multi30k's first 300 validation pairs as a training split, with noise at known lines (1-based)."""
    folder = tmp_path_factory.mktemp("noisy")
    de, en, fr = (captions("val", lang, 300) for lang in ("de", "en", "fr"))
    pairs = list(zip(de, en))
    noise = {
        51: ((de[5], de[5]), "copy"),  # untranslated
        102: ((de[7], en[7].upper() + "  "), "duplicate"),  # line 8 again, case and spacing aside
        153: ((de[9], fr[9]), "language"),  # a French target
        204: (("", en[3]), "empty"),
    }
    for line, (pair, _) in sorted(noise.items()):
        pairs.insert(line - 1, pair)
    many = [("Ein Hund.", f"Dog {i}.") for i in range(12)]  # one source, 12 targets: 10 kept (the default cap)
    noise |= {len(pairs) + 1 + i: (many[i], "repeated_source") for i in range(10, 12)}
    pairs += many
    for split in ("train", "val", "test"):
        for side, lang in ((0, "de"), (1, "en")):
            (folder / f"{split}.{lang}").write_text("".join(pair[side] + "\n" for pair in pairs))
    return folder, pairs, {line: reason for line, (_, reason) in noise.items()}


def cleaned(folder, tmp_path, **overrides):
    cleaning = dict(language_id=None, max_length_ratio=100.0, max_length=250, max_tokens=4096)  # these filters alone
    cfg = config(folder, tmp_path, **{**cleaning, **overrides})
    return cfg, prepare_data(cfg)


def test_prepare_drops_each_kind_and_lists_it_by_line_and_reason(noisy, tmp_path):
    folder, pairs, noise = noisy
    cfg, prepared = cleaned(folder, tmp_path)
    listed = dropped_file(prepared.folder, cfg.main_name, "train").read_text().splitlines()
    assert listed[0] == "line\treason\tsource\ttarget"
    rows = [line.split("\t") for line in listed[1:]]
    assert {int(line): reason for line, reason, _, _ in rows} == noise
    assert all([source, target] == list(pairs[int(line) - 1]) for line, _, source, target in rows)
    stats = prepared.stats
    assert {reason: n for reason, n in stats["train"]["dropped"].items() if n} == {
        reason: list(noise.values()).count(reason) for reason in set(noise.values())
    }
    assert len(prepared.splits["train"]) == len(pairs) - len(noise) == stats["train"]["kept"]
    assert stats["val"]["kept"] == len(pairs)  # evaluation pairs are never dropped


def test_each_filter_can_be_turned_off_and_the_cache_follows(noisy, tmp_path):
    folder, pairs, noise = noisy
    _, default = cleaned(folder, tmp_path)
    _, off = cleaned(folder, tmp_path, language_id=False, dedupe=False, drop_copies=False, max_targets_per_source=None)
    assert {reason: n for reason, n in off.stats["train"]["dropped"].items() if n} == {"empty": 1}
    assert len(off.splits["train"]) == len(pairs) - 1 and not off.reused
    _, again = cleaned(folder, tmp_path)
    assert again.reused and len(again.splits["train"]) == len(default.splits["train"]) == len(pairs) - len(noise)
