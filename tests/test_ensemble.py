"""Several checkpoints decoding as one (ckpt_path=[a,b]): at every step the mean of the models' log-probabilities,
each model with its own key/value caches, in greedy and beam search, n-best too."""

import io
import json

import pytest
import sentencepiece as spm
import torch

from transformer import evaluate
from transformer.translators import SearchConfig, open_translator

from .helpers import compose_command


@pytest.fixture(scope="module")
def checkpoints(trained, tmp_path_factory):
    """The trained checkpoint; a second with its tokenizers and other weights (the first's, with noise), so that
    the two disagree; and a third with another target tokenizer."""
    tmp, _, ckpt = trained
    folder = tmp_path_factory.mktemp("ensemble")
    checkpoint = torch.load(ckpt, weights_only=True)
    generator = torch.Generator().manual_seed(0)
    state = checkpoint["state_dict"]
    for name, value in state.items():
        if value.is_floating_point():
            state[name] = value + 0.3 * value.std() * torch.randn(value.shape, generator=generator)
    torch.save(checkpoint, folder / "noisy.ckpt")
    words = (tmp / "c" / "train.en").read_text().splitlines()
    other = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(words), model_writer=other, vocab_size=40,
                                   model_type="unigram", minloglevel=2)  # fmt: skip
    checkpoint["tokenizers"]["tgt"] = other.getvalue()
    torch.save(checkpoint, folder / "other_vocabulary.ckpt")
    sources = (tmp / "c" / "test.de").read_text().splitlines()[:12]
    return str(ckpt), str(folder / "noisy.ckpt"), str(folder / "other_vocabulary.ckpt"), sources


@pytest.mark.parametrize("search", [SearchConfig(beam_size=1), SearchConfig(beam_size=4, length_penalty=0.6)])
def test_an_ensemble_of_a_model_with_itself_is_that_model(checkpoints, search):
    ckpt, _, _, sources = checkpoints
    alone, twice = open_translator(ckpt), open_translator([ckpt, ckpt])
    nbest = min(3, search.beam_size)
    found, want = twice.translate_nbest(sources, search, nbest), alone.translate_nbest(sources, search, nbest)
    assert [[t for _, t in hyps] for hyps in found] == [[t for _, t in hyps] for hyps in want]
    scores = lambda nbest: [s for hyps in nbest for s, _ in hyps]  # noqa: E731
    assert scores(found) == pytest.approx(scores(want), abs=1e-5, nan_ok=True)  # greedy's: nan, unscored


def teacher_forced_score(models, src: torch.Tensor, tokens: list[int], bos: int, eos: int, penalty: float,
                         barred: tuple[int, ...]) -> float:  # fmt: skip
    """A finished hypothesis's score from whole-sequence forwards, no caches: per step, the log-softmax of the mean
    of the models' log-probabilities over the tokens a translation may hold (not `barred`), summed over its tokens
    and EOS, over length ** penalty."""
    tgt_in = torch.tensor([[bos, *tokens]])  # (1, T)
    with torch.no_grad():
        mean = torch.stack([torch.log_softmax(m(src, tgt_in).float(), -1) for m in models]).mean(0)  # (1, T, V)
    lprobs = torch.log_softmax(mean.index_fill(-1, torch.tensor(barred), float("-inf")), -1)[0]  # (T, V)
    steps, targets = torch.arange(len(tokens) + 1), torch.tensor([*tokens, eos])
    return lprobs[steps, targets].sum().item() / (len(tokens) + 1) ** penalty


def test_beam_scores_are_the_averaged_log_probabilities_of_each_hypothesis(checkpoints):
    """Two models that disagree: every n-best hypothesis scores what the models, run on it without caches, give it;
    so each model's cache followed the beams it was reordered into."""
    ckpt, noisy, _, sources = checkpoints
    ensemble, first, second = open_translator([ckpt, noisy]), open_translator(ckpt), open_translator(noisy)
    search = SearchConfig(beam_size=4, length_penalty=0.6)
    assert first.translate(sources, search) != second.translate(sources, search)  # they disagree
    ids = ensemble.src_tokenizer.encode(sources)
    found = ensemble.search(ids, search, nbest=3)
    bos, eos = ensemble.tgt_tokenizer.bos_id, ensemble.tgt_tokenizer.eos_id
    checked = 0
    for source, hypotheses in zip(ids, found):
        src = torch.tensor([source + [ensemble.src_tokenizer.eos_id]])  # (1, S)
        limit = int(search.max_len_a * len(src[0]) + search.max_len_b)
        for hypothesis in hypotheses:
            if len(hypothesis.tokens) < limit:  # ended with EOS
                want = teacher_forced_score(ensemble.model.models, src, hypothesis.tokens, bos, eos, 0.6,
                                            ensemble.tgt_tokenizer.barred_ids)  # fmt: skip
                assert hypothesis.score == pytest.approx(want, abs=1e-4)
                checked += 1
    assert checked >= 30
    uncached = ensemble.search(ids, SearchConfig(beam_size=4, length_penalty=0.6, use_cache=False), nbest=3)
    assert [[h.tokens for h in hs] for hs in uncached] == [[h.tokens for h in hs] for hs in found]


def test_models_with_other_tokenizers_are_refused_in_one_line(checkpoints):
    ckpt, _, other, _ = checkpoints
    with pytest.raises(ValueError, match=r"^ckpt_path: .*other_vocabulary.ckpt has another tgt tokenizer than "):
        open_translator([ckpt, other])
    with pytest.raises(ValueError, match=r"^ckpt_path=\[\] must be a checkpoint's path, or a list of them"):
        open_translator([])


def test_evaluate_takes_a_list_of_checkpoints(checkpoints, tmp_path, capsys):
    ckpt, noisy, _, _ = checkpoints
    cfg = compose_command("evaluate", [f"ckpt_path=[{ckpt},{noisy}]", "split=test", "beam_size=2"], tmp_path)
    evaluate.main(cfg)
    scores = json.loads((tmp_path / "test.beam2.json").read_text())
    assert scores["checkpoint"] == [ckpt, noisy] and scores["sentences"] == 48
    assert capsys.readouterr().out.startswith("BLEU|")
