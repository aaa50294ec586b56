"""Run a function on N fresh local processes joined in a process group (tests, benchmarks, notebooks).

Not a training launcher (training uses Lightning's launchers: script re-execution, torchrun, SLURM);
this is the small harness the multi-process tests and benchmarks share.

No port is chosen in advance: the calling process hosts the rendezvous store (a ``TCPStore`` bound to port 0,
so the kernel hands out a free port and it stays bound for the whole run) and the workers connect to it as
clients, as torchrun's agent does. Picking a "free" port first and binding it later would race with every
other process on the machine (the old ``free_port``).

Workers start as ``spawn`` starts them (a fresh interpreter that imports torch and the caller's modules: seconds of
CPU per worker). A caller that starts many runs (a test suite, a benchmark) can call :func:`start_from_forkserver`
once: later workers fork from a server process that imported the given modules once, and start in ~0.1 s.
"""

from __future__ import annotations

import io
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_async.pipeline.groups import release_process_groups

HOST = "127.0.0.1"
_start_method = "spawn"  # how run_local starts workers (start_from_forkserver changes it)


def start_from_forkserver(preload: Sequence[str]) -> None:
    """Start the workers of later :func:`run_local` calls from multiprocessing's fork server, which imports the
    modules ``preload`` (e.g. ``["torch", "lightning"]``) once, when it starts. Call it before the first run. Workers
    then inherit the environment variables and ``sys.path`` of the moment the server started (the first run), not
    of each call; the function and arguments are still pickled as under spawn."""
    global _start_method
    mp.set_forkserver_preload(list(preload))
    _start_method = "forkserver"


def host_store() -> dist.TCPStore:
    """A rendezvous store served by this process on a port the kernel chose (``store.port``); keep a reference
    for as long as the workers need it."""
    return dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)


@dataclass
class _Membership:
    """This worker's place in the run: its rank, the world, the backend and the client of the run's store."""

    rank: int = 0
    world: int = 1
    backend: str = "gloo"
    store: dist.Store | None = None
    generation: int = 0  # how many default groups this worker has joined (each gets its own key prefix)


_MEMBERSHIP = _Membership()


def join_default_group(timeout: float | timedelta | None = None, world: int | None = None) -> bool:
    """Inside a ``run_local`` worker: (re)create the default process group through the run's store.

    An existing default group is destroyed first, so a test can start Lightning on a fresh group with the
    strategy's ``timeout`` (Lightning then uses it instead of opening its own). Every worker must call it, in the
    same order. ``world``: only ranks ``0..world-1`` join (a smaller world inside the same processes, for tests that
    run scenarios of several sizes in one spawn); the others are left without a group. Returns whether this rank
    joined.
    """
    m = _MEMBERSHIP
    if m.store is None:
        raise RuntimeError("join_default_group() works only inside a run_local worker.")
    if dist.is_initialized():
        dist.destroy_process_group()
    m.generation += 1
    size = m.world if world is None else world
    if m.rank >= size:
        return False
    store = dist.PrefixStore(f"group-{m.generation}", m.store)  # keys of an earlier group cannot be read back
    kwargs = {} if timeout is None else {"timeout": timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)}
    device_id = None
    if m.backend == "nccl":
        torch.cuda.set_device(m.rank)
        # bound to its device, NCCL creates every group's communicator eagerly at new_group, as under
        # Lightning; created lazily, the first use of a 3+ stage pipeline's group could deadlock
        device_id = torch.device("cuda", m.rank)
    dist.init_process_group(m.backend, store=store, rank=m.rank, world_size=size, device_id=device_id, **kwargs)
    return True


def _join_first_group(world: int, attempts: int = 3) -> None:
    """:func:`join_default_group`, tried again on every rank where one rank's failed. Gloo's rendezvous has failed
    on one side only on these loaded machines (rank 1: "connectFullMesh failed ... Connection closed by peer", rank 0
    joined; docs/pipeline.md, the fault matrix): the ranks tell each other through the run's store whether they
    joined, and all start a fresh group when one did not."""
    m = _MEMBERSHIP
    for attempt in range(1, attempts + 1):
        error = None
        try:
            join_default_group()
        except RuntimeError as err:
            error = err
        m.store.set(f"joined-{m.generation}-{m.rank}", "0" if error else "1")
        if all(m.store.get(f"joined-{m.generation}-{r}") == b"1" for r in range(world)):
            return
        if attempt == attempts:
            raise error or RuntimeError(f"another rank could not join the process group {attempts} times; see its error.")


def _worker(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, queue) -> None:
    torch.set_num_threads(1)
    try:
        m = _MEMBERSHIP
        m.rank, m.world, m.backend = rank, world, backend
        m.store = dist.TCPStore(HOST, port, is_master=False)
        _join_first_group(world)
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)  # bytes, not shared-memory tensors: the child may exit first
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        release_process_groups()


def run_local(
    world: int, fn: Callable, *args, backend: str = "gloo", timeout: float = 240.0, reporting: int | None = None
) -> list:
    """Run ``fn(*args)`` on ``world`` new processes (one thread each); return the results by rank.

    A rank that raises makes this raise ``RuntimeError`` with its traceback. ``reporting``: how many ranks
    are expected to report (a test may kill the others); results come back for those, in rank order.
    Inside ``fn``, :func:`join_default_group` replaces the default group with a fresh one.
    """
    ctx = mp.get_context(_start_method)
    queue = ctx.Queue()
    store = host_store()
    procs = [ctx.Process(target=_worker, args=(r, world, store.port, backend, fn, args, queue)) for r in range(world)]
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
        del store
    return [results[r] for r in sorted(results)]
