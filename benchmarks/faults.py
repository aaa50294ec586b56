"""Fault injection for the pipeline strategy: kill -9, SIGTERM and SIGSTOP of each stage, in training, in
validation and during a checkpoint save, on 2 and 3 CPU stages (gloo).

Every rank is its own process, started as torchrun or ``srun`` would (environment variables), so each rank's
exit code and exit time are seen. Each run trains 8 steps of a tiny model with ``last.ckpt`` written every
2 steps and validation at step 4; the fault hits the chosen stage at step 5 (training), in the step-4
validation, or while the step-6 checkpoint is saved (after the stage wrote its file, before the others
did). The table gives, per case: the seconds from the fault until every rank had exited (a SIGSTOPped rank
cannot exit: it is listed as stray, killed by this script, and the time is the others'), the exit codes by
rank, the step of the last complete checkpoint, and whether resuming it reproduces the uninterrupted run's
training losses exactly.

    python benchmarks/faults.py --json faults.json     # the whole matrix (about 90 short runs; prints its wall time)
    python benchmarks/faults.py --stages 2 --signals kill --phases save
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import _bench

SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}
PHASES = ("train", "val", "save")
STEPS, CHECKPOINT_EVERY, VALIDATE_AT, TRAIN_FAULT_STEP, SAVE_FAULT_STEP = 8, 2, 4, 5, 6


# ---------------------------------------------------------------------------------------------- one rank
def _worker(cfg: dict) -> None:
    import lightning as L
    import torch
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_async.data.sampler import ResumableDataLoader, ResumableShuffleSampler, trainer_position
    from lightning_async.lm import CausalLM
    from lightning_async.strategies import AsyncPipelineStrategy

    rank, world = cfg["rank"], cfg["world"]
    # as under torchrun: every rank connects to the store its launcher hosts (no port is picked, then bound later)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(cfg["port"]), TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    fault = cfg.get("fault") if cfg.get("fault", {}).get("rank") == rank else None

    def fire() -> None:
        with open(os.path.join(cfg["dir"], "fault_time"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), SIGNALS[fault["signal"]])

    class Fault(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if fault["phase"] == "train" and trainer.global_step == TRAIN_FAULT_STEP:
                fire()

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
            if fault["phase"] == "val" and not trainer.sanity_checking and batch_idx == 1:
                fire()

    class FaultDuringSave(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
            super().save_checkpoint(checkpoint, path, storage_options)
            if checkpoint.get("global_step") == SAVE_FAULT_STEP:
                fire()

    class RecordLosses(L.Callback):
        losses: dict = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if "train/loss" in trainer.callback_metrics:
                self.losses[trainer.global_step] = float(trainer.callback_metrics["train/loss"])
                with open(os.path.join(cfg["dir"], "losses.json"), "w") as f:
                    json.dump(self.losses, f)

    class Data(L.LightningDataModule):
        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            data = [torch.randint(0, 257, (17,), generator=g) for _ in range(48)]
            sampler = ResumableShuffleSampler(data, 8, seed=0, resume_point=trainer_position(self.trainer))
            return ResumableDataLoader(data, batch_size=8, sampler=sampler, drop_last=True)

        def val_dataloader(self):
            g = torch.Generator().manual_seed(2)
            return torch.utils.data.DataLoader([torch.randint(0, 257, (17,), generator=g) for _ in range(16)], batch_size=8)

    callbacks = [ModelCheckpoint(dirpath=os.path.join(cfg["dir"], "ckpt"), filename="last", every_n_train_steps=CHECKPOINT_EVERY,
                                 enable_version_counter=False)]
    callbacks += [RecordLosses()] if rank == 0 else []
    plugins = []
    if fault is not None:
        callbacks.append(Fault())
        plugins = [FaultDuringSave()] if fault["phase"] == "save" else []
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=AsyncPipelineStrategy(n_microbatches=4, timeout=cfg["timeout"]),
        max_steps=STEPS, val_check_interval=VALIDATE_AT, limit_val_batches=2, num_sanity_val_steps=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, plugins=plugins,
    )
    model = CausalLM(vocab_size=257, model_overrides=dict(hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_size=64), lr=3e-3)
    _start_together(cfg)
    trainer.fit(model, datamodule=Data(), ckpt_path=cfg.get("resume"))


def _start_together(cfg: dict) -> None:
    """The ranks of a run meet here (generous timeout) before Lightning opens its process group with the strategy's
    5 s timeout: a rank that imports more slowly on a busy machine is not a fault."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, timeout=timedelta(seconds=300))
    store.add("faults/arrived", 1)
    while store.add("faults/arrived", 0) < cfg["world"]:
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------- one case
def _launch(world: int, run_dir: str, timeout: float, fault: dict | None = None, resume: str | None = None) -> tuple:
    """The rank processes of one run, and the rendezvous store they connect to (keep it while they run)."""
    from lightning_async.pipeline.local import host_store

    os.makedirs(run_dir, exist_ok=True)
    store, procs = host_store(), []
    port = store.port
    for rank in range(world):
        cfg = dict(rank=rank, world=world, port=port, dir=run_dir, timeout=timeout, fault=fault or {}, resume=resume)
        log = open(os.path.join(run_dir, f"rank{rank}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)],
                                      stdout=log, stderr=subprocess.STDOUT))
    return procs, store


RUN_ALLOWANCE = 900.0  # seconds a run may take before its fault fires (or to its end): a loaded machine is slow


