"""The training step's forward and backward compile as one graph: nothing in the hot path waits on the device (a
sync, a data-dependent shape or branch would break the graph, and fullgraph=True makes that an error)."""

import copy
import functools
import pickle
from collections import Counter
from unittest import mock

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import aot_module_simplified
from torch._inductor.decomposition import select_decomp_table

from common.kernel_calls import synthetic_batch
from transformer.data import TranslationDataModule
from transformer.data.batching import padded_length
from transformer.model import ModelConfig, RuntimeConfig, build_model, cross_entropy
from transformer.model.activation import ReLU
from transformer.model.compiling import compile_dynamic
from transformer.model.layers import FeedForward
from transformer.model.loss import batch_loss_sum

from .helpers import RECORD, LossRecorder, callback, config, run_train, tiny_data, write_text_corpus

V = 23


def collated(src_lengths: list[int], tgt_lengths: list[int], seed: int = 0) -> dict:
    return synthetic_batch(V, src_lengths, tgt_lengths, seed)  # pad 0, BOS 1, EOS 2


def test_collator_gives_the_host_values_the_step_needs():
    batch = collated([5, 3, 7], [4, 6, 2])
    assert batch["src_lengths"].tolist() == batch["src"].ne(0).sum(1).tolist() == [6, 4, 8]  # with EOS
    assert batch["src_tokens"] == int(batch["src"].ne(0).sum()) and batch["tgt_tokens"] == int(
        batch["tgt_out"].ne(0).sum()
    )
    assert batch["src_padded"] is True and collated([4, 4], [2, 3])["src_padded"] is False
    assert all(type(batch[k]) is int for k in ("src_tokens", "tgt_tokens"))  # not tensors: they stay on the host


# One layer each way: what breaks a graph is in the layer's code, which every layer of a deeper model runs again, and
# tracing cost grows with the layers
ONE_LAYER = dict(n_encoder_layers=1, n_decoder_layers=1)


def check_compiled_training_step_equals_eager(backend: str, checkpointed: bool = False,
                                              rdrop_alpha: float | None = None) -> None:  # fmt: skip
    """The model compiled as training compiles it, over two batches of other sizes: one graph, equal to eager. With
    dropout: a compiled CPU model draws the same masks from the same generator, in the same order, as eager, and its
    backward reuses them (a mask drawn again would give other gradients). With rdrop_alpha, R-Drop's loss."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_size("tiny", src_vocab_size=V, tgt_vocab_size=V, pad_id=0, dropout=0.2,
                                activation_dropout=0.1, **ONE_LAYER)  # fmt: skip
    eager = build_model(cfg, RuntimeConfig(activation_checkpointing=checkpointed)).train()
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    compile_dynamic(compiled, fullgraph=True, backend=backend)
    eager_loss = mock.patch.object(cross_entropy, "eager_only", True)  # no graph of its own: the model's are counted
    for seed, batch in enumerate((collated([5, 3, 7], [4, 6, 2]), collated([9, 2, 4, 6, 8], [3, 7, 5, 5, 1], seed=1))):
        assert batch["src_padded"]
        results = []
        for model in (eager, compiled):
            model.zero_grad()
            torch.manual_seed(seed)
            with eager_loss:
                value, _ = batch_loss_sum(model, batch, 0.1, rdrop_alpha)
            value.backward()
            results.append((value.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
        (want, want_grads), (got, got_grads) = results
        torch.testing.assert_close(got, want)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, msg=name)
    assert counters["stats"]["unique_graphs"] == 1  # the second batch's sizes reused the first trace


def test_training_forward_and_backward_capture_as_one_graph():
    """Dynamo and AOTAutograd (forward and backward graphs) without inductor's C++ compilation: fast."""
    check_compiled_training_step_equals_eager("aot_eager")


def test_rdrop_training_compiles_as_one_graph():
    """R-Drop's two passes and its loss are the same graph as the plain step's: model.loss, compiled."""
    check_compiled_training_step_equals_eager("aot_eager", rdrop_alpha=5.0)


