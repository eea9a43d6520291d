"""DDP ranks for a test, started as an outside launcher (torchrun, SLURM) starts them: one process per rank with
RANK, WORLD_SIZE and the rendezvous in its environment. They are forked from the test, so they start in a fraction
of a second with everything imported; each runs one intra-op thread, as two ranks on 2 cores should."""

import multiprocessing
import os
import socket
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, target, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")  # fmt: skip
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


def run_ranks(target, *args, world: int = 2, timeout: float = 120, codes: tuple[int, ...] = (0,)) -> None:
    """target(rank, *args) in `world` forked processes; fails if a rank hangs or exits with another status than
    `codes` (every rank the same)."""
    context = multiprocessing.get_context("fork")
    port = free_port()
    ranks = [context.Process(target=_rank, args=(rank, world, port, target, args)) for rank in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout)
    for process in ranks:
        if process.is_alive():
            process.kill()
    exits = [process.exitcode for process in ranks]
    assert len(set(exits)) == 1 and exits[0] in codes, f"ranks exited with {exits} (tracebacks: captured stderr)"
