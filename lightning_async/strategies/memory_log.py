"""What each pipeline stage holds in memory, gathered from every rank and logged once (MiB per stage)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info


def gather_memory_reports(strategy) -> list[dict]:
    """Every rank's :meth:`PipelineRuntime.memory_report`, with its stage, replica and (CUDA) fit peak."""
    report = dict(strategy.runtime.memory_report(), stage=strategy.stage, replica=strategy.data_parallel_rank)
    if strategy.root_device.type == "cuda":
        report["cuda_peak_allocated"] = torch.cuda.max_memory_allocated(strategy.root_device)
    if not (dist.is_initialized() and strategy.world > 1):
        return [report]
    reports = [None] * strategy.world
    dist.all_gather_object(reports, report)
    return reports


def log_memory_reports(reports: list[dict], logger) -> None:
    """On rank 0: one info line per stage of replica 0, and ``train/memory/stage<S>/<what>_mib`` metrics (under
    ``train/``, after the loss: a group of their own came before it on TensorBoard's first screen)."""
    for r in reports:
        if r["replica"] != 0:
            continue
        sizes = {k: v / 2**20 for k, v in r.items() if k not in ("stage", "replica", "in_flight_microbatches")}
        rank_zero_info(f"pipeline memory, stage {r['stage']}: " + ", ".join(f"{k} {v:.1f} MiB" for k, v in sizes.items()))
        if logger is not None:
            logger.log_metrics({f"train/memory/stage{r['stage']}/{k}_mib": v for k, v in sizes.items()})