def test_activation_checkpointing_compiles_as_one_graph():
    """Eager checkpointing recomputes inside the forward's kernel order (a context_fn), which dynamo refuses: a
    compiled model checkpoints without it, traced whole; its recomputed dropout masks are the forward's."""
    check_compiled_training_step_equals_eager("aot_eager", checkpointed=True)


@pytest.mark.slow  # inductor compiles C++ kernels: about a minute on 2 cores
@pytest.mark.parametrize("rdrop_alpha", [None, 5.0], ids=["cross-entropy", "r-drop"])
def test_training_forward_and_backward_compile_with_inductor(rdrop_alpha):
    check_compiled_training_step_equals_eager("inductor", rdrop_alpha=rdrop_alpha)


class CompiledGraphs(pl.Callback):
    """Dynamo's count of graphs (a recompile adds one) and graph breaks, read when training ends."""

    def on_train_end(self, trainer, module):
        self.graphs = counters["stats"]["unique_graphs"]
        self.breaks = sum(counters["graph_break"].values())


def test_a_copy_of_a_compiled_model_computes_its_loss_with_its_own_weights():
    """compile_dynamic keeps the compiled loss on the model, bound to it: a deep copy (or a pickle) must not carry it,
    or the copy's loss would run on the original's weights."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_size("tiny", src_vocab_size=V, tgt_vocab_size=V, pad_id=0, dropout=0.0, **ONE_LAYER)
    model = build_model(cfg).train()
    compile_dynamic(model, backend="eager")
    copied, unpickled = copy.deepcopy(model), pickle.loads(pickle.dumps(model))
    batch = collated([5, 3, 7], [4, 6, 2])
    for other in (copied, unpickled):
        with torch.no_grad():
            other.output.weight.mul_(2)
        assert batch_loss_sum(other, batch, 0.1)[0] != batch_loss_sum(model, batch, 0.1)[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """3,000 pairs, encoded once for the module: batches of many sizes."""
    folder = tmp_path_factory.mktemp("compile")
    write_text_corpus(folder / "c", {"train": 3000, "val": 20, "test": 20})
    return folder / "c", folder / "cache"


def test_a_compiled_run_recompiles_a_bounded_number_of_times(tmp_path, monkeypatch, corpus):
    """100 steps of batches whose every size differs (40 shapes here), validated every 25 steps: one graph per kind
    of batch (padded sources or not) and grad mode, whatever the sizes; no graph break, which would run the rest of
    the forward uncompiled. Dynamo's tracing alone (backend eager): recompiles are decided before any backend."""
    compile_eagerly = functools.partial(torch.compile, backend="eager")
    monkeypatch.setattr(torch, "compile", compile_eagerly)
    torch._dynamo.reset()
    counters.clear()
    trainer = run_train(tmp_path / "run", [*tiny_data(*corpus), "model=tiny", "model.n_encoder_layers=1",
                                           "model.n_decoder_layers=1", "compile=true", "data.max_tokens=600",
                                           "trainer.max_steps=100", "trainer.val_check_interval=25", "validation.bleu_every=0",
                                           "trainer.precision=32", "trainer.enable_progress_bar=false", "~logger",
                                           "+callbacks.graphs._target_=tests.test_compile.CompiledGraphs"])  # fmt: skip
    seen = callback(trainer, CompiledGraphs)
    assert trainer.global_step == 100
    assert seen.breaks == 0 and seen.graphs <= 4, (seen.graphs, seen.breaks)
    assert counters["frames"]["ok"] == counters["frames"]["total"]  # no frame left to run uncompiled


