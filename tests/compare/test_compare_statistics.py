"""Intervals over seeds (compare.statistics), their use in the gap table, probe's recommendation test, and the paper's
numbers as data. References are hand-computed from the textbook t quantiles; no scipy."""

from __future__ import annotations

import ast
import math
import statistics
from pathlib import Path

import pytest

from lightning_async.compare import build_rows, render_tables
from lightning_async.compare.events import Run
from lightning_async.compare.paper import NEWS, PAPER_REFERENCE, PAPER_RESULTS
from lightning_async.compare.ranking import recommend
from lightning_async.compare.render import fmt_gap, fmt_recovered
from lightning_async.compare.statistics import (
    Interval,
    critical_t,
    mean_interval,
    ratio_interval,
    t_cdf,
    t_quantile,
)
from lightning_async.identity import RunIdentity
from lightning_async.tools.probe import recommendation

# two-sided 95% critical values t(0.975, df) from any printed table
T_TABLE = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 9: 2.262, 29: 2.045}


@pytest.mark.parametrize("df,expected", sorted(T_TABLE.items()))
def test_t_quantiles_match_the_table(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=6e-4)
    assert t_quantile(0.025, df) == pytest.approx(-expected, abs=6e-4)
    assert t_cdf(t_quantile(0.975, df), df) == pytest.approx(0.975, abs=1e-9)


def test_t_distribution_limits_and_symmetry():
    assert t_quantile(0.9, 2) == pytest.approx(1.886, abs=6e-4)  # the 80% two-sided value for n=3
    assert t_quantile(0.975, 1e6) == pytest.approx(1.960, abs=1e-3)  # the normal limit
    assert t_cdf(0.0, 3) == 0.5 and t_cdf(-2.0, 5) == pytest.approx(1 - t_cdf(2.0, 5), abs=1e-12)
    assert t_cdf(1.0, 1) == pytest.approx(0.75, abs=1e-12)  # Cauchy: 1/2 + atan(1)/pi
    assert critical_t(3) == pytest.approx(4.303, abs=6e-4)
    with pytest.raises(ValueError, match="at least two"):
        critical_t(1)
    with pytest.raises(ValueError, match=r"p must be in \(0, 1\)"):
        t_quantile(1.0, 3)


def test_mean_interval_by_hand():
    # 1, 2, 3, 4: mean 2.5, sd sqrt(5/3) = 1.29099, SE 0.645497; t(0.975, 3) = 3.18245: half-width 2.05426
    interval = mean_interval([1.0, 2.0, 3.0, 4.0])
    assert (interval.low, interval.high) == (pytest.approx(0.44574, abs=1e-4), pytest.approx(4.55426, abs=1e-4))
    assert interval.n == 4 and interval.level == 0.95 and interval.excludes(0.0) and not interval.excludes(3.0)
    # three seeds: 2 standard errors is an 82% interval, the 95% one needs 4.30
    values = [0.30, 0.28, 0.32]
    se = statistics.stdev(values) / math.sqrt(3)
    assert mean_interval(values).high - 0.30 == pytest.approx(4.303 * se, rel=2e-4)
    assert 2 * t_cdf(2.0, 2) - 1 == pytest.approx(0.8165, abs=1e-4)  # P(|T| < 2) with 2 degrees of freedom
    assert mean_interval([0.3]) is None


def test_fieller_ratio_interval_by_hand():
    # numerators a = (0.20, 0.13, 0.17), denominators b = (0.30, 0.26, 0.28); n = 3, q = t^2 / n = 4.30265^2 / 3
    a, b = [0.20, 0.13, 0.17], [0.30, 0.26, 0.28]
    q = 4.302653 ** 2 / 3
    ma, mb = 0.5 / 3, 0.28
    saa = statistics.variance(a)  # 0.0012333
    sbb = statistics.variance(b)  # 0.0004
    sab = ((0.2 - ma) * 0.02 + (0.13 - ma) * -0.02 + (0.17 - ma) * 0.0) / 2  # 0.0007
    big_a, big_b, big_c = mb * mb - q * sbb, ma * mb - q * sab, ma * ma - q * saa
    root = math.sqrt(big_b ** 2 - big_a * big_c)
    interval = ratio_interval(a, b)
    assert interval.low == pytest.approx((big_b - root) / big_a, abs=1e-6)
    assert interval.high == pytest.approx((big_b + root) / big_a, abs=1e-6)
    # at each end the t statistic of mean(a - r b) is exactly the critical value (that is what the interval is)
    for r in (interval.low, interval.high):
        d = [x - r * y for x, y in zip(a, b)]
        t = abs(statistics.fmean(d)) / (statistics.stdev(d) / math.sqrt(3))
        assert t == pytest.approx(4.302653, rel=1e-5)
    assert interval.low < ma / mb < interval.high


