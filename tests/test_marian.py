"""An OPUS-MT (Marian) model in the Hugging Face format, imported: a tiny MarianMTModel built here (no download) and
saved with save_pretrained gives, read back by transformer.import_model, the same logits, greedy and beam hypotheses
as transformers, ids as MarianTokenizer's (where they differ, as explained), never generates <pad>, fine-tunes,
resumes exactly, exports through the parity gate and serves."""

import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from omegaconf import OmegaConf

from transformer.config.schema import ExportConfig
from transformer.import_model import main as import_model
from transformer.model import build_model
from transformer.pretrained.marian import UnsupportedMarian, model_config, read_folder, state_dict
from transformer.translators import CheckpointTranslator, SearchConfig

from .helpers.marian import CODES, lines, write_opus_mt
from .helpers.prerequisites import require_module
from .helpers.runs import RECORD, LossRecorder, callback, run_train

V, PAD, EOS = 50, 49, 0  # OPUS-MT's layout: </s> first, <pad> last, the decoder starting from <pad>
SETTINGS = dict(vocab_size=V, decoder_vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2,
                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32,
                activation_function="swish", scale_embedding=True, pad_token_id=PAD, decoder_start_token_id=PAD,
                eos_token_id=EOS, max_position_embeddings=64)  # fmt: skip
LIMIT = 30  # tokens a hypothesis may have, EOS included: max_new_tokens there, max_len_b here


@pytest.fixture(scope="module")
def random_marian(tmp_path_factory):
    """(the folder save_pretrained wrote, the MarianMTModel): random weights drawn wide (N(0, 0.5)), a non-zero
    output bias, the position table as Marian builds it."""
    transformers = require_module("transformers", 'pip install -e ".[dev]"')
    torch.manual_seed(0)
    model = transformers.MarianMTModel(transformers.MarianConfig(**SETTINGS)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_positions" not in name:
                p.normal_(0, 0.5)
        model.final_logits_bias.normal_()
    folder = tmp_path_factory.mktemp("opus-mt-random")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def opus_mt(tmp_path_factory):
    """(the OPUS-MT folder, its MarianMTModel, the folder transformer.import_model wrote from it)."""
    tmp = tmp_path_factory.mktemp("opus-mt")
    folder, model = write_opus_mt(tmp / "opus-mt-de-en")
    import_model([str(folder), f"output={tmp / 'imported'}"])
    return folder, model, tmp / "imported"


def marian_tokenizer(folder: Path):
    return require_module("transformers", 'pip install -e ".[dev]"').MarianTokenizer.from_pretrained(str(folder))


def generated(model, tokenizer, texts: list[str], beams: int, length_penalty: float = 1.0,
              **options) -> list[list[int]]:  # fmt: skip
    """transformers' generate (with `options`): ids without the decoder start and EOS. At the length limit OPUS-MT's
    configs force EOS (forced_eos_token_id) where ours cut the hypothesis: generate is asked not to, so that the
    limit means one thing."""
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, num_beams=beams, max_new_tokens=LIMIT, do_sample=False, early_stopping=False,
                             length_penalty=length_penalty, forced_eos_token_id=None, **options)  # fmt: skip
    found = []
    for row in out[:, 1:].tolist():
        found.append(row[: row.index(EOS)] if EOS in row else row)  # <pad> after EOS: the batch's padding
    return found


