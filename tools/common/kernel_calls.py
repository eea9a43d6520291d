"""Every attention call a model makes in a training step, a validation pass, greedy and beam search, recorded with
the kernel each would get on an sm90 GPU (transformer/model/kernels/rules.py): what `tools/predict_kernels.py` prints
and tests/test_kernels.py asserts."""

import contextlib
from collections import Counter
from collections.abc import Iterator
from contextlib import nullcontext
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from transformer.data.batching import Collate
from transformer.decoding import beam_search, greedy_search
from transformer.model import EncoderDecoder, attention
from transformer.model.kernels import explicit
from transformer.model.kernels.rules import SdpaCall, cuda_kernel
from transformer.model.loss import batch_loss_sum

PHASES = ("training step", "validation", "greedy search", "beam search")
PAD, BOS, EOS = 0, 1, 2
VOCAB = 8000  # the recipes'; no kernel choice depends on it
# a Multi30k batch's shape: captions of 8-25 subwords, their translations about as long
SOURCE_LENGTHS, TARGET_LENGTHS = [8, 12, 14, 17, 21, 25], [9, 11, 16, 15, 24, 22]


def _enabled() -> frozenset[str]:
    flags = {"flash": torch.backends.cuda.flash_sdp_enabled(), "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
             "cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "math": torch.backends.cuda.math_sdp_enabled()}  # fmt: skip
    return frozenset(name for name, on in flags.items() if on)


def _lengths(x: torch.Tensor) -> tuple[int, int]:
    """(longest, shortest) sequence of a (B, nh, T, hs) input; nested: of its ragged dimension."""
    if not x.is_nested:
        return x.size(2), x.size(2)
    lengths = x.offsets().diff()  # (B,)
    return int(lengths.max()), int(lengths.min())


@contextlib.contextmanager
def record_sdpa(model: nn.Module) -> Iterator[list[SdpaCall]]:
    """Every SDPA call the model's attention modules make inside the block, as SdpaCall. The calls still run: on a
    CPU, with the kernel restriction lifted, so that a backend this machine lacks is recorded rather than failing.
    backend=auto's explicit path for a CPU's bf16 training is off, as on a GPU, where SDPA gets those calls."""
    calls: list[SdpaCall] = []
    site = [""]
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, attention.MultiHeadAttention):
            hooks.append(module.register_forward_pre_hook(lambda m, a, name=name: site.__setitem__(0, name)))
    sdpa = F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        (q_len, q_min), (k_len, k_min) = _lengths(q), _lengths(k)
        kind = None if attn_mask is None else "bool" if attn_mask.dtype == torch.bool else "float"
        mask = kind and f"{kind} {attn_mask.dim()}-D"
        calls.append(SdpaCall(site[0], q.is_nested, q.size(0), q.size(1), q_len, k_len, min(q_min, k_min), q.size(-1),
                              q.dtype, mask, is_causal, dropout_p, _enabled(),
                              torch.are_deterministic_algorithms_enabled()))  # fmt: skip
        with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]):  # what this CPU has
            return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    try:
        with mock.patch.object(F, "scaled_dot_product_attention", recorded), \
                mock.patch.object(explicit, "explicit_is_faster", lambda *args: False):  # fmt: skip
            yield calls
    finally:
        for hook in hooks:
            hook.remove()


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

    from transformer.cli.command import CONFIGS
    from transformer.config.schema import register_configs
    from transformer.model import ModelConfig, RuntimeConfig, build_model
    from transformer.model.kernels.rules import check_backend

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