def test_fieller_is_unbounded_when_the_denominator_is_not_told_from_zero():
    gaps = [0.11, -0.10, 0.02]  # Lion-like: mean +0.01, the gap's own t interval includes 0
    assert not mean_interval(gaps).excludes(0.0)
    interval = ratio_interval([0.01, 0.02, -0.01], gaps)
    assert not interval.bounded and interval.describe() == "95% CI unbounded, n=3"
    assert ratio_interval([0.1], [0.2]) is None
    with pytest.raises(ValueError, match="paired values"):
        ratio_interval([0.1, 0.2], [0.3])


def test_interval_helpers():
    interval = Interval(-0.5, -0.1, 0.95, 3)
    assert interval.below(0.0) and interval.excludes(0.0) and not interval.below(-0.2)
    assert interval.scaled(100) == Interval(-50.0, -10.0, 0.95, 3)
    assert interval.describe() == "95% CI -0.500 to -0.100, n=3"


# ---- rows and cells ------------------------------------------------------------------------------------
def _runs(finals: dict[str, list[float]], optimizer: str = "adamw") -> list[Run]:
    """In-memory runs: category name (sync, async, or a correction) -> final val loss per seed 0, 1, ..."""
    runs = []
    for name, values in finals.items():
        for seed, value in enumerate(values):
            if name == "sync":
                ident = RunIdentity(optimizer=optimizer, mode="sync", seed=seed)
            elif name == "async":
                ident = RunIdentity(optimizer=optimizer, mode="delayed", seed=seed)
            else:
                ident = RunIdentity(optimizer=optimizer, mode="delayed", correction=name, seed=seed)
            runs.append(Run(Path(f"{optimizer}-{name}-s{seed}"), ident, {"val/loss": [(100, value)]}, done=True))
    return runs


def test_gap_and_share_cells_state_n_and_the_interval():
    (row,) = build_rows(_runs({"sync": [1.60, 1.62, 1.61], "async": [1.90, 1.88, 1.89], "ef": [1.70, 1.75, 1.72]}))
    # per-seed gaps 0.30, 0.26, 0.28: mean 0.28, sd 0.02, half-width 4.30265 * 0.02 / sqrt(3) = 0.04968
    assert fmt_gap(row) == "+0.280 (+17.4%) (95% CI +0.230 to +0.330, n=3)"
    # Fieller on a = (0.20, 0.13, 0.17), b = (0.30, 0.26, 0.28): [0.3445, 0.7709] (test_fieller_ratio_interval_by_hand)
    assert fmt_recovered(row) == "60% (95% CI 34% to 77%, n=3)"
    assert row.recovered_n("ef") == 3


def test_share_uses_only_the_seeds_that_ran_all_three_modes():
    # seed 2 has no EF run: the share's n is 2 and its means are over seeds 0 and 1 only
    (row,) = build_rows(_runs({"sync": [1.6, 1.6, 1.6], "async": [2.0, 2.2, 2.4], "ef": [1.8, 1.9]}))
    assert row.recovered_n("ef") == 2
    assert row.recovered_by("ef") == pytest.approx((0.2 + 0.3) / (0.4 + 0.6))


def test_gap_is_paired_when_modes_ran_different_seeds():
    # seed 2 has no async run: the gap is over seeds 0 and 1 only (0.30 and 0.32), not mean(async) - mean(sync)
    (row,) = build_rows(_runs({"sync": [1.60, 1.62, 1.90], "async": [1.90, 1.94]}))
    assert row.gap == pytest.approx(0.31) and row.gap_seeds.n == 2
    assert fmt_gap(row).endswith("n=2)")


# ---- probe's recommendation --------------------------------------------------------------------------------
SYNC, ASYNC = [2.00, 2.10, 2.05], [2.40, 2.50, 2.45]


def test_recommends_only_a_significant_winner():
    # EF beats no correction by -0.29/-0.30/-0.29 and the look-ahead by -0.20/-0.18/-0.20: both intervals below 0
    rows = build_rows(_runs({"sync": SYNC, "async": ASYNC, "ef": [2.11, 2.20, 2.16], "nesterov": [2.31, 2.38, 2.36]}))
    rec = recommend(rows)["adamw"]
    assert (rec.best, rec.runner_up, rec.significant) == ("ef", "nesterov", True)
    diffs = [2.11 - 2.31, 2.20 - 2.38, 2.16 - 2.36]
    assert rec.vs_runner_up.mean == pytest.approx(statistics.fmean(diffs))
    half = 4.302653 * statistics.stdev(diffs) / math.sqrt(3)
    assert rec.vs_runner_up.interval.high == pytest.approx(statistics.fmean(diffs) + half, abs=1e-6)
    text = recommendation(rec)
    assert text.startswith("Recommendation: ef: its final loss differs by -0.2933 (95% CI ")
    assert "against the runner-up, nesterov, both below zero at 95%" in text