def ladder(rungs: int, top: int = 128) -> set[int]:
    """The ladder as padded_length's docstring states it: every length up to `rungs`, then octave by octave with the
    rungs twice as far apart (16: even lengths to 32, multiples of 4 to 64, of 8 to 128)."""
    lengths, step = set(range(1, rungs + 1)), 1
    while max(lengths) < top:
        step *= 2
        lengths |= set(range(rungs * step // 2 + step, rungs * step + 1, step))
    return lengths


LADDER_16 = {*range(1, 17), *range(18, 33, 2), *range(36, 65, 4), *range(72, 129, 8)}  # the recipe's, written out


def test_padded_length_is_the_next_rung_of_the_ladder():
    assert [padded_length(n, 16) for n in (1, 16, 17, 18, 33, 36, 37, 65, 127)] == [1, 16, 18, 18, 36, 36, 40, 72, 128]
    assert [padded_length(n, 4) for n in (4, 5, 7, 9, 13)] == [4, 6, 8, 12, 16] and padded_length(17, None) == 17
    assert padded_length(np.array([17, 5]), 16).tolist() == [18, 5]
    assert ladder(16) == LADDER_16
    assert all({padded_length(n, rungs) for n in range(1, 129)} == ladder(rungs) for rungs in (4, 16))


def test_length_rungs_bound_the_batch_shapes_which_compile_as_one_graph(tmp_path, corpus):
    """data.length_rungs: every batch (B, L, L), L a rung of the ladder, and the loss at all B * L target positions,
    so that no shape follows the number of real tokens. Over 3 epochs, at most two shapes per rung (its full batches,
    and the one left when the next rung begins; an epoch's lengths are the same every epoch), traced as one graph."""
    rungs = 4
    data = TranslationDataModule(config(corpus[0], tmp_path, max_tokens=600, cache_dir=str(corpus[1]),
                                        length_rungs=rungs))  # fmt: skip
    tok = data.src_tokenizer
    cfg = ModelConfig.from_size("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size,
                                pad_id=tok.pad_id, **ONE_LAYER)  # fmt: skip
    model = build_model(cfg).train()
    torch._dynamo.reset()
    counters.clear()
    compile_dynamic(model, backend="eager")
    loader, shapes = data.train_dataloader(), Counter()
    for epoch in range(3):
        loader.batch_sampler.set_epoch(epoch)
        for batch in loader:
            B, L = batch["src"].shape
            assert batch["tgt_in"].shape == (B, L) and L in ladder(rungs), L  # a rung of this ladder, not any length
            assert batch["tgt_positions"].shape == batch["tgt_labels"].shape == (B * L,)
            shapes[(B, L)] += 1
            batch_loss_sum(model, batch, 0.1)[0].backward()
    assert len(shapes) <= 2 * len({L for _, L in shapes}) < len(loader) * 3, shapes
    assert counters["stats"]["unique_graphs"] == 1 and sum(counters["graph_break"].values()) == 0


def test_compile_with_padding_free_attention_is_refused_before_the_data(tmp_path):
    """Nested tensors' lengths are read on the host inside attention: a graph break at every layer (36 and 32 graphs
    in the 200 steps above at a5a9816), so the pair is refused in one line."""
    with pytest.raises(ValueError, match=r"^compile=true with runtime.padding_free_attention=true breaks"):
        run_train(tmp_path / "run", [*tiny_data(tmp_path / "c", tmp_path / "cache"), "compile=true",
                                     "runtime.padding_free_attention=true"])  # fmt: skip
    assert not (tmp_path / "cache").exists()


def test_the_masks_of_changing_batches_trace_without_a_graph_break(tmp_path, corpus):
    """The model's loss compiled with torch.compile's defaults (static shapes first, dynamic after a change), over the
    batch order that broke the graph at a5a9816: key_padding checked the padding mask against the lengths' batch size,
    a size the compiler could not prove equal, so that forward fell back to eager."""
    data = TranslationDataModule(config(corpus[0], tmp_path, max_tokens=600, cache_dir=str(corpus[1])))
    tok = data.src_tokenizer
    cfg = ModelConfig.from_size(
        "tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, pad_id=tok.pad_id, **ONE_LAYER
    )
    model = build_model(cfg).train()
    torch._dynamo.reset()
    counters.clear()
    model.loss = torch.compile(model.loss, backend="eager")
    for batch, _ in zip(data.train_dataloader(), range(40)):
        batch_loss_sum(model, batch, 0.1)[0].backward()
    assert sum(counters["graph_break"].values()) == 0 and counters["frames"]["ok"] == counters["frames"]["total"]


@pytest.mark.slow  # inductor compiles each run's forward and backward: about 2 minutes on 2 cores
def test_a_compiled_run_resumed_compiled_continues_exactly(tmp_path, corpus):
    """Inductor's dropout draws from the generator ExactResume restores: a compiled run stopped by SIGTERM during
    step 6 and resumed compiled trains steps 7-12 as the uninterrupted compiled run did (bounded shapes, dropout on)."""
    common = [*tiny_data(*corpus), "model=tiny", "model.n_encoder_layers=1", "model.n_decoder_layers=1",
              "model.dropout=0.3", "compile=true", "data.length_rungs=8", "data.max_tokens=600", "trainer.max_steps=12",
              "trainer.limit_val_batches=0", "trainer.precision=32", "~logger", "trainer.enable_progress_bar=false",
              *RECORD]  # fmt: skip
    whole = run_train(tmp_path / "whole", common)
    with pytest.raises(SystemExit):
        run_train(tmp_path / "stopped", [*common, "+callbacks.signal_at._target_=tests.helpers.runs.SignalAt",
                                         "+callbacks.signal_at.step=5"])  # fmt: skip
    torch._dynamo.reset()  # as a new process starts: nothing compiled
    resumed = run_train(tmp_path / "stopped", [*common, "ckpt_path=last"])
    want, got = callback(whole, LossRecorder), callback(resumed, LossRecorder)
    assert sorted(got.losses) == list(range(7, 13))
    for step, loss in got.losses.items():
        assert got.batches[step] == want.batches[step] and loss == pytest.approx(want.losses[step], rel=1e-6), step
    for (name, p), q in zip(whole.lightning_module.named_parameters(), resumed.lightning_module.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["compile_mode=reduce-overhead"], r"^compile_mode=reduce-overhead without compile=true compiles nothing"),
        (["compile=true", "compile_mode=fast"], r"^compile_mode=fast is not one of default, reduce-overhead"),
        (["compile=true", "compile_mode=reduce-overhead"], r"records a CUDA graph for every batch shape.*length_rungs"),
    ],
)  # fmt: skip
def test_compile_modes_that_cannot_work_are_refused_before_the_data(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        run_train(tmp_path / "run", [*tiny_data(tmp_path / "c", tmp_path / "cache"), *overrides])
    assert not (tmp_path / "cache").exists()


def saved_for_backward(module: torch.nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """What a compiled module's forward saves for its backward (fake tensors: dtype and shape), split as inductor
    splits it (its decompositions, the min-cut partitioner), the C++ compilation left out."""
    saved = []

    def forward_compiler(graph, _):
        outputs = next(node for node in graph.graph.nodes if node.op == "output").args[0]
        saved.extend(node.meta["val"] for node in outputs if isinstance(node.meta.get("val"), torch.Tensor))
        return make_boxed_func(graph.forward)

    def backend(graph, example_inputs):
        return aot_module_simplified(graph, example_inputs, fw_compiler=forward_compiler,
                                     bw_compiler=lambda g, _: make_boxed_func(g.forward),
                                     partition_fn=min_cut_rematerialization_partition,
                                     decompositions=select_decomp_table())  # fmt: skip

    torch._dynamo.reset()
    torch.compile(module, backend=backend, fullgraph=True)(*inputs).sum().backward()
    return saved[1:]  # after the forward's own output


def test_a_compiled_cpu_feed_forward_block_saves_no_bool_mask():
    """Inductor stores CPU bools element by element (torch 2.13): relu's mask and dropout's are not to be saved."""
    cfg = ModelConfig.from_size("tiny", src_vocab_size=V, tgt_vocab_size=V, pad_id=0, activation_dropout=0.1)
    block = FeedForward(cfg).train()
    x = torch.randn(3, 5, cfg.d_model, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        dtypes = [t.dtype for t in saved_for_backward(block, x)]
    assert torch.bfloat16 in dtypes and torch.bool not in dtypes


def test_the_compiled_cpu_relu_has_relus_gradient_in_float64():
    x = torch.tensor([-2.0, -0.0, 0.0, 1e-300, 3.0], dtype=torch.float64).repeat(3).requires_grad_()
    grad = torch.randn(x.shape, dtype=torch.float64)
    torch._dynamo.reset()
    torch.compile(ReLU(), backend="aot_eager", fullgraph=True)(x).backward(grad)
    want = x.detach().clone().requires_grad_()
    torch.relu(want).backward(grad)
    assert torch.equal(x.grad, want.grad)


class OutputLoss(torch.nn.Module):
    def __init__(self, d: int, vocab: int, labels: torch.Tensor):
        super().__init__()
        self.output, self.labels = torch.nn.Linear(d, vocab, bias=False), labels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cross_entropy.linear_cross_entropy(x, self.output.weight, self.labels, 0.1, 0)


def test_the_compiled_loss_has_the_plain_losss_value_and_gradients_in_float64():
    """Compiled, the loss is the fused loss's formula (the loss and its gradient in the logits in forward): it has the
    plain loss's value, dtype and gradients."""
    torch.manual_seed(0)
    labels = torch.tensor([3, 0, 5, 7, 1, 9, 0])  # 0 is ignore_index: the pad's rows count for nothing
    plain = OutputLoss(16, 40, labels).double()
    compiled = copy.deepcopy(plain)
    x = torch.randn(7, 16, dtype=torch.float64)
    torch._dynamo.reset()
    compiled_x, plain_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = torch.compile(compiled, backend="aot_eager", fullgraph=True)(compiled_x)
    (got * 0.5).backward()  # a gradient from above that is not 1
    want = torch.nn.functional.cross_entropy(plain.output(plain_x), labels, ignore_index=0, label_smoothing=0.1,
                                             reduction="sum")  # fmt: skip
    (want * 0.5).backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(compiled_x.grad, plain_x.grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(compiled.output.weight.grad, plain.output.weight.grad, rtol=1e-12, atol=1e-15)


def test_the_compiled_loss_saves_no_logits_sized_tensor_for_backward():
    """Its gradients are computed in forward, as the eager loss's: backward scales them and computes nothing over
    tokens x vocabulary again (kept for backward instead, the logits' gradient was computed again there from the saved
    logits: a second pass over them)."""
    tokens, vocab = 64, 40
    loss = OutputLoss(16, vocab, torch.randint(1, vocab, (tokens,)))
    x = torch.randn(tokens, 16, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        saved = saved_for_backward(loss, x)
    assert saved and all(t.numel() < tokens * vocab for t in saved)


def test_the_compiled_bf16_loss_scales_its_gradient_by_the_gradient_from_above_unrounded():
    """Lightning divides the loss by accumulate_grad_batches: 1/3 rounded to bf16 first would scale every gradient by
    1.0018."""
    torch.manual_seed(0)
    labels = torch.randint(1, 40, (64,))
    loss = OutputLoss(16, 40, labels)
    x = torch.randn(64, 16)
    grads = []
    for scale in (1.0, 1 / 3):
        torch._dynamo.reset()
        loss.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            value = torch.compile(loss, backend="aot_eager", fullgraph=True)(x)
        (value * scale).backward()
        grads.append(loss.output.weight.grad.clone())
    ratio = (grads[1] / grads[0])[grads[0] != 0].median().item()
    assert abs(3 * ratio - 1) < 2e-4
