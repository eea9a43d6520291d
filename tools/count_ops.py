"""What a training step asks of a GPU's host, counted on this machine (no GPU needed):

1. the ops one eager training step of the base model dispatches (each a kernel launch on a GPU), by the method of
   tools/common/dispatch.py, beside torch.nn.Transformer trained by the same loop and loss;
2. the kernels inductor generates for the same step compiled (compile=true), forward and backward, read from its
   output code (on a CPU its C++ kernels; a GPU's Triton kernels fuse alike);
3. one epoch, and 20, of the GPU recipe's batches (Multi30k, experiment=multi30k_de_en_gpu): distinct batch shapes,
   padding, and the graphs dynamo compiles for them, without and with data.length_rungs.

    python tools/count_ops.py            # print the tables (about 3 minutes on 2 cores)
    python tools/count_ops.py --write    # and record them in docs/benchmarks.md
"""

import argparse
import sys

import numpy as np
import torch
from torch._dynamo.utils import counters

from common.dispatch import StepOps, compiled_kernels, count_training_step
from common.kernel_calls import synthetic_batch
from common.peers import TorchTransformer
from common.report import record
from common.training import batch_loss
from transformer.data import DataConfig, TranslationDataModule, padding_fraction
from transformer.model import ModelConfig, build_model
from transformer.model.compiling import compile_dynamic
from transformer.model.loss import batch_loss_sum

V = 8000
# base depth and the GPU recipe's dropout, at a width this machine steps through quickly: no count depends on it
BASE_DEPTH = dict(d_model=64, n_heads=8, d_ff=256, dropout=0.3, attention_dropout=0.1, activation_dropout=0.1)


def base_config(**overrides) -> ModelConfig:
    return ModelConfig.from_size("base", src_vocab_size=V, tgt_vocab_size=V, pad_id=0, **{**BASE_DEPTH, **overrides})


def step_batch() -> dict:
    rng = np.random.default_rng(0)
    return synthetic_batch(V, rng.integers(8, 25, 32).tolist(), rng.integers(8, 25, 32).tolist())


def op_rows() -> list[str]:
    torch.manual_seed(0)
    ours = count_training_step(build_model(base_config()), step_batch())
    peer = count_training_step(
        TorchTransformer(base_config()), step_batch(), lambda model, batch: batch_loss(model, batch, 0, 0.1)
    )  # the benchmarks' loop
    model = build_model(base_config())
    compile_dynamic(model)
    kernels = compiled_kernels(model, step_batch())
    rows = ["| model | forward and loss | backward | ops per step | compiled: kernels per step (forward + backward) |",
            "|---|---:|---:|---:|---|"]  # fmt: skip
    for name, ops, compiled in (("ours", ours, kernels), ("torch.nn.Transformer", peer, None)):
        per_graph = [c.total() for c in compiled or []]
        described = f"{sum(per_graph)} ({' + '.join(map(str, per_graph))})" if per_graph else ""
        rows.append(f"| {name} | {ops.forward.total()} | {ops.backward.total()} | {ops.total} | {described} |")
    return rows + [
        "",
        "Our step's ops by kind: " + most_common(ours),
        "",
        "Compiled, by kind: " + ", ".join(f"{k} {n}" for k, n in (kernels[0] + kernels[1]).most_common()),
    ]


def most_common(ops: StepOps) -> str:
    return ", ".join(f"{k} {n}" for k, n in (ops.forward + ops.backward).most_common(10))


def shape_rows(epochs: int) -> list[str]:
    rows = ["| data.length_rungs | batches an epoch | shapes, 1 epoch | shapes, 20 epochs | padding | graphs compiled, "
            "1 epoch | graph breaks |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for rungs in (None, 16):
        data = TranslationDataModule(DataConfig(max_tokens=8192, num_workers=0, length_rungs=rungs))
        data.setup()
        loader = data.train_dataloader()
        sampler, lengths = loader.batch_sampler, loader.batch_sampler.lengths
        shapes = [set() for _ in range(epochs)]
        for epoch in range(epochs):
            for indices in sampler.all_batches(epoch):
                shapes[epoch].add(shape_of(loader.collate_fn([loader.dataset[i] for i in indices])))
        tok = data.src_tokenizer
        model = build_model(ModelConfig.from_size("small", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size,
                                                  pad_id=tok.pad_id, n_encoder_layers=1, n_decoder_layers=1))  # fmt: skip
        torch._dynamo.reset()
        counters.clear()
        compile_dynamic(model.train(), backend="eager")  # dynamo's tracing decides the graphs, before any backend
        sampler.set_epoch(0)
        for batch in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                batch_loss_sum(model, batch, 0.1)[0].backward()
        padding = padding_fraction(sampler.all_batches(0), lengths, rungs)
        rows.append(
            f"| {rungs or 'null'} | {len(sampler)} | {len(shapes[0])} | {len(set().union(*shapes))} | "
            f"{padding:.1%} | {counters['stats']['unique_graphs']} | {sum(counters['graph_break'].values())} |"
        )
    return rows


def shape_of(batch: dict) -> tuple:
    """What a compiled graph (and a CUDA graph) is recorded for: every tensor's shape."""
    return tuple((k, tuple(v.shape)) for k, v in batch.items() if torch.is_tensor(v))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the tables in docs/benchmarks.md")
    args = parser.parse_args()
    ops = op_rows()
    print("\n".join(ops), flush=True)
    shapes = shape_rows(20)
    print("\n" + "\n".join(shapes))
    if args.write:
        body = (": one training step of the base model (6+6 layers, the GPU recipe's dropout, d_model 64: no count "
                "depends on the width), bf16 autocast, 32 sentences of 8-25 tokens; ops counted as "
                "`tools/common/dispatch.py` says (a GPU's dropout and fused attention; views not counted), "
                "torch.nn.Transformer by the same loop and loss. Before the eager path was trimmed (42436b8) ours "
                "was 1,081 (445 + 636).\n\n" + "\n".join(ops) + "\n\nThe GPU recipe's batches (Multi30k, "
                "data.max_tokens=8192), a shape being every batch tensor's; graphs from dynamo tracing one epoch "
                "(compile=true's dynamic shapes):\n\n" + "\n".join(shapes))  # fmt: skip
        record("count_ops", "Ops a training step dispatches, and batch shapes (`python tools/count_ops.py --write`)",
               body)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
