"""DDP ranks for a test, started as an outside launcher starts them: one process per rank with the launcher's
variables in its environment, torchrun's (RANK, WORLD_SIZE and the rendezvous) or SLURM's srun's (SLURM_PROCID,
SLURM_NTASKS, the job's id and nodes). They are forked from the test, so they start in a fraction of a second with
everything imported; each runs one intra-op thread, as two ranks on 2 cores should."""

import multiprocessing
import os
import random
import socket
import traceback

LAUNCHERS = ("torchrun", "slurm")
SLURM_PORTS = 15000  # Lightning's rendezvous port under SLURM: this + the job id's last 4 digits


def free_port(candidates=None) -> int:
    """A port nothing listens on: the system's pick, or the first free one of `candidates`."""
    for port in candidates or [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port among the candidates")


def launcher_environment(launcher: str, rank: int, world: int, port: int) -> dict[str, str]:
    """The variables `launcher` gives rank `rank` of `world` on one node, whose rendezvous is at `port`."""
    if launcher == "torchrun":
        return dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                    LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", TORCHELASTIC_RUN_ID="test")  # fmt: skip
    if launcher == "slurm":  # srun --ntasks-per-node=world: no MASTER_* (Lightning derives them from the job)
        return dict(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_NTASKS=str(world),
                    SLURM_NTASKS_PER_NODE=str(world), SLURM_NNODES="1", SLURM_NODELIST="localhost",
                    SLURM_JOB_ID=str(port - SLURM_PORTS), SLURM_JOB_NAME="train")  # fmt: skip
    raise ValueError(f"launcher={launcher!r}: one of {', '.join(LAUNCHERS)}")


def _rank(environment: dict[str, str], rank: int, target, args) -> None:
    for name in [n for n in os.environ if n.startswith(("SLURM_", "TORCHELASTIC_"))]:
        del os.environ[name]  # the test's own, were it run under a launcher
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
        os.environ.pop(name, None)
    os.environ.update(environment)
    import torch

    torch.set_num_threads(1)
    try:
        target(rank, *args)
    except SystemExit as e:  # a run that exits with a status of its own (a signal's)
        os._exit(e.code if isinstance(e.code, int) else 1)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)  # no atexit handlers of the test process


def run_ranks(target, *args, world: int = 2, launcher: str = "torchrun", timeout: float = 120,
              codes: tuple[int, ...] = (0,)) -> None:  # fmt: skip
    """target(rank, *args) in `world` forked processes started as `launcher` starts them; fails if a rank hangs or
    exits with another status than `codes` (every rank the same)."""
    # SLURM's port comes from the job id: a free one of Lightning's range, the job id made to match
    port = free_port(random.sample(range(SLURM_PORTS, SLURM_PORTS + 10000), 200) if launcher == "slurm" else None)
    context = multiprocessing.get_context("fork")
    ranks = [
        context.Process(target=_rank, args=(launcher_environment(launcher, rank, world, port), rank, target, args))
        for rank in range(world)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout)
    for process in ranks:
        if process.is_alive():
            process.kill()
    exits = [process.exitcode for process in ranks]
    assert len(set(exits)) == 1 and exits[0] in codes, f"ranks exited with {exits} (tracebacks: captured stderr)"
