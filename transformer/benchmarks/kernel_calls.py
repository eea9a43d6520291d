"""Every attention call a model makes in a training step, a validation pass, greedy and beam search, recorded with
the kernel each would get on an sm90 GPU (transformer/model/kernels/rules.py): what `tools/predict_kernels.py` prints
and tests/test_kernels.py asserts."""

from collections import Counter
from contextlib import nullcontext

import numpy as np
import torch

from ..data.batching import Collate
from ..decoding import beam_search, greedy_search
from ..model import EncoderDecoder
from ..model.kernels.rules import SdpaCall, cuda_kernel, record_sdpa
from ..model.loss import batch_loss_sum

PHASES = ("training step", "validation", "greedy search", "beam search")
PAD, BOS, EOS = 0, 1, 2
VOCAB = 8000  # the recipes'; no kernel choice depends on it
# a Multi30k batch's shape: captions of 8-25 subwords, their translations about as long
SOURCE_LENGTHS, TARGET_LENGTHS = [8, 12, 14, 17, 21, 25], [9, 11, 16, 15, 24, 22]


def synthetic_batch(vocab_size: int, src_lengths: list[int], tgt_lengths: list[int], seed: int = 0) -> dict:
    """A batch as the collator makes it, of random tokens with these lengths (special tokens not counted)."""
    rng = np.random.default_rng(seed)
    examples = [(rng.integers(3, vocab_size, n).astype(np.int32), rng.integers(3, vocab_size, m).astype(np.int32), i)
                for i, (n, m) in enumerate(zip(src_lengths, tgt_lengths))]  # fmt: skip
    return Collate(PAD, BOS, EOS)(examples)


def run_phase(model: EncoderDecoder, batch: dict, phase: str, beam_size: int = 4) -> None:
    """One of PHASES over the batch (pad id 0, as synthetic_batch makes it), in the mode and grad mode it runs in."""
    model.train(phase == "training step")
    with torch.set_grad_enabled(phase == "training step"):
        if phase in ("training step", "validation"):
            loss, _ = batch_loss_sum(model, batch, 0.1)
            if phase == "training step":
                loss.backward()
        elif phase == "greedy search":
            greedy_search(model, batch["src"], BOS, EOS)
        else:
            beam_search(model, batch["src"], BOS, EOS, beam_size=beam_size)


def attention_calls(model: EncoderDecoder, batch: dict, bf16: bool, beam_size: int = 4,
                    phases: tuple[str, ...] = PHASES) -> dict[str, list[SdpaCall]]:  # fmt: skip
    """The SDPA calls of each phase: the training step (forward and backward, in train mode), validation's loss
    (eval mode), and both searches over the batch's sources; under bf16 autocast with `bf16`, as a GPU trains."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    calls, training = {}, model.training
    try:
        for phase in phases:
            with record_sdpa(model) as recorded, autocast:
                run_phase(model, batch, phase, beam_size)
            calls[phase] = recorded
    finally:
        model.train(training)
    return calls


def kernel_table(calls: dict[str, list[SdpaCall]]) -> str:
    """A markdown table: per phase and attention kind, the calls, what reaches SDPA, the kernel and what was passed
    over (by the first call of each row that shows it)."""
    rows = ["| phase | attention | calls | inputs | kernel on sm90 | passed over |", "|---|---|---:|---|---|---|"]
    for phase, recorded in calls.items():
        groups = Counter()
        for call in recorded:
            kernel, passed_over = cuda_kernel(call)
            inputs = ("nested" if call.nested else "dense") + f", {call.mask or 'no'} mask" + (
                ", causal" if call.is_causal else "") + f", {str(call.dtype).removeprefix('torch.')}" + (
                f", dropout {call.dropout}" if call.dropout else "")  # fmt: skip
            why = "; ".join(f"{k}: {', '.join(v)}" for k, v in passed_over.items())
            groups[(call.kind, inputs, kernel or "NONE: fails", why)] += 1
        for (kind, inputs, kernel, why), n in groups.items():
            rows.append(f"| {phase} | {kind} | {n} | {inputs} | {kernel} | {why} |")
    return "\n".join(rows)


def predicted_kernels(overrides: list[str], phases: tuple[str, ...] = PHASES) -> str:
    """For a training config (Hydra overrides of `python -m transformer.train`): its model, runtime and precision
    in one line, then kernel_table of its calls over a batch of Multi30k's lengths. A setting that check_backend
    refuses raises its one-line ValueError."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ..cli.command import CONFIGS
    from ..config.schema import register_configs
    from ..model import ModelConfig, RuntimeConfig, build_model
    from ..model.kernels.rules import check_backend

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("train", overrides=overrides), resolve=False)
    model_cfg = ModelConfig.from_choice(cfg["model"], src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, pad_id=PAD)
    runtime = RuntimeConfig(**cfg["runtime"])
    precision = str(cfg["trainer"].get("precision"))
    bf16 = precision == "auto" or "16" in precision  # auto: bf16 on such a GPU; fp16 is judged as bf16 is
    check_backend(model_cfg, runtime, "cuda", reduced_precision=bf16)
    torch.manual_seed(0)
    calls = attention_calls(build_model(model_cfg, runtime), synthetic_batch(VOCAB, SOURCE_LENGTHS, TARGET_LENGTHS),
                            bf16, phases=phases)  # fmt: skip
    described = (f"{' '.join(overrides)}: d_model {model_cfg.d_model}, {model_cfg.n_heads} heads, attention dropout "
                 f"{model_cfg.attention_dropout}; {runtime}; {'bf16' if bf16 else 'fp32'}")  # fmt: skip
    return described + "\n\n" + kernel_table(calls)
