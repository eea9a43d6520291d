"""Training runs under jemalloc when the machine has it: the process restarts itself with it preloaded, as PyTorch's
CPU launcher (torch.backends.xeon.run_cpu) does. glibc's malloc hands every tensor over 32 MiB (logits, their
gradients) back to the kernel when it is freed and faults it in again at the next step; on 2 CPU cores that costs
the Multi30k recipe 2.4x its step time (docs/benchmarks.md). TRANSFORMER_ALLOCATOR=system keeps glibc's.

What jemalloc keeps is handed back after each validation instead (`purge_freed_pages`, called by
transformer/training/memory.py): kept for a whole run, it fragments."""

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

# Freed pages stay with the process for the next step, never purged by time: only purge_freed_pages hands them back
MALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
OPT_OUT = "TRANSFORMER_ALLOCATOR"  # `system`: glibc's malloc, no restart
HINT = ("note: CPU training ran 2.4x faster under jemalloc than under glibc's malloc (docs/benchmarks.md); install it "
        "(apt install libjemalloc2, or conda install jemalloc) and transformer.train restarts under it")  # fmt: skip


def jemalloc_library() -> str | None:
    """The shared library to preload: the environment's own (conda, venv), else the system's."""
    for lib in (Path(sys.prefix) / "lib").glob("libjemalloc.so*"):
        return str(lib)
    return ctypes.util.find_library("jemalloc")


def jemalloc_loaded() -> bool:
    maps = Path("/proc/self/maps")
    return maps.exists() and "libjemalloc" in maps.read_text()


def status_kib(field: str, pid: int | str = "self") -> int:
    """A field of a process's /proc status in KiB, e.g. VmRSS (resident now) or VmHWM (peak resident); Linux only."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line for line in lines if line.startswith(field + ":")).split()[1])


def resident_gib() -> float | None:
    """This process's resident memory in GiB; None where the kernel does not say (not Linux)."""
    return status_kib("VmRSS") / 2**20 if Path("/proc/self/status").exists() else None


MALLCTL_ARENAS_ALL = 4096  # jemalloc 5's index for every arena at once in mallctl names


def purge_freed_pages() -> None:
    """Hand the freed pages jemalloc keeps back to the kernel, in every arena; nothing under another allocator. An
    OSError if jemalloc refuses, or has no `mallctl` (a build with prefixed names)."""
    if not jemalloc_loaded():
        return
    name = f"arena.{MALLCTL_ARENAS_ALL}.purge"
    try:
        mallctl = ctypes.CDLL(None).mallctl
    except AttributeError:
        raise OSError(f"the jemalloc loaded has no mallctl to purge its freed pages ({name})") from None
    failed = mallctl(name.encode(), None, None, None, ctypes.c_size_t(0))
    if failed:
        raise OSError(failed, f"jemalloc's mallctl {name} failed")


def jemalloc_environment(env: dict[str, str], library: str | None, loaded: bool) -> dict[str, str] | None:
    """The environment to restart with, or None to carry on as is (opted out, already loaded, none found)."""
    if env.get(OPT_OUT) == "system" or loaded or library is None:
        return None
    preload = " ".join(p for p in (library, env.get("LD_PRELOAD")) if p)
    return {**env, "LD_PRELOAD": preload, "MALLOC_CONF": env.get("MALLOC_CONF", MALLOC_CONF), OPT_OUT: "jemalloc"}


def preloaded_environment() -> dict[str, str] | None:
    """The environment that starts transformer.train under jemalloc from the outset, for a tool that follows the
    process it starts (py-spy): a restart would replace the image it reads. None: the inherited one will do. Judged
    by what the child inherits (LD_PRELOAD), not by what this process has loaded."""
    env = dict(os.environ)
    return jemalloc_environment(env, jemalloc_library(), "libjemalloc" in env.get("LD_PRELOAD", ""))


def allocator_hint(device_type: str) -> str | None:
    """A one-line note for a CPU run under glibc's malloc that did not choose it."""
    if device_type != "cpu" or jemalloc_loaded() or os.environ.get(OPT_OUT) == "system":
        return None
    return HINT


def restart_with_jemalloc() -> None:
    """Replace this process by the same command under jemalloc, if it should be; a second start never restarts
    (OPT_OUT is set), even if the preload failed."""
    if not sys.platform.startswith("linux") or os.environ.get(OPT_OUT) == "jemalloc":
        return
    env = jemalloc_environment(dict(os.environ), jemalloc_library(), jemalloc_loaded())
    if env is not None:
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