def _wait(procs: list, limit: float, stopped_rank: int | None, stamp: str | None = None) -> tuple[dict[int, float], list[int]]:
    """Exit times by rank; the ranks still alive ``limit`` seconds after the fault fired (the time in ``stamp``; a
    run whose fault never fires gets ``RUN_ALLOWANCE``), and the SIGSTOPped one once the others are gone."""
    exited: dict[int, float] = {}
    launched = time.time()

    def deadline() -> float:
        if stamp and os.path.exists(stamp):
            with open(stamp) as f:
                text = f.read().strip()
            if text:
                return float(text) + limit
        return launched + RUN_ALLOWANCE

    while time.time() < deadline():
        for rank, proc in enumerate(procs):
            if rank not in exited and proc.poll() is not None:
                exited[rank] = time.time()
        others = [r for r in range(len(procs)) if r != stopped_rank]
        if all(r in exited for r in others):
            break
        time.sleep(0.05)
    stray = [r for r, proc in enumerate(procs) if proc.poll() is None]
    for rank in stray:
        procs[rank].kill()
        procs[rank].wait()
    return exited, stray


def _losses(run_dir: str) -> dict[int, float]:
    path = os.path.join(run_dir, "losses.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {int(k): v for k, v in json.load(f).items()}


def _uninterrupted(world: int, root: str, timeout: float, limit: float) -> dict[int, float]:
    run_dir = os.path.join(root, f"reference-{world}")
    procs, _store = _launch(world, run_dir, timeout)
    _wait(procs, limit, None)
    codes = [p.returncode for p in procs]
    if codes != [0] * world:
        raise RuntimeError(f"the uninterrupted {world}-stage run failed (exit codes {codes}); see {run_dir}")
    return _losses(run_dir)


def _resume_check(world: int, run_dir: str, timeout: float, limit: float, reference: dict[int, float]) -> tuple:
    from lightning_async.pipeline.checkpoint import is_complete, read_meta, resolve

    path = resolve(os.path.join(run_dir, "ckpt", "last.ckpt"))
    if not is_complete(path):
        return None, "no checkpoint"
    step = read_meta(path)["global_step"]
    resumed_dir = run_dir + "-resumed"
    procs, _store = _launch(world, resumed_dir, timeout, resume=path)
    _wait(procs, limit, None)
    codes = [p.returncode for p in procs]
    exits = "" if codes == [0] * world else f", exit codes {codes}"
    resumed = _losses(resumed_dir)
    common = [s for s in resumed if s in reference and s > step]
    if not common:
        return step, f"no losses to compare{exits}"
    worst = max(abs(resumed[s] - reference[s]) for s in common)
    return step, ("exact" if worst == 0 else f"differs ({worst:.1e})") + exits


def run_case(world: int, signal_name: str, stage: int, phase: str, root: str, timeout: float, limit: float,
             reference: dict[int, float]) -> dict:
    run_dir = os.path.join(root, f"s{world}-{signal_name}-stage{stage}-{phase}")
    fault = {"rank": stage, "signal": signal_name, "phase": phase}
    procs, _store = _launch(world, run_dir, timeout, fault=fault)
    stamp = os.path.join(run_dir, "fault_time")
    exited, stray = _wait(procs, limit, stage if signal_name == "stop" else None, stamp)
    fired = float(open(stamp).read()) if os.path.exists(stamp) else None
    ended = [t for r, t in exited.items() if r not in stray]
    codes = [proc.returncode for proc in procs]
    step, resumed = _resume_check(world, run_dir, timeout, limit, reference)
    leftovers = sorted(f for f in os.listdir(os.path.join(run_dir, "ckpt")) if f != "last.ckpt") if os.path.isdir(os.path.join(run_dir, "ckpt")) else []
    return {
        "stages": world, "signal": signal_name, "stage": stage, "phase": phase,
        "exit_s": None if fired is None or not ended else round(max(ended) - fired, 1),
        "codes": [None if r in stray else c for r, c in enumerate(codes)], "stray": stray,
        "checkpoint_step": step, "resume": resumed, "leftovers": leftovers,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| stages | signal | stage | phase | all exited after | exit codes by rank | stray | last complete ckpt | resume vs uninterrupted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        exited = "not fired" if r["exit_s"] is None else f"{r['exit_s']} s"
        stray = ", ".join(f"rank {s} (stopped)" if r["signal"] == "stop" and s == r["stage"] else f"rank {s}" for s in r["stray"]) or "none"
        codes = " ".join("-" if c is None else str(c) for c in r["codes"])
        step = "none" if r["checkpoint_step"] is None else f"step {r['checkpoint_step']}"
        if r["leftovers"]:
            step += f" (+ {', '.join(r['leftovers'])})"
        lines.append(f"| {r['stages']} | {r['signal']} | {r['stage']} | {r['phase']} | {exited} | {codes} | {stray} | {step} | {r['resume']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = _bench.parser(__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--signals", nargs="+", choices=list(SIGNALS), default=list(SIGNALS))
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--timeout", type=float, default=5.0, help="the strategy's timeout (seconds)")
    parser.add_argument("--limit", type=float, default=90.0, help="seconds after the fault before a rank counts as hung and is killed")
    parser.add_argument("--dir", help="where the runs write (default: a temporary directory)")
    _bench.add_json(parser, "also write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(json.loads(args.worker))
        return 0
    root = args.dir or tempfile.mkdtemp(prefix="faults-")
    started = time.time()
    rows = []
    for world in args.stages:
        reference = _uninterrupted(world, root, args.timeout, args.limit)
        for signal_name, stage, phase in itertools.product(args.signals, range(world), args.phases):
            row = run_case(world, signal_name, stage, phase, root, args.timeout, args.limit, reference)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(table(rows))
    print(f"\n{len(rows)} faults (+ resumes) on {'+'.join(map(str, args.stages))} stages in {time.time() - started:.0f} s wall; runs in {root}")
    if args.json:
        _bench.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
