"""CTranslate2 export: the exported model computes what ours computes, for every architecture it can represent."""

from dataclasses import asdict, replace

import numpy as np
import pytest
import torch

from transformer.config.schema import ExportConfig
from transformer.export import UnsupportedModel, checkpoint_spec, ctranslate2_spec, supported, write_model
from transformer.export.parity import Parity
from transformer.model import ModelConfig, build_model
from transformer.translators import CheckpointTranslator, SearchConfig

from .helpers.prerequisites import require_module

ctranslate2 = require_module("ctranslate2", "pip install -e '.[dev]'")
SPECIAL = {"unk": "<unk>", "bos": "<s>", "eos": "</s>"}


def pieces(n: int) -> list[str]:
    return ["<pad>", "<unk>", "<s>", "</s>", *(f"w{i}" for i in range(4, n))]


def exported(translator: CheckpointTranslator, folder, quantization=None) -> "ctranslate2.Translator":
    spec = checkpoint_spec(translator)
    return ctranslate2.Translator(str(write_model(spec, folder, quantization)), device="cpu", intra_threads=2)


def greedy(translator: CheckpointTranslator, engine, texts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """Our greedy tokens and the export's, per text."""
    src, tgt = translator.src_tokenizer, translator.tgt_tokenizer
    ids = src.encode(texts)
    ours = [h[0].tokens for h in translator.search(ids, SearchConfig(beam_size=1))]
    found = engine.translate_batch([[src.sp.id_to_piece(i) for i in s] for s in ids], beam_size=1)
    return ours, [[tgt.sp.piece_to_id(p) for p in r.hypotheses[0]] for r in found]


def test_a_float32_export_decodes_greedily_exactly_as_translate(trained, tmp_path):
    tmp, _, checkpoint = trained
    translator = CheckpointTranslator.from_path(str(checkpoint))
    texts = (tmp / "c" / "val.de").read_text().splitlines()
    ours, theirs = greedy(translator, exported(translator, tmp_path / "ct2"), texts)
    assert len(ours) == len(texts) > 20 and ours == theirs


def test_an_int8_export_decodes_nearly_as_float32(trained, tmp_path):
    tmp, _, checkpoint = trained
    translator = CheckpointTranslator.from_path(str(checkpoint))
    texts = (tmp / "c" / "val.de").read_text().splitlines()
    float32, int8 = exported(translator, tmp_path / "float32"), exported(translator, tmp_path / "int8", "int8")
    ours, theirs = greedy(translator, int8, texts)
    # int8 kernels differ by CPU, and one changed token sends a greedy search elsewhere: 38 of 48 sentences agree
    # exactly on an Intel Xeon without AMX, 17 on an AMD EPYC without AVX-512; a broken quantization agrees on none
    assert sum(a == b for a, b in zip(ours, theirs)) >= 0.25 * len(texts)
    # how likely each engine finds float32's own translations, per token: -0.34 and -0.42 nats on that AMD EPYC;
    # chance is log(1/320), -5.8
    src, tgt = translator.src_tokenizer.sp, translator.tgt_tokenizer.sp
    sources = [[src.id_to_piece(i) for i in s] for s in translator.src_tokenizer.encode(texts)]
    targets = [[tgt.id_to_piece(i) for i in h] for h in greedy(translator, float32, texts)[1]]
    per_token = [np.mean([np.mean(r.log_probs) for r in e.score_batch(sources, targets)]) for e in (float32, int8)]
    assert per_token[1] > per_token[0] - 0.25, per_token
    size = {name: (tmp_path / name / "model.bin").stat().st_size for name in ("float32", "int8")}
    assert size["int8"] < 0.6 * size["float32"]  # the weight matrices in a byte each (norms, biases stay float)
    assert greedy(translator, exported(translator, tmp_path / "again"), texts) == (ours, ours)  # the model unchanged


VARIANTS = {
    "pre-LN, shared, tied": {},
    "post-LN": {"norm_first": False},
    "separate vocabularies": {"share_embeddings": False, "tie_output": False, "src_vocab_size": 37},
    "learned positions": {"positions": "learned", "max_positions": 64},
    "GELU": {"activation": "gelu"},
    "Marian's: post-LN, swish, output bias, sines then cosines": {
        "norm_first": False,
        "activation": "swish",
        "output_bias": True,
        "positions": "sinusoidal_concat",
    },
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_supported_variant_scores_targets_as_the_model(variant, tmp_path):
    """Per-token log-probabilities of random targets given random sources: the whole network, both engines."""
    torch.manual_seed(0)
    cfg = ModelConfig(**{"src_vocab_size": 41, "tgt_vocab_size": 41, "pad_id": 0, "d_model": 32, "n_heads": 4,
                         "d_ff": 64, "n_encoder_layers": 2, "n_decoder_layers": 2, **VARIANTS[variant]})  # fmt: skip
    model = build_model(cfg).eval()
    with torch.no_grad():  # non-trivial norms, so that mixing up two of them shows
        for name, p in model.named_parameters():
            if "norm" in name or name == "output.bias":
                p.add_(torch.randn_like(p) * 0.3)
    src_vocab, tgt_vocab = pieces(cfg.src_vocab_size), pieces(cfg.tgt_vocab_size)
    spec = ctranslate2_spec(cfg, model.state_dict(), src_vocab, tgt_vocab, SPECIAL)
    engine = ctranslate2.Translator(str(write_model(spec, tmp_path / "ct2")), device="cpu")
    rng = np.random.default_rng(0)
    for _ in range(3):
        src = rng.integers(4, cfg.src_vocab_size, size=int(rng.integers(1, 12))).tolist()
        tgt = rng.integers(4, cfg.tgt_vocab_size, size=int(rng.integers(1, 12))).tolist()
        (scored,) = engine.score_batch([[src_vocab[i] for i in src]], [[tgt_vocab[i] for i in tgt]])
        with torch.no_grad():  # ours: source + EOS; BOS + target in, target + EOS out
            logits = model(torch.tensor([src + [3]]), torch.tensor([[2] + tgt]))
        log_probs = logits.log_softmax(-1)[0].gather(1, torch.tensor(tgt + [3])[:, None])[:, 0]
        np.testing.assert_allclose(scored.log_probs, log_probs.numpy(), rtol=1e-4, atol=1e-4)


def test_an_architecture_ctranslate2_cannot_run_is_refused_in_one_line():
    cfg = ModelConfig(src_vocab_size=41, tgt_vocab_size=41, pad_id=0, d_model=32, n_heads=4, window=8)
    with pytest.raises(UnsupportedModel, match=r"^model.window=8 .* export a model trained without it$"):
        supported(cfg)


def test_a_failed_export_leaves_the_earlier_folder_as_it_was(trained, tmp_path):
    tmp, _, checkpoint = trained
    translator = CheckpointTranslator.from_path(str(checkpoint))
    exported(translator, tmp_path / "ct2")
    before = (tmp_path / "ct2" / "model.bin").read_bytes()
    with pytest.raises(ValueError):
        write_model(
            ctranslate2_spec(translator.model_config, translator.model.state_dict(), ["<unk>"], ["<unk>"], SPECIAL),
            tmp_path / "ct2",
        )
    assert (tmp_path / "ct2" / "model.bin").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2"]


def export_config(checkpoint, output, **changes):
    from omegaconf import OmegaConf

    values = {**asdict(ExportConfig(ckpt_path=str(checkpoint))), "output": str(output)}
    return OmegaConf.create({**values, **changes})


def gate(quantization: str, identical: int, bleu_gap: float | None, tolerance: float = 0.5) -> str | None:
    """The gate's verdict on 1000 sentences of which `identical` decode alike, the export's BLEU `bleu_gap` from
    the checkpoint's 30.0 (None: no references)."""
    bleu = (None, None) if bleu_gap is None else (30.0, 30.0 + bleu_gap)
    return Parity("greedy", 1000, identical, *bleu, None, []).failure(quantization == "float32", tolerance)


def test_the_gate_passes_float32_from_99_percent_identical_and_bleu_within_0_1():
    assert gate("float32", 990, None) is None and gate("float32", 1000, 0.0) is None
    assert gate("float32", 989, None) == "greedy: 989 of 1000 hypotheses identical, under 99%"
    assert gate("float32", 989, 0.0) is not None  # however close BLEU is
    for gap in (0.099, -0.099, 0.1, -0.1):  # either way, up to the bound itself
        assert gate("float32", 1000, gap) is None, gap
    for gap in (0.101, -0.101):
        assert gate("float32", 1000, gap) == f"greedy: BLEU {30 + gap:.2f} against the checkpoint's 30.00, over 0.1"
    assert gate("float32", 1000, 0.101, tolerance=100.0) is not None  # bleu_tolerance is a quantized export's


def test_the_gate_passes_a_quantized_export_on_bleu_within_bleu_tolerance_alone():
    tolerance = ExportConfig().bleu_tolerance
    assert gate("int8", 0, 0.0) is None  # its hypotheses may all differ
    for gap in (tolerance - 0.001, -tolerance + 0.001, tolerance, -tolerance):
        assert gate("int8", 1000, gap) is None, gap
    for gap in (tolerance + 0.001, -tolerance - 0.001):
        assert gate("int8", 1000, gap).endswith(f"over {tolerance}"), gap
    assert gate("bfloat16", 1000, 1.99, tolerance=2.0) is None and gate("bfloat16", 1000, 2.01, tolerance=2.0)


def test_the_export_command_writes_the_folder_and_its_model_card_after_the_gate(trained, tmp_path):
    import hashlib
    import json

    from transformer.export.__main__ import export

    tmp, _, checkpoint = trained
    folder, failure = export(export_config(checkpoint, tmp_path / "ct2"))
    assert failure is None and folder == tmp_path / "ct2"
    assert {"model.bin", "config.json", "source.spm.model", "target.spm.model", "model_card.json"} <= {
        p.name for p in folder.iterdir()
    }
    card = json.loads((folder / "model_card.json").read_text())
    assert card["checkpoint_sha256"] == hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    parity = card["parity"]
    assert parity["passed"] and parity["input"] == "test"
    assert [r["search"] for r in parity["searches"]] == ["greedy", "beam 5, length_penalty 1.0"]
    for result in parity["searches"]:  # float32 decodes as the checkpoint, greedy and beam
        assert result["identical"] == result["sentences"] > 5 and result["bleu_export"] == result["bleu_ours"]
        assert "tok:13a" in result["signature"]


def test_the_gate_reads_parity_input_and_its_references(trained, tmp_path):
    import json

    from transformer.export.__main__ import export

    tmp, _, checkpoint = trained
    lines = (tmp / "c" / "val.de").read_text().splitlines()
    (tmp_path / "in.de").write_text("\n".join(lines[:7]) + "\n")
    (tmp_path / "ref.en").write_text("\n".join((tmp / "c" / "val.en").read_text().splitlines()[:7]) + "\n")
    folder, failure = export(export_config(checkpoint, tmp_path / "a", parity_input=str(tmp_path / "in.de"),
                                           beam_size=3, length_penalty=0.6))  # fmt: skip
    searches = json.loads((folder / "model_card.json").read_text())["parity"]["searches"]
    assert failure is None and [r["search"] for r in searches] == ["greedy", "beam 3, length_penalty 0.6"]
    assert all(r["sentences"] == 7 and r["identical"] == 7 and r["bleu_ours"] is None for r in searches)
    references = {"parity_input": str(tmp_path / "in.de"), "parity_references": str(tmp_path / "ref.en")}
    # This checks where the gate reads, not int8's fidelity (test_an_int8_export_decodes_nearly_as_float32): on 7
    # sentences one that int8 decodes differently moves BLEU by points (6.6 on an AMD EPYC), so no tolerance here.
    folder, failure = export(export_config(checkpoint, tmp_path / "b", quantization="int8", bleu_tolerance=100.0,
                                           **references))  # fmt: skip
    parity = json.loads((folder / "model_card.json").read_text())["parity"]
    assert failure is None and parity["input"] == str(tmp_path / "in.de")
    assert all(r["sentences"] == 7 and r["bleu_ours"] is not None for r in parity["searches"])
    (tmp_path / "short.en").write_text("one line\n")
    for changes, message in (
        ({"parity_input": str(tmp_path / "in.de"), "quantization": "int8"}, "give parity_references=FILE"),
        ({**references, "parity_references": str(tmp_path / "short.en")}, "has 1 lines where parity_input="),
        ({"parity_input": str(tmp_path / "none.de")}, "is not a file"),
        ({"parity_references": str(tmp_path / "ref.en")}, "without parity_input"),
    ):
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            export(export_config(checkpoint, tmp_path / "c", **changes))
    assert not (tmp_path / "c").exists()


def test_an_export_that_fails_the_gate_is_kept_aside_and_the_good_one_stays(trained, tmp_path):
    import json

    from transformer.export.__main__ import export

    tmp, _, checkpoint = trained
    good, _ = export(export_config(checkpoint, tmp_path / "ct2", beam_size=1))  # the gate decodes greedily alone
    before = (good / "model.bin").read_bytes()
    folder, failure = export(export_config(checkpoint, tmp_path / "ct2", quantization="int8", bleu_tolerance=-1.0,
                                           beam_size=1))  # fmt: skip
    assert failure.startswith("greedy: BLEU ") and folder == tmp_path / "ct2.failed"
    assert not json.loads((folder / "model_card.json").read_text())["parity"]["passed"]
    assert (good / "model.bin").read_bytes() == before


def test_a_float32_export_that_decodes_differently_fails_exits_1_and_names_the_sentences(
    trained, tmp_path, monkeypatch, capsys
):
    """The converted weights nudged before they are written: one target word the export never emits. The sentences
    whose translation holds it are the ones that differ (greedy, the gate's first search)."""
    import json

    import transformer.export.__main__ as command

    tmp, _, checkpoint = trained
    translator = CheckpointTranslator.from_path(str(checkpoint))
    sources = (tmp / "c" / "test.de").read_text().splitlines()  # the test split, the gate's default input
    ours = [h[0].tokens for h in translator.search(translator.src_tokenizer.encode(sources), SearchConfig(beam_size=1))]
    holding = {t: [i for i, h in enumerate(ours) if t in h] for t in {t for h in ours for t in h}}
    word = min((t for t in holding if len(holding[t]) >= 2), key=lambda t: len(holding[t]))
    differing = holding[word]
    assert len(differing) <= 5  # all of them named (the report names the first five)

    def nudged(spec, folder, quantization):
        bias = np.zeros(len(spec.decoder.projection.weight), np.float32)
        bias[word] = -1e4
        spec.decoder.projection.bias = bias
        return convert(spec, folder, quantization)

    convert = command.convert
    monkeypatch.setattr(command, "convert", nudged)
    with pytest.raises(SystemExit) as stopped:
        command.main(export_config(checkpoint, tmp_path / "ct2", beam_size=1))  # the gate decodes greedily alone
    assert stopped.value.code == 1
    assert not (tmp_path / "ct2").exists()  # not deployed
    searches = json.loads((tmp_path / "ct2.failed" / "model_card.json").read_text())["parity"]["searches"]
    assert [(s["search"], s["first_different"]) for s in searches] == [("greedy", differing)]
    assert capsys.readouterr().err.splitlines() == [
        f"error: the export fails the parity gate: greedy: {len(ours) - len(differing)} of {len(ours)} hypotheses "
        f"identical, under 99% (first differing sentences: {differing}); it is in {tmp_path / 'ct2.failed'}, not "
        "deployed"
    ]


def test_a_shortlist_holds_the_most_frequent_targets_and_each_source_piece_s_best_partners_by_dice():
    from transformer.export.shortlist import shortlist

    # source 4 always comes with target 7, source 5 with 8; target 9 is in every pair, so it is frequent but no one's
    # partner; source 6 comes once, with 7 and 9 (Dice 2/4 and 2/5); a pair with an empty side counts for its other side alone
    sources = [[4, 4], [4, 5], [5], [6], [], [5]]
    targets = [[7, 9], [7, 8, 9], [8, 9], [7, 9], [8], []]
    fixed, per = shortlist(sources, targets, 10, frequent=3, per_source=2)
    assert fixed == [9, 7, 8]  # by pairs: 4, 3, 3 (a tie: the lower id first); ids in no pair never
    assert per == {4: [7, 9], 5: [8, 9], 6: [7, 9]}
    assert shortlist(sources, targets, 10, frequent=1, per_source=1) == ([9], {4: [7], 5: [8], 6: [7]})


def test_a_shortlisted_export_is_gated_on_bleu_and_its_translations_use_only_the_shortlist(trained, tmp_path):
    import json

    from transformer.export.__main__ import export
    from transformer.translators import CTranslate2Translator

    tmp, _, checkpoint = trained
    references = {"parity_input": str(tmp / "c" / "val.de"), "parity_references": str(tmp / "c" / "val.en")}
    # float32, yet gated on BLEU alone: a shortlist may change hypotheses (on 48 sentences, BLEU by a point)
    folder, failure = export(export_config(checkpoint, tmp_path / "ct2", shortlist=True, bleu_tolerance=100.0,
                                           **references))  # fmt: skip
    card = json.loads((folder / "model_card.json").read_text())
    assert failure is None and card["shortlist"] == {"pairs": 48, "corpus": str(tmp / "c"), "frequent": 100,
                                                     "per_source": 20}  # fmt: skip
    translator = CheckpointTranslator.from_path(str(checkpoint))
    src, tgt = translator.src_tokenizer.sp, translator.tgt_tokenizer.sp
    for line in (folder / "vmap.txt").read_text().splitlines()[1:]:  # every source piece of the training pairs
        key, candidates = line.split("\t")
        assert src.piece_to_id(key) != src.unk_id() and len(candidates.split()) <= 20
    # a shortlist that lets every source piece become one target piece alone: the folder's translator finds
    # nothing else (CTranslate2 always allows unk, BOS and EOS), so translate and evaluate decode with it
    only = 10
    (folder / "vmap.txt").write_text("".join(f"{src.id_to_piece(i)}\t{tgt.id_to_piece(only)}\n"
                                             for i in range(src.get_piece_size())))  # fmt: skip
    exported_folder = CTranslate2Translator(folder)
    ids = translator.src_tokenizer.encode((tmp / "c" / "val.de").read_text().splitlines()[:5])
    found = exported_folder.searcher.nbest(ids, SearchConfig(beam_size=2), 1)
    decoded = {i for hyps in found for _, tokens in hyps for i in tokens}
    assert exported_folder.searcher.use_vmap and decoded <= {only, tgt.unk_id(), tgt.bos_id()}
    for changes, message in (
        ({"parity_input": references["parity_input"]}, "shortlist=true is gated on BLEU: give parity_references"),
        ({"shortlist_per_source": 0}, "shortlist_per_source=0 must be at least 1"),
    ):
        with pytest.raises(ValueError, match=message):
            export(export_config(checkpoint, tmp_path / "bad", shortlist=True, **changes))


@pytest.mark.slow  # subprocesses
def test_export_mistakes_stop_in_one_line_and_leave_nothing_behind(trained, tmp_path):
    from .helpers import run_command

    _, _, checkpoint = trained
    for args, message in (
        ([f"ckpt_path={tmp_path / 'none.ckpt'}"], f"error: ckpt_path={tmp_path / 'none.ckpt'}: no such file"),
        ([f"ckpt_path={checkpoint}", "quantization=int9"], "error: int9 is not a valid quantization type."),
    ):
        result = run_command(*args, f"output={tmp_path / 'ct2'}", module="transformer.export")
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert result.stderr.strip().splitlines()[-1].startswith(message)
    assert list(tmp_path.iterdir()) == []


def test_the_readme_s_python_lines_translate_with_the_export_alone(trained, tmp_path, capsys):
    import re

    from .helpers import ROOT

    tmp, _, checkpoint = trained
    translator = CheckpointTranslator.from_path(str(checkpoint))
    exported(translator, tmp_path / "ct2")
    (tmp_path / "ct2" / "source.spm.model").write_bytes(translator.src_tokenizer.sp.serialized_model_proto())
    (tmp_path / "ct2" / "target.spm.model").write_bytes(translator.tgt_tokenizer.sp.serialized_model_proto())
    deploy = (ROOT / "README.md").read_text().split("## Deploy", 1)[1]
    code = re.search(r"```python\n(.*?)```", deploy, re.S).group(1)
    sentence = (tmp / "c" / "val.de").read_text().splitlines()[0]
    exec(code.replace("Ein Hund läuft über die Wiese.", sentence), {"DIR": str(tmp_path / "ct2")})
    search = SearchConfig(beam_size=5, early_stopping=True, max_len_a=0, max_len_b=256)  # CTranslate2's defaults
    assert capsys.readouterr().out.strip() == translator.translate([sentence], search)[0]


def test_translate_and_evaluate_take_an_exported_folder_as_a_checkpoint(trained, tmp_path):
    from transformer.data import DataConfig
    from transformer.export.__main__ import export
    from transformer.translators import open_translator
    from transformer.translators.scores import evaluate

    tmp, _, checkpoint = trained
    folder, _ = export(export_config(checkpoint, tmp_path / "ct2"))
    ours, theirs = open_translator(str(checkpoint)), open_translator(str(folder))
    texts = (tmp / "c" / "val.de").read_text().splitlines()[:10]
    texts[3] = "   "  # an empty line gives an empty line
    greedy_search = SearchConfig(beam_size=1)
    assert (
        theirs.translate(texts, greedy_search) == ours.translate(texts, greedy_search)
        and theirs.translate(texts, greedy_search)[3] == ""
    )
    scores = [evaluate(t, DataConfig.from_checkpoint(t.data, {}), "val", greedy_search, "32") for t in (ours, theirs)]
    assert scores[0]["hypotheses"] == scores[1]["hypotheses"] and scores[0]["bleu"] == scores[1]["bleu"]
    beam = SearchConfig(beam_size=3, length_penalty=0.6)  # the export stops as early_stopping does
    assert theirs.translate(texts, beam) == ours.translate(texts, replace(beam, early_stopping=True))
    ours_nbest = ours.translate_nbest(texts, replace(beam, early_stopping=True), 3)
    for a, b in zip(ours_nbest, theirs.translate_nbest(texts, beam, 3)):  # the same 3 best, scored alike
        assert [t for _, t in a] == [t for _, t in b] and [s for s, _ in a] == pytest.approx(
            [s for s, _ in b], abs=1e-3
        )
    assert len(ours_nbest[0]) == 3 and ours_nbest[3] == [(0.0, "")]
    sizes = [
        len(batch)
        for batch, src in ours.batches(ours.src_tokenizer.encode(texts), SearchConfig(beam_size=1, max_tokens=300))
    ]
    beam_sizes = [len(b) for b, src in ours.batches(ours.src_tokenizer.encode(texts), replace(beam, max_tokens=300))]
    assert len(beam_sizes) > len(sizes)  # a beam's batches hold max_tokens / beam_size source tokens


@pytest.mark.parametrize("beam_size", [1, 3])
def test_the_export_stops_each_sentence_at_the_same_max_length(beam_size, tmp_path):
    """A random model rarely ends a sentence: its hypotheses run to the max-length rule, which differs by source
    length; both engines must cut each at the same place."""
    from transformer.decoding import beam_search, greedy_search
    from transformer.translators.ctranslate2 import CTranslate2Search

    torch.manual_seed(0)
    cfg = ModelConfig(src_vocab_size=41, tgt_vocab_size=41, pad_id=0, d_model=32, n_heads=4, d_ff=64,
                      n_encoder_layers=2, n_decoder_layers=2)  # fmt: skip
    model = build_model(cfg).eval()
    vocab = pieces(41)
    engine = ctranslate2.Translator(str(write_model(ctranslate2_spec(cfg, model.state_dict(), vocab, vocab, SPECIAL),
                                                    tmp_path / "ct2")))  # fmt: skip
    sources = [[5 + i % 30] * n for i, n in enumerate((1, 4, 9, 2, 6))]
    ours = []
    with torch.no_grad():
        for s in sources:
            src = torch.tensor([s + [3]])
            ours.append(
                greedy_search(model, src, 2, 3)[0]
                if beam_size == 1
                else beam_search(model, src, 2, 3, beam_size, early_stopping=True)[0][0].tokens
            )
    search = SearchConfig(beam_size=beam_size, early_stopping=True)
    theirs = CTranslate2Search(engine, vocab, vocab, SPECIAL["eos"]).best(sources, search)
    assert theirs == ours
    assert any(len(h) == int(1.2 * (len(s) + 1) + 10) for h, s in zip(ours, sources))  # some cut at their limit