def test_no_significant_difference_when_the_runner_up_is_within_the_interval():
    # EF - look-ahead per seed: -0.10, +0.15, -0.05 (mean -0.0) -- both beat no correction, neither beats the other
    rows = build_rows(_runs({"sync": SYNC, "async": ASYNC, "ef": [2.10, 2.30, 2.20], "nesterov": [2.20, 2.15, 2.25]}))
    rec = recommend(rows)["adamw"]
    assert rec.vs_none.significant and not rec.vs_runner_up.significant and not rec.significant
    text = recommendation(rec)
    assert text.startswith(f"No significant difference: the best correction tried, {rec.best}, does not end lower")
    assert f"against the runner-up, {rec.runner_up}" in text and "95% CI" in text
    assert "a recommendation needs both intervals below zero" in text


def test_one_seed_is_never_a_recommendation():
    # Muon-like single seed: a correction "recovers 186%" of a 0.006 gap, which one seed cannot back
    rows = build_rows(_runs({"sync": [1.632], "async": [1.638], "ef": [1.633], "nesterov": [1.627]}, "muon"))
    rec = recommend(rows)["muon"]
    assert rec.best == "nesterov" and rec.share == pytest.approx(11 / 6, abs=1e-3) and not rec.significant
    text = recommendation(rec)
    assert text.startswith("No significant difference") and "one seed gives no interval; rerun with --seeds 3" in text
    assert "(n=1, no interval)" in text


def test_a_correction_that_does_not_lower_the_loss_is_not_recommended():
    rows = build_rows(_runs({"sync": SYNC, "async": ASYNC, "dc-asgd": [2.45, 2.52, 2.50]}))
    text = recommendation(recommend(rows)["adamw"])
    assert text.startswith("Recommendation: no correction: the best one tried, dc-asgd, does not lower the final loss")
    assert "could be ranked" in recommendation(None)


def test_a_forward_level_winner_says_the_pipeline_cannot_run_it():
    rows = build_rows(_runs({"sync": SYNC, "async": ASYNC, "weight-prediction": [2.11, 2.20, 2.16],
                             "ef": [2.31, 2.38, 2.36]}, "mars"))
    text = recommendation(recommend(rows)["mars"])
    assert "corrections/weight-prediction" in text and "pipeline cannot run it" in text and "pipeline/async" not in text


# ---- the paper's numbers as data -----------------------------------------------------------------------------
def test_paper_numbers_carry_their_source_and_news_values_are_marked_in_tables():
    assert PAPER_REFERENCE["adamw"] == (2.612, 2.890, 2.640)
    from_news = {r.optimizer for r in PAPER_RESULTS if r.source == NEWS}
    assert from_news == {"mars", "normuon", "lion"}
    rows = build_rows(_runs({"sync": SYNC, "async": ASYNC, "ef": [2.11, 2.20, 2.16]}, "mars")
                      + _runs({"sync": SYNC, "async": ASYNC}, "muon"))
    for markdown in (False, True):
        text = render_tables(rows, paper=True, markdown=markdown)
        lines = [line for line in text.splitlines() if "(paper, 360M" in line]
        for optimizer in from_news:
            mine = [line for line in lines if line.lstrip("| ").startswith(f"{optimizer} (paper")]
            assert mine and all("news summary, not the paper's tables" in line for line in mine), mine
        muon = [line for line in lines if line.lstrip("| ").startswith("muon (paper")]
        assert muon and all("news" not in line for line in muon)
        assert "machine-written summary of the paper" in text and "not the paper's tables" in text


# ---- no import circle inside compare --------------------------------------------------------------------------
def test_compare_modules_import_one_way():
    """Every import between compare's modules (top-level or inside functions) points one way: no cycle."""
    package = Path(__file__).resolve().parents[2] / "lightning_async" / "compare"
    edges: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        name = path.stem
        edges[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_async.compare."):
                edges[name].add(node.module.split(".")[2])
    edges.pop("__init__", None)
    edges.pop("__main__", None)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in edges.get(start, ()))

    circles = sorted(name for name in edges if reaches(name, name, {name}))
    assert circles == [], f"import circle among compare modules: {circles}"


def test_compare_prints_and_reports_which_correction(tmp_path, capsys):
    from lightning_async.compare import compare_main
    from lightning_async.compare.synthetic import write_fake_run

    finals = {"sync": SYNC, "async": ASYNC, "ef": [2.11, 2.20, 2.16], "nesterov": [2.31, 2.38, 2.36]}
    for name, values in finals.items():
        kwargs = {"sync": dict(mode="sync"), "async": dict(mode="delayed")}.get(name, dict(mode="delayed", correction=name))
        for seed, value in enumerate(values):
            write_fake_run(tmp_path / "runs" / f"{name}-s{seed}", seed=seed, val_loss={10: value}, **kwargs)
    assert compare_main([str(tmp_path / "runs"), "--output", str(tmp_path / "out"), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "== which correction (paired by seed) ==\nadamw: Recommendation: ef: its final loss differs by" in out
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Which correction (paired by seed)" in report and "against the runner-up, nesterov" in report
