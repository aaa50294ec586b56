"""Run a function on N fresh local processes joined in a process group (tests, benchmarks, notebooks).

Not a training launcher (training uses Lightning's launchers: script re-execution, torchrun, SLURM);
this is the small harness the multi-process tests and benchmarks share.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that is free on the loopback interface right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        device_id = None
        if backend == "nccl":
            torch.cuda.set_device(rank)
            # bound to its device, NCCL creates every group's communicator eagerly at new_group, as under
            # Lightning; created lazily, the first use of a 3+ stage pipeline's group could deadlock
            device_id = torch.device("cuda", rank)
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=device_id)
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)  # bytes, not shared-memory tensors: the child may exit first
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(
    world: int, fn: Callable, *args, backend: str = "gloo", timeout: float = 240.0, reporting: int | None = None
) -> list:
    """Run ``fn(*args)`` on ``world`` spawned processes (one thread each); return the results by rank.

    A rank that raises makes this raise ``RuntimeError`` with its traceback. ``reporting``: how many ranks
    are expected to report (a test may kill the others); results come back for those, in rank order.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, backend, fn, args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world if reporting is None else reporting):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False, map_location="cpu")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [results[r] for r in sorted(results)]