def test_teacher_forced_logits_equal_transformers_in_float32(random_marian):
    folder, theirs = random_marian
    config, weights = read_folder(folder)
    cfg = model_config(config)
    ours = build_model(cfg).eval()
    ours.load_state_dict(state_dict(weights, cfg))  # strict: every weight placed, none left over
    src = torch.randint(1, PAD, (4, 9))  # right-padded sources ending with </s>, of different lengths
    for row, length in enumerate((9, 6, 3, 8)):
        src[row, length - 1], src[row, length:] = EOS, PAD
    tgt = torch.randint(1, PAD, (4, 7))
    tgt[:, 0] = PAD  # the decoder's start
    with torch.no_grad():
        want = theirs(input_ids=src, attention_mask=src.ne(PAD), decoder_input_ids=tgt).logits
        got = ours(src, tgt)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "change, field",
    [({"decoder_ffn_dim": 64}, "encoder_ffn_dim=32 but decoder_ffn_dim=64"),
     ({"decoder_attention_heads": 2}, "encoder_attention_heads=4 but decoder_attention_heads=2"),
     ({"scale_embedding": False}, "scale_embedding=false"), ({"activation_function": "tanh"}, "activation_function='tanh'"),
     ({"normalize_before": True}, "normalize_before=true")],
)  # fmt: skip
def test_what_the_model_cannot_represent_is_refused_in_one_line_naming_the_field(change, field):
    with pytest.raises(UnsupportedMarian) as refused:
        model_config({**SETTINGS, **change})
    assert str(refused.value).startswith(field) and "\n" not in str(refused.value)


@pytest.mark.parametrize("beams, length_penalty", [(1, 1.0), (5, 1.0), (5, 0.6), (4, 2.0)])
def test_greedy_and_beam_hypotheses_equal_generate_on_32_sentences(opus_mt, beams, length_penalty):
    folder, theirs, imported = opus_mt
    translator = CheckpointTranslator.from_path(str(imported / "model.ckpt"))
    texts = lines("de", "val", 32, skip=100)
    search = SearchConfig(beam_size=beams, length_penalty=length_penalty, max_len_a=0, max_len_b=LIMIT)
    ours = [hyps[0].tokens for hyps in translator.search(translator.src_tokenizer.encode(texts), search)]
    assert ours == generated(theirs, marian_tokenizer(folder), texts, beams, length_penalty)
    assert len({tuple(h) for h in ours}) >= 24  # the sources decode differently
    assert sum(len(h) < LIMIT for h in ours) >= 8  # and many end with EOS before the limit


def foreign_runs_as_unk(ids: list[int], foreign: set[int], unk: int) -> list[int]:
    """ids with each run of two or more ids unknown to the side's own sentencepiece model (its <unk>, or a character
    only the other side's has) as one <unk>: what MarianTokenizer makes of such a run (sentencepiece gives it as one
    unknown piece, whose surface vocab.json lacks)."""
    out, run = [], []
    for i in [*ids, None]:
        if i in foreign:
            run.append(i)
            continue
        out += [unk] if len(run) > 1 else run
        run = []
        if i is not None:
            out.append(i)
    return out


def test_the_tokenizers_ids_are_marians_but_for_runs_of_unknown_characters(opus_mt):
    folder, _, imported = opus_mt
    theirs = marian_tokenizer(folder)
    translator = CheckpointTranslator.from_path(str(imported / "model.ckpt"))
    vocab = json.loads((folder / "vocab.json").read_text())
    texts = {"source": lines("de", "val", 300) + lines("fr", "val", 100), "target": lines("en", "val", 300)}
    texts["source"] += ["", "  two  spaces ", "ünïcödé 😀 ok", "Ωmega 120\xa0cm"]
    for side, tokenizer in (("source", translator.src_tokenizer), ("target", translator.tgt_tokenizer)):
        original = spm.SentencePieceProcessor(model_file=str(folder / f"{side}.spm"))
        known = {original.id_to_piece(i) for i in range(original.get_piece_size())}
        foreign = {vocab["<unk>"]} | {i for p, i in vocab.items() if len(p) == 1 and p not in known}
        ours = tokenizer.encode(texts[side])
        want = (theirs(texts[side]) if side == "source" else theirs(text_target=texts[side]))["input_ids"]
        assert [foreign_runs_as_unk(x, foreign, vocab["<unk>"]) for x in ours] == [x[:-1] for x in want]  # no </s>
    changed = sum(a != b[:-1] for a, b in zip(translator.src_tokenizer.encode(texts["source"]),
                                              theirs(texts["source"])["input_ids"]))  # fmt: skip
    assert changed <= 5  # such runs are rare: digits the German model lacks, in a few lines


