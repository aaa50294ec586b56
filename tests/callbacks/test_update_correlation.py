"""``UpdateCorrelation``: its statistics against a direct computation from the reference loop's weights, and a fit
that measures is the fit that does not."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch.loggers.logger import Logger

from lightning_async.callbacks import DelaySimulation, UpdateCorrelation
from lightning_async.callbacks.update_correlation import UpdateSeries
from test_callbacks import STEPS, make_module, make_trainer, reference, train_loader, val_loader, weights

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden"),
    pytest.mark.usefixtures("one_thread"),
]


class CapturedMetrics(Logger):
    """Keeps what is logged, in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, float] = {}

    @property
    def name(self) -> str:
        return "captured"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.update(metrics)


def direct_statistics(updates: list[torch.Tensor]) -> dict[str, float]:
    """The four statistics, averaged over t >= 2 of ``updates``, written out by hand."""
    rows = []
    for t in range(2, len(updates)):
        u, u1, u2 = updates[t], updates[t - 1], updates[t - 2]
        d, d1 = u - u1, u1 - u2
        rows.append({
            "diff_correlation": float(torch.dot(d, d1) / (d.norm() * d1.norm())),
            "lambda_star": float(torch.dot(d, d1) / torch.dot(d1, d1)),
            "diff_size": float(d.norm() / u.norm()),
            "cosine": float(torch.dot(u, u1) / (u.norm() * u1.norm())),
        })
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def flat_change(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(before[n] - after[n]).reshape(-1).double() for n in before])


def test_series_reads_a_trend_as_one_and_alternation_as_minus_one() -> None:
    v, w = torch.randn(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    trend, alternating = UpdateSeries(), UpdateSeries()
    for t in range(6):
        trend.add(v + t * w)  # d_t = w every step: EF's extrapolation is exact
        alternating.add(v * (-1) ** t)
    assert trend.count == alternating.count == 4
    assert trend.means()["diff_correlation"] == pytest.approx(1.0) and trend.means()["lambda_star"] == pytest.approx(1.0)
    assert alternating.means()["diff_correlation"] == pytest.approx(-1.0)
    assert alternating.means()["cosine"] == pytest.approx(-1.0)
    assert math.isnan(UpdateSeries().means()["cosine"])


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_measures_the_delayed_updates_of_the_run_and_changes_nothing(optimizer: str) -> None:
    logger = CapturedMetrics()
    measured = make_module(optimizer)
    make_trainer([DelaySimulation(delay=1), UpdateCorrelation(start_fraction=0.5)], logger=logger).fit(
        measured, train_loader(), val_loader())
    plain = make_module(optimizer)
    make_trainer([DelaySimulation(delay=1)]).fit(plain, train_loader(), val_loader())
    assert all(torch.equal(a, b) for a, b in zip(weights(measured).values(), weights(plain).values()))

    path = reference(optimizer, delay=1, lam=0.0)  # x(0..STEPS); with no correction x(t+1) = x(t) - u_t
    updates = [flat_change(path[t], path[t + 1]) for t in range(STEPS // 2, STEPS)]
    expected = direct_statistics(updates)
    assert logger.metrics["update/steps"] == len(updates) - 2
    for key, value in expected.items():
        assert logger.metrics[f"update/{key}"] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_rejects_a_bad_fraction_and_a_run_without_max_steps() -> None:
    with pytest.raises(ValueError, match="start_fraction"):
        UpdateCorrelation(start_fraction=1.0)
    trainer = make_trainer([UpdateCorrelation()], max_steps=-1, max_epochs=1)
    with pytest.raises(ValueError, match="max_steps"):
        trainer.fit(make_module(), train_loader(), val_loader())
