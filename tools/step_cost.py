"""What tools/bench_mfu.py measures inside a real training run (`python -m transformer.train`, this callback
added by Hydra overrides): target tokens/s over a window of optimizer steps, then where the steps' time goes by kind
(torch.profiler); when training ends, the model FLOPs of the timed steps themselves (FlopCounterMode over their
batches again), all written as JSON into `out`."""

import json
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
import torch._inductor.config
from pytorch_lightning import Callback
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from common.gemm import model_dims
from transformer.model.loss import batch_loss_sum

PROFILED = 3  # steps under the profiler, after the timed ones
KINDS = ("matmul", "casts and copies", "elementwise", "norm", "dropout", "optimizer and EMA", "inductor kernels",
         "framework")  # fmt: skip
MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm"}
CASTS = {"aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous"}
NORM = {"aten::native_layer_norm", "aten::native_layer_norm_backward"}
# the CPU dropout's mask (transformer/model/dropout.py) and torch's own
DROPOUT = {"aten::random_", "aten::bitwise_and_", "aten::ge_", "aten::bernoulli_", "aten::native_dropout",
           "aten::native_dropout_backward"}  # fmt: skip


def kind_of(name: str) -> str | None:
    """The kind of an event the profiler records, by its name; None for what is not an op (Python functions, the
    autograd engine's nodes, compiled graphs' wrappers), whose self time is the framework's."""
    if name in MATMUL or "scaled_dot_product" in name:
        return "matmul"
    if name in CASTS:
        return "casts and copies"
    if name in NORM:
        return "norm"
    if name in DROPOUT:
        return "dropout"
    if name.startswith(("aten::_fused_adam", "aten::_foreach_")):
        return "optimizer and EMA"
    if "cpp_fused" in name or "triton_" in name:  # inductor's kernels (enable_kernel_profile names them)
        return "inductor kernels"
    if name.startswith("aten::"):
        return "elementwise"
    return None


def time_by_kind(self_times: dict[str, float], wall: float) -> dict[str, float]:
    """Seconds per kind from the profiler's self time per event name; framework: the wall time no op accounts for."""
    kinds = Counter()
    for name, seconds in self_times.items():
        kind = kind_of(name)
        if kind is not None:
            kinds[kind] += seconds
    kinds["framework"] = max(0.0, wall - sum(kinds.values()))
    return {kind: kinds[kind] for kind in KINDS}