def test_language_codes_are_tags_and_special_pieces_in_text_are_text(opus_mt):
    folder, _, imported = opus_mt
    theirs = marian_tokenizer(folder)
    src = CheckpointTranslator.from_path(str(imported / "model.ckpt")).src_tokenizer
    assert src.tags == list(CODES)
    for text in (">>fra<< Ein Hund rennt.", ">>deu<<Zwei Männer"):
        assert src.encode([text]) == [theirs([text])["input_ids"][0][:-1]]  # the code first, one id
    assert src.encode(["Ein Hund."], tag=">>fra<<") == src.encode([">>fra<< Ein Hund."])  # translate's tag=
    # MarianTokenizer reads a "</s>" typed in the text as EOS; here it is text, and cannot end a source early
    assert src.eos_id not in src.encode(["ein </s> Hund"])[0] and theirs.eos_token_id in theirs(["ein </s> Hund"])[
        "input_ids"][0][:-1]  # fmt: skip


def test_target_ids_decode_as_marians_tokenizer_decodes_them(opus_mt):
    folder, _, imported = opus_mt
    theirs = marian_tokenizer(folder)
    tgt = CheckpointTranslator.from_path(str(imported / "model.ckpt")).tgt_tokenizer
    ids = tgt.encode(lines("en", "test_2016_flickr", 100))
    ids = [x for x in ids if tgt.unk_id not in x]  # <unk>: ours writes ⁇ (sentencepiece's), theirs drops it
    assert len(ids) >= 90 and tgt.decode(ids) == theirs.batch_decode(ids, skip_special_tokens=True)


def test_import_writes_a_checkpoint_every_command_takes_and_refuses_bad_input_in_one_line(opus_mt, tmp_path, capsys):
    from transformer.training import TranslationModule

    folder, _, imported = opus_mt
    module = TranslationModule.load_from_checkpoint(str(imported / "model.ckpt"))  # alone, as a training's
    assert module.model_config.output_bias and module.model_config.positions == "sinusoidal_concat"
    checkpoint = torch.load(imported / "model.ckpt", weights_only=True)
    assert checkpoint["data"]["src"] == "de" and checkpoint["data"]["tgt"] == "en"
    assert sorted(p.name for p in (imported / "tokenizer").iterdir()) == ["spm.de.model", "spm.en.model"]
    damaged = {name: shutil.copytree(folder, tmp_path / name) for name in ("nameless", "weights", "spm", "vocab",
                                                                           "config")}  # fmt: skip
    (damaged["nameless"] / "tokenizer_config.json").unlink()
    (damaged["weights"] / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:100])
    (damaged["spm"] / "source.spm").write_bytes(b"")
    (damaged["vocab"] / "vocab.json").write_text("[]")
    config = json.loads((folder / "config.json").read_text())
    del config["d_model"]
    (damaged["config"] / "config.json").write_text(json.dumps(config))
    for argv, message in (
        ([str(folder)], "output=DIR is required"),
        ([str(folder), "out=x"], "'out=x' is not one of output=..., src=..., tgt=..."),
        ([str(tmp_path / "none"), "output=x"], "is neither a folder nor a hub model name"),
        ([str(damaged["nameless"]), f"output={tmp_path / 'x'}"], "does not name its languages"),
        ([str(damaged["weights"]), f"output={tmp_path / 'x'}"], "model.safetensors cannot be read"),
        ([str(damaged["spm"]), f"output={tmp_path / 'x'}"], "source.spm holds no pieces"),
        ([str(damaged["vocab"]), f"output={tmp_path / 'x'}"], "vocab.json holds a list, not an object"),
        ([str(damaged["config"]), f"output={tmp_path / 'x'}"], "lacks 'd_model'"),
    ):
        with pytest.raises(SystemExit) as exited:
            import_model(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()  # nothing written for a refused import
    import_model([str(damaged["nameless"]), f"output={tmp_path / 'named'}", "src=de", "tgt=en"])
    assert (tmp_path / "named" / "model.ckpt").is_file()


@pytest.fixture(scope="module")
def pad_loving(opus_mt, tmp_path_factory):
    """(the OPUS-MT folder and model with <pad>'s output bias at +50, the most likely token at every step unless
    barred; the folder transformer.import_model wrote from it)."""
    transformers = require_module("transformers", 'pip install -e ".[dev]"')
    folder, _, _ = opus_mt
    tmp = tmp_path_factory.mktemp("pad-loving")
    changed = shutil.copytree(folder, tmp / "opus-mt-de-en")
    model = transformers.MarianMTModel.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        model.final_logits_bias[0, model.config.pad_token_id] = 50.0
    model.save_pretrained(changed)
    import_model([str(changed), f"output={tmp / 'imported'}"])
    return changed, model, tmp / "imported"


def test_pad_is_never_generated_by_greedy_beam_sampling_or_the_export(pad_loving, tmp_path):
    from transformer.export.__main__ import export
    from transformer.translators import CTranslate2Translator

    folder, model, imported = pad_loving
    translator = CheckpointTranslator.from_path(str(imported / "model.ckpt"))
    pad = translator.tgt_tokenizer.pad_id
    texts = lines("de", "val", 16, skip=100)
    ids = translator.src_tokenizer.encode(texts)
    searches = [
        SearchConfig(beam_size=1, max_len_a=0, max_len_b=LIMIT),
        SearchConfig(beam_size=4),
        SearchConfig(beam_size=1, sampling_topk=-1),
    ]
    found = {
        search: [h.tokens for hyps in translator.search(ids, search, nbest=1) for h in hyps] for search in searches
    }
    assert all(pad not in tokens for hypotheses in found.values() for tokens in hypotheses)
    # greedy bars it as generate does, given OPUS-MT's generation config: bad_words_ids=[[<pad>]]
    assert found[searches[0]] == generated(model, marian_tokenizer(folder), texts, 1, bad_words_ids=[[pad]])
    (tmp_path / "src.txt").write_text("\n".join(texts) + "\n")
    config = OmegaConf.create({**asdict(ExportConfig(ckpt_path=str(imported / "model.ckpt"))),
                               "output": str(tmp_path / "ct2"), "parity_input": str(tmp_path / "src.txt")})  # fmt: skip
    exported, failure = export(config)
    assert failure is None  # CTranslate2 bars <pad> as our searches do: the same hypotheses, greedy and beam 5
    engine = CTranslate2Translator(exported)
    hypotheses = engine.searcher.nbest(ids, searches[1], 1)
    assert all(pad not in tokens for hyps in hypotheses for _, tokens in hyps)
    for search in (searches[0], replace(searches[1], early_stopping=True)):  # the folder's translator, as served
        assert engine.translate(texts, search) == translator.translate(texts, search)


def test_the_export_decodes_no_further_than_the_models_positions(opus_mt, tmp_path):
    """128 positions, and a max-length rule that allows more: CTranslate2 has no position beyond the table, so its
    limit is the model's, as ours is."""
    from transformer.export.__main__ import export
    from transformer.translators import CTranslate2Translator

    _, _, imported = opus_mt
    config = OmegaConf.create({**asdict(ExportConfig(ckpt_path=str(imported / "model.ckpt"))),
                               "output": str(tmp_path / "ct2"), "max_len_a": 20.0, "beam_size": 1})  # fmt: skip
    exported, failure = export(config)  # gated on the checkpoint's test split: Multi30k's
    assert failure is None
    translator = CheckpointTranslator.from_path(str(imported / "model.ckpt"))
    texts = lines("de", "val", 8, skip=100)
    search = SearchConfig(beam_size=1, max_len_a=20.0)
    assert CTranslate2Translator(exported).translate(texts, search) == translator.translate(texts, search)


def write_multi30k_sample(folder: Path) -> Path:
    """400 training pairs of Multi30k (not those the model was trained on), 40 val, 40 test: a domain's corpus."""
    folder.mkdir(parents=True, exist_ok=True)
    for lang in ("de", "en"):
        for split, n, skip in (("train", 400, 5000), ("val", 40, 0), ("test", 40, 0)):
            corpus_split = "test_2016_flickr" if split == "test" else split
            (folder / f"{split}.{lang}").write_text("\n".join(lines(lang, corpus_split, n, skip)) + "\n")
    return folder


def fine_tuning(imported: Path, corpus: Path, cache: Path) -> list[str]:
    return [f"init_from={imported}", f"data.path={corpus}", f"data.cache_dir={cache}", "data.test_split=test",
            "data.max_length=100", "data.max_tokens=600", "model.dropout=0.0", "optim.lr=0.003",
            "optim.warmup_steps=4", "optim.ema_decay=0.99", "trainer.precision=32-true", "trainer.max_steps=12",
            "trainer.val_check_interval=6", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
            "validation.bleu_max_sentences=8", *RECORD]  # fmt: skip


@pytest.fixture(scope="module")
def fine_tuned(opus_mt, tmp_path_factory):
    """(the imported folder, the corpus, A: 12 steps of fine-tuning uninterrupted, B: the same stopped by SIGTERM in
    step 7 and resumed with ckpt_path=last, the module's temporary folder)."""
    _, _, imported = opus_mt
    tmp = tmp_path_factory.mktemp("fine-tuning")
    corpus = write_multi30k_sample(tmp / "corpus")
    common = fine_tuning(imported, corpus, tmp / "cache")
    a = run_train(tmp / "a", common)
    with pytest.raises(SystemExit):
        run_train(tmp / "b", [*common, "+callbacks.signal_at._target_=tests.helpers.runs.SignalAt",
                              "+callbacks.signal_at.step=6"])  # fmt: skip
    b = run_train(tmp / "b", [*common, "ckpt_path=last"])
    return imported, corpus, a, b, tmp


def held_out_loss(checkpoint: Path, corpus: Path) -> float:
    """Cross-entropy per target token of the corpus's val pairs, teacher-forced, with the checkpoint's model."""
    translator = CheckpointTranslator.from_path(str(checkpoint))
    src_tok, tgt_tok = translator.src_tokenizer, translator.tgt_tokenizer
    sources = src_tok.encode((corpus / "val.de").read_text().splitlines())
    targets = tgt_tok.encode((corpus / "val.en").read_text().splitlines())
    pad = torch.nn.utils.rnn.pad_sequence
    src = pad([torch.tensor(s + [src_tok.eos_id]) for s in sources], True, src_tok.pad_id)  # (B, S)
    tgt_in = pad([torch.tensor([tgt_tok.bos_id, *t]) for t in targets], True, tgt_tok.pad_id)  # (B, T)
    labels = pad([torch.tensor([*t, tgt_tok.eos_id]) for t in targets], True, -100)  # (B, T)
    with torch.no_grad():
        logits = translator.model(src, tgt_in)  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()


def test_fine_tuning_starts_from_the_imported_model_lowers_the_loss_and_resumes_exactly(fine_tuned):
    imported, corpus, a, b, tmp = fine_tuned
    losses, resumed = callback(a, LossRecorder), callback(b, LossRecorder)
    steps = sorted(losses.losses)
    assert steps == list(range(1, 13)) and sorted(resumed.losses) == list(range(8, 13))
    before, after = (held_out_loss(path, corpus) for path in (imported / "model.ckpt", tmp / "a" / "checkpoints" /
                                                                   "last.ckpt"))  # fmt: skip
    assert after < before - 0.05, (before, after)
    for step, loss in resumed.losses.items():
        assert resumed.batches[step] == losses.batches[step] and loss == pytest.approx(losses.losses[step], rel=1e-6)
    for (name, p), q in zip(a.lightning_module.named_parameters(), b.lightning_module.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    imported_ckpt = torch.load(imported / "model.ckpt", weights_only=True)
    checkpoint = torch.load(tmp / "a" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["hyper_parameters"]["model"] == {**imported_ckpt["hyper_parameters"]["model"], "dropout": 0.0}
    assert checkpoint["tokenizers"] == imported_ckpt["tokenizers"] and "ema_state_dict" in checkpoint
    assert not list((tmp / "cache").rglob("*.model"))  # no vocabulary trained: the imported one encodes the corpus
    assert {p.read_bytes() for p in (tmp / "a" / "tokenizer").iterdir()} == set(imported_ckpt["tokenizers"].values())
    assert losses.losses[1] < 5.0  # from the imported weights: random ones of 443 pieces start near ln 443 = 6.1


def test_a_fine_tuned_model_averages_exports_through_the_gate_and_serves(fine_tuned, tmp_path):
    from fastapi.testclient import TestClient

    from transformer.config.serve import ServeConfig
    from transformer.export.__main__ import export
    from transformer.serve.__main__ import load_models
    from transformer.serve.app import create_app
    from transformer.training.averaging import average_checkpoints, checkpoints_in

    imported, corpus, _, _, tmp = fine_tuned
    averaged = average_checkpoints(checkpoints_in(tmp / "a" / "checkpoints", 2))
    torch.save(averaged, tmp_path / "average.pt")
    config = OmegaConf.create(
        {**asdict(ExportConfig(ckpt_path=str(tmp_path / "average.pt"))), "output": str(tmp_path / "ct2")}
    )  # fmt: skip  (gated on the corpus's test split)
    exported, failure = export(config)
    assert failure is None
    sources = (corpus / "test.de").read_text().splitlines()[:3]
    for path in (imported / "model.ckpt", exported):  # the imported model as it is, the fine-tuned one exported
        (model,) = load_models(ServeConfig(models=[str(path)]))
        with TestClient(create_app([model], ServeConfig(models=[model.path]))) as api:
            answer = api.post("/translate", json={"q": sources, "source": "de", "target": "en"})
        assert answer.status_code == 200
        assert answer.json()["translatedText"] == model.translator.translate(sources, SearchConfig(beam_size=4))


@pytest.mark.parametrize(
    "overrides, message",
    [(["model.d_model=64"], "model.d_model=64 but init_from="),
     (["data.src=en", "data.tgt=de"], "translates de->en, but data.src=en data.tgt=de"),
     (["init_from=/nonexistent"], "init_from=/nonexistent: no such checkpoint")],
)  # fmt: skip
def test_init_from_refuses_what_cannot_start_from_the_model_in_one_line(opus_mt, overrides, message, tmp_path):
    from .helpers.runs import run_command

    _, _, imported = opus_mt
    result = run_command(f"init_from={imported}", f"hydra.run.dir={tmp_path / 'run'}", "data.max_length=100",
                         *overrides)  # fmt: skip
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1, (
        result.stderr[-2000:])  # fmt: skip


def test_train_ckpt_path_on_an_imported_model_starts_from_its_weights(opus_mt, tmp_path):
    _, _, imported = opus_mt
    corpus = write_multi30k_sample(tmp_path / "corpus")
    options = [o for o in fine_tuning(imported, corpus, tmp_path / "cache") if not o.startswith("init_from")]
    trainer = run_train(tmp_path / "run", [*options, f"ckpt_path={imported / 'model.ckpt'}", "trainer.max_steps=2"])
    assert trainer.global_step == 2 and callback(trainer, LossRecorder).losses[1] < 5.0  # the imported weights
    assert (tmp_path / "run" / "tokenizer" / "spm.de.model").read_bytes() == (
        imported / "tokenizer" / "spm.de.model").read_bytes()  # fmt: skip
    # resumed without init_from: the run's checkpoint names its tokenizer, which encodes the corpus again
    resumed = run_train(tmp_path / "run", [*options, "ckpt_path=last", "trainer.max_steps=3"])
    assert resumed.global_step == 3 and sorted(callback(resumed, LossRecorder).losses) == [3]


@pytest.mark.parametrize(
    "ckpt_path, overrides, message",
    [("average", [], "would overwrite"), ("imported", ["init_from=x"], "init_from=x is given too; give one")],
)  # fmt: skip
def test_a_weights_only_ckpt_path_is_refused_where_it_cannot_start(opus_mt, ckpt_path, overrides, message, tmp_path):
    from .helpers.runs import run_command

    _, _, imported = opus_mt
    path = imported / "model.ckpt"
    if ckpt_path == "average":  # an average in a run's checkpoints/, which hydra.run.dir follows
        (tmp_path / "run" / "checkpoints").mkdir(parents=True)
        path = shutil.copy(path, tmp_path / "run" / "checkpoints" / "average.pt")
    result = run_command(f"ckpt_path={path}", "data.max_length=100", *overrides)
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1, (
        result.stderr[-2000:])  # fmt: skip
    if ckpt_path == "average":  # refused before Hydra wrote the refused command's config into that run's folder
        assert not (tmp_path / "run" / ".hydra").exists()


def test_data_tokenizer_encodes_with_given_models_and_refuses_unusable_ones(opus_mt, tmp_path):
    from transformer.data import DataConfig, DataError
    from transformer.data.prepare import prepare_data

    from .helpers.marian import train_spm

    _, _, imported = opus_mt
    corpus = write_multi30k_sample(tmp_path / "corpus")
    given = DataConfig(path=str(corpus), test_split="test", max_length=100, cache_dir=str(tmp_path / "cache"),
                       tokenizer=str(imported / "tokenizer"))  # fmt: skip
    prepared = prepare_data(given)
    assert not list((tmp_path / "cache").rglob("*.model"))  # nothing trained
    sources = (corpus / "val.de").read_text().splitlines()
    assert list(prepared.splits["val"]["src_ids"]) == prepared.src_tokenizer.encode(sources)
    assert prepared.src_tokenizer.path == imported / "tokenizer" / "spm.de.model"
    bad = tmp_path / "bad"
    bad.mkdir()
    train_spm(lines("de") + lines("en"), bad / "spm")  # Marian's own: no pad piece
    for folder, message in ((tmp_path / "none", "holds neither spm.model nor both spm.de.model and spm.en.model"),
                            (bad, "has no pad piece, which batches need")):  # fmt: skip
        with pytest.raises(DataError) as refused:
            prepare_data(replace(given, tokenizer=str(folder)))
        assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_model_with_separate_vocabularies_imports_its_logits_and_ids_as_transformers(tmp_path):
    """target_vocab.json beside vocab.json (tokenizer_config.json: separate_vocabs): two embedding tables, each
    side's ids its own vocabulary's. Random weights: teacher-forced logits need no trained model."""
    transformers = require_module("transformers", 'pip install -e ".[dev]"')
    from .helpers.marian import train_spm

    folder = tmp_path / "opus-mt-de-en"
    folder.mkdir()
    vocabs = {}
    for side, lang, name in (("source", "de", "vocab.json"), ("target", "en", "target_vocab.json")):
        model = train_spm(lines(lang), tmp_path / side, vocab_size=200 if side == "source" else 180)
        (folder / f"{side}.spm").write_bytes(model.read_bytes())
        sp = spm.SentencePieceProcessor(model_file=str(model))
        vocab = {"</s>": 0, "<unk>": 1, "<pad>": 2}  # <pad> at one id in both, as the model has one pad_token_id
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                vocab[sp.id_to_piece(i)] = len(vocab)
        (folder / name).write_text(json.dumps(vocab, ensure_ascii=False))
        vocabs[side] = vocab
    (folder / "tokenizer_config.json").write_text(json.dumps({"separate_vocabs": True, "source_lang": "de",
                                                              "target_lang": "en"}))  # fmt: skip
    torch.manual_seed(0)
    theirs = transformers.MarianMTModel(transformers.MarianConfig(**{
        **SETTINGS, "vocab_size": len(vocabs["source"]), "decoder_vocab_size": len(vocabs["target"]),
        "share_encoder_decoder_embeddings": False, "pad_token_id": 2, "decoder_start_token_id": 2})).eval()  # fmt: skip
    theirs.save_pretrained(folder)
    import_model([str(folder), f"output={tmp_path / 'imported'}"])
    translator = CheckpointTranslator.from_path(str(tmp_path / "imported" / "model.ckpt"))
    assert not translator.model_config.share_embeddings
    tokenizer = marian_tokenizer(folder)
    texts, targets = lines("de", "val", 50), lines("en", "val", 50)
    src = [x[:-1] for x in tokenizer(texts)["input_ids"]]
    tgt = [x[:-1] for x in tokenizer(text_target=targets)["input_ids"]]
    assert translator.src_tokenizer.encode(texts) == src and translator.tgt_tokenizer.encode(targets) == tgt
    pad = torch.nn.utils.rnn.pad_sequence
    src_ids = pad([torch.tensor(s + [0]) for s in src[:4]], True, 2)  # (4, S) with </s>
    tgt_ids = pad([torch.tensor([2, *t]) for t in tgt[:4]], True, 2)  # (4, T) from <pad>, the decoder's start
    with torch.no_grad():
        want = theirs(input_ids=src_ids, attention_mask=src_ids.ne(2), decoder_input_ids=tgt_ids).logits
        got = translator.model(src_ids, tgt_ids)
    real = tgt_ids.ne(2)
    real[:, 0] = True
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)  # padded positions: either's own


def test_a_hub_name_downloads_the_safetensors_weights_and_tokenizer_files_only(opus_mt, monkeypatch):
    """No download here: huggingface_hub's two calls are stood in for, and what they are asked is checked."""
    import huggingface_hub

    from transformer.import_model import local_folder

    folder, _, _ = opus_mt
    asked = {}

    def snapshot_download(name, allow_patterns):
        asked[name] = allow_patterns
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda name: ["model.safetensors", "pytorch_model.bin",
                                                                           "tf_model.h5", "vocab.json"])  # fmt: skip
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert local_folder("Helsinki-NLP/opus-mt-de-en") == folder
    patterns = asked["Helsinki-NLP/opus-mt-de-en"]
    assert "model.safetensors" in patterns and not {"pytorch_model.bin", "tf_model.h5"} & set(patterns)
    assert {"config.json", "source.spm", "target.spm", "vocab.json"} <= set(patterns)


@pytest.mark.slow  # two DDP ranks in subprocesses
def test_fine_tuning_from_the_imported_model_runs_under_ddp(opus_mt, tmp_path):
    from .helpers.runs import run_command

    _, _, imported = opus_mt
    corpus = write_multi30k_sample(tmp_path / "corpus")
    options = [o for o in fine_tuning(imported, corpus, tmp_path / "cache") if o not in RECORD]
    result = run_command(*options, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=4",
                         "trainer.val_check_interval=2", f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MEMBER: 2/2" in result.stderr + result.stdout
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 4
    before = held_out_loss(imported / "model.ckpt", corpus)
    assert held_out_loss(tmp_path / "run" / "checkpoints" / "last.ckpt", corpus) < before


@pytest.mark.slow  # inductor compiles the forward and backward: about a minute on 2 cores
def test_a_compiled_bf16_fine_tuning_starts_from_the_imported_weights(opus_mt, tmp_path):
    """compile=true compiles the model after init_from's weights are in it: its checkpoint keeps the plain names, and
    the held-out loss falls from the imported model's."""
    _, _, imported = opus_mt
    corpus = write_multi30k_sample(tmp_path / "corpus")
    options = [o for o in fine_tuning(imported, corpus, tmp_path / "cache") if o != "trainer.precision=32-true"]
    run_train(tmp_path / "run", [*options, "compile=true", "data.length_rungs=8", "trainer.precision=bf16-mixed",
                                 "trainer.limit_val_batches=0", "optim.ema_decay=null"])  # fmt: skip
    torch._dynamo.reset()
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    names = torch.load(last, weights_only=True)["state_dict"].keys()
    assert names == torch.load(imported / "model.ckpt", weights_only=True)["state_dict"].keys()
    assert held_out_loss(last, corpus) < held_out_loss(imported / "model.ckpt", corpus)