def _cpu_flash_flops(query, key, value, *args, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_backward_flops(grad_out, query, key, value, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# FlopCounterMode knows SDPA's GPU kernels only; a CPU trains through this one in fp32 and with long keys
CPU_FLASH_FLOPS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops,
                   torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flops}  # fmt: skip


def step_flops(model, batches: list[dict], label_smoothing: float, rdrop_alpha: float | None = None,
               context: Callable[[], AbstractContextManager] = nullcontext) -> int:  # fmt: skip
    """FLOPs of the training step's forward, loss and backward over `batches` (collated batches), as FlopCounterMode
    counts them: matmuls and attention, padded positions included. Under a dispatch mode a compiled model runs its
    eager ops, so a compiled and an eager model count the same: the model's FLOPs, not inductor's kernels'. The
    gradients are dropped after."""
    counter = FlopCounterMode(display=False, custom_mapping=CPU_FLASH_FLOPS)
    with counter, torch.enable_grad():
        for batch in batches:
            with context():
                loss, _ = batch_loss_sum(model, batch, label_smoothing, rdrop_alpha)
            loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def compilations() -> int:
    """A number that grows whenever dynamo or inductor compiles something (a graph, a recompile, a backward)."""
    counters = torch._dynamo.utils.counters
    return sum(sum(counters[group].values()) for group in ("frames", "aot_autograd", "inductor"))


class StepCost(Callback):
    """Optimizer steps first..first+steps-1 timed (target tokens/s), the next `profiled` profiled, each from its batch's
    start to the next's, as the timed ones; training should stop one step after them (trainer.max_steps = first +
    steps + profiled + 1). A timed step that compiled (a compiled model meeting a new shape) is left out of the rate
    and counted: its cost is paid once a run, not per step. When training ends, the timed steps' batches go through
    forward, loss and backward again under FlopCounterMode, so that the rate and the FLOPs are of the same batches (a
    Multi30k batch's FLOPs per target token vary by 10%: padding, and the source's length against the target's)."""

    def __init__(self, out: str, first: int = 5, steps: int = 20, profiled: int = PROFILED):
        self.out, self.first, self.steps, self.profiled = Path(out), first, steps, profiled
        self.found = {"timed": {"steps": 0, "seconds": 0.0, "target_tokens": 0, "compiling_steps": 0}}
        self.start = None
        self.step_start: tuple[float, int, dict] | None = None  # (clock, compilations, batch) of a timed step
        self.timed_batches: list[dict] = []  # those of the timed steps that did not compile
        self.profiler: torch.profiler.profile | None = None
        self.parameter_shapes: set[tuple[int, ...]] = set()
        # inductor's C++ kernels named in the profile (set before anything compiles)
        torch._inductor.config.cpp.enable_kernel_profile = True

    def on_train_start(self, trainer, module):
        if trainer.accumulate_grad_batches != 1:  # its windows count batches as optimizer steps
            raise ValueError(f"StepCost needs trainer.accumulate_grad_batches=1, not {trainer.accumulate_grad_batches}")
        self.parameter_shapes = {tuple(p.shape) for p in module.parameters()}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        step, timed_end = trainer.global_step, self.first + self.steps
        now = time.perf_counter()
        if self.step_start is not None:  # a timed step ends where the next batch starts: loading counts, as it does
            self._timed(now - self.step_start[0], compilations() != self.step_start[1], self.step_start[2])
            self.step_start = None
        if self.first <= step < timed_end:
            self.step_start = (now, compilations(), batch)
        if step == timed_end:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
            self.profiler.start()
            self.start = time.perf_counter()
        if step == timed_end + self.profiled:
            self._profile_done()

    def _timed(self, seconds: float, compiled: bool, batch: dict) -> None:
        timed = self.found["timed"]
        if compiled:
            timed["compiling_steps"] += 1
            return
        timed["steps"] += 1
        timed["seconds"] += seconds
        timed["target_tokens"] += batch["tgt_tokens"]
        self.timed_batches.append(batch)

    def _profile_done(self) -> None:
        wall = time.perf_counter() - self.start
        self.profiler.stop()
        self_times = Counter()
        for event in self.profiler.key_averages():
            self_times[event.key] += event.self_cpu_time_total / 1e6
        self.found["profiled"] = {"steps": self.profiled, "seconds": wall, "by_kind": time_by_kind(self_times, wall),
                                  "casts": self._casts_by_operand(), "top": self_times.most_common(12)}  # fmt: skip
        self.profiler = None

    def _casts_by_operand(self) -> dict[str, list]:
        """[calls, seconds] of the profiled steps' casts and copies whose operand has a parameter's shape (autocast's
        weight casts and their gradients' casts back: what bf16 working weights would remove) and of the rest
        (activations, layouts, scalars)."""
        casts = {"parameter-shaped": [0, 0.0], "other": [0, 0.0]}
        for event in self.profiler.key_averages(group_by_input_shape=True):
            if event.key in CASTS:
                operand = tuple(event.input_shapes[0]) if event.input_shapes else ()
                row = casts["parameter-shaped" if operand in self.parameter_shapes else "other"]
                row[0] += event.count
                row[1] += event.self_cpu_time_total / 1e6
        return casts

    def on_train_end(self, trainer, module):
        optim = module.optim_config
        flops = step_flops(module.model, self.timed_batches, optim.label_smoothing, optim.rdrop_alpha,
                           trainer.precision_plugin.forward_context)  # fmt: skip
        self.found["flops"] = {"total": flops, "target_tokens": self.found["timed"]["target_tokens"]}
        self.found["precision"] = str(trainer.precision)
        self.found["model"] = model_dims(module.model_config)
        self.found["threads"] = torch.get_num_threads()
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "step_cost.json").write_text(json.dumps(self.found, indent=1))
