"""The family study's findings (tools/family_advice, over the depth study's code) on synthetic run folders and
made-up rows, and the shipped findings (what probe and plan print from them: test_advice_output.py)."""

from __future__ import annotations

import json

from lightning_async.compare.synthetic import write_fake_run
from lightning_async.tools.depth_study import SeedRow, collect, seed_rows
from lightning_async.tools.family_advice import (
    BPE_FINDINGS,
    FAMILY_FOLDER,
    configurations,
    family_advice,
    load_rows,
    main,
    ranking,
)

SYNC = {0: 2.40, 1: 2.50, 2: 2.45}


def fake_family(root, schedule: str, mode: str, finals: dict[int, float], optimizer: str = "adamw",
                folder: str = "family") -> None:
    for seed, final in finals.items():
        write_fake_run(root / f"{folder}-{schedule}" / "runs" / f"{optimizer}-{mode}-lr0.01-s{seed}",
                       val_loss={200: 3.0, 400: final})


def rows(optimizer: str, schedule: str, correction: str, values: list[float]) -> list[SeedRow]:
    return [SeedRow(optimizer, schedule, correction, seed, gap, 1.0) for seed, gap in enumerate(values)]


def test_rows_pair_every_schedule_with_the_sync_run_of_its_seed(tmp_path, capsys) -> None:
    fake_family(tmp_path, "2bw", "sync", SYNC)
    fake_family(tmp_path, "wpipe-2", "delayed", {s: v + 0.10 for s, v in SYNC.items()})
    fake_family(tmp_path, "paci-4", "delayed", {s: v + 0.01 * s for s, v in SYNC.items()})
    fake_family(tmp_path, "pipedream-4", "delayed-ef", {0: 2.6})
    write_fake_run(tmp_path / "evidence-depth-2bw" / "runs" / "adamw-sync-lr0.01-s0", val_loss={400: 1.0})  # not ours
    found = {(r.profile, r.correction, r.seed): round(r.gap, 5) for r in seed_rows(collect(tmp_path, FAMILY_FOLDER)[0])}
    assert found == {("wpipe-2", "none", s): 0.1 for s in SYNC} | {("paci-4", "none", s): 0.01 * s for s in SYNC} | {
        ("pipedream-4", "ef", 0): 0.2}
    out_file = tmp_path / "findings.json"
    assert main([str(tmp_path), "--json", str(out_file)]) == 0
    assert "family-*" not in capsys.readouterr().err
    assert len(json.loads(out_file.read_text())["rows"]) == 7
    assert main([str(tmp_path / "nothing")]) == 2 and "family-* studies" in capsys.readouterr().err


def test_the_bpe_vocabulary_reads_its_own_folders(tmp_path, capsys) -> None:
    """``--vocabulary bpe`` pairs the ``family-bpe-*`` runs with the BPE sync runs, never the byte model's."""
    fake_family(tmp_path, "2bw", "sync", SYNC)
    fake_family(tmp_path, "paci-4", "delayed", {s: v + 0.30 for s, v in SYNC.items()})
    fake_family(tmp_path, "2bw", "sync", {s: v + 1.0 for s, v in SYNC.items()}, folder="family-bpe")
    fake_family(tmp_path, "paci-4", "delayed", {s: v + 1.05 for s, v in SYNC.items()}, folder="family-bpe")
    out_file = tmp_path / "bpe.json"
    assert main(["--vocabulary", "bpe", str(tmp_path), "--json", str(out_file)]) == 0
    gaps = [round(r["gap"], 5) for r in json.loads(out_file.read_text())["rows"]]
    assert gaps == [0.05] * 3
    capsys.readouterr()
    assert main([str(tmp_path / "nothing"), "--vocabulary", "bpe"]) == 2
    assert "family-bpe-* studies" in capsys.readouterr().err


def test_ranking_tells_apart_only_what_the_paired_interval_excludes() -> None:
    found = configurations(
        rows("adamw", "paci-4", "none", [0.020, 0.030, 0.025])
        + rows("adamw", "2bw", "ef", [0.010, 0.080, 0.030])  # larger mean, noisy difference: not told apart
        + rows("adamw", "2bw", "none", [0.200, 0.220, 0.210])  # consistently larger: behind
        + rows("muon", "2bw", "none", [0.010, 0.012, 0.011])
    )
    mine = [m for m in found if m.optimizer == "adamw"]
    best, tied, behind = ranking(mine)
    assert (best.schedule, best.correction) == ("paci-4", "none")
    assert [(m.schedule, m.correction) for m in tied] == [("2bw", "ef")]
    assert [(m.schedule, m.correction) for m, _ in behind] == [("2bw", "none")] and behind[0][1].low > 0
    text = family_advice(["adamw", "lion"], rows=[r for m in found for r in rows(m.optimizer, m.schedule, m.correction,
                                                                                  list(m.gaps.values()))])
    first, adamw, lion = text.splitlines()
    assert "smallest gap muon + 2bw + no correction: +0.011" in first
    assert adamw.startswith("adamw alone: smallest gap adamw + paci-4 + no correction: +0.025")
    assert "not told apart from it: adamw + 2bw + EF (+0.040)" in adamw and "behind it" in adamw
    assert lion == "lion: not measured in the family study (measured: adamw, muon)."
    assert "not measured" in family_advice(rows=[])
    bpe = rows("adamw", "2bw", "none", [0.30, 0.31, 0.29]) + rows("adamw", "wpipe-2", "none", [0.10, 0.11, 0.12])
    with_bpe = family_advice(["adamw", "lion"], rows=rows("adamw", "2bw", "none", [0.2, 0.2, 0.2]), bpe_rows=bpe)
    assert with_bpe.splitlines()[-1].startswith(
        "adamw alone on the BPE-1024 nano (C7b, 20 tokens per parameter): smallest gap adamw + wpipe-2 + no correction: +0.110")
    assert "lion alone on the BPE" not in with_bpe  # (not measured there: no line)


def test_shipped_findings_rank_as_docs_results_c7_says() -> None:
    shipped = configurations(load_rows())
    assert {m.optimizer for m in shipped} == {"adamw", "muon", "soap"}
    adamw = [m for m in shipped if m.optimizer == "adamw"]
    assert all(len(m.gaps) == 5 for m in adamw)
    best, tied, behind = ranking(adamw)
    assert (best.schedule, best.correction) == ("paci-4", "none")  # C7: PACI-4's gap is the smallest for AdamW
    assert ("pipedream-4", "none") in {(m.schedule, m.correction) for m, _ in behind}


def test_shipped_bpe_findings_rank_as_docs_results_c7b_says() -> None:
    shipped = configurations(load_rows(BPE_FINDINGS))
    assert {m.optimizer for m in shipped} == {"adamw", "muon", "soap"} and all(len(m.gaps) == 5 for m in shipped)
    adamw = [m for m in shipped if m.optimizer == "adamw"]
    best, tied, behind = ranking(adamw)
    assert (best.schedule, best.correction) == ("paci-4", "none")
    assert ("wpipe-2", "none") in {(m.schedule, m.correction) for m in tied}  # unlike on bytes
    assert {(m.schedule, m.correction) for m, _ in behind} == {("2bw", "none"), ("pipedream-4", "none"),
                                                               ("pipedream-4", "ef")}
    assert "adamw alone on the BPE-1024 nano" in family_advice(["adamw"])
    soap = [m for m in shipped if m.optimizer == "soap"]  # C7b: only plain PipeDream-4 is behind
    assert {(m.schedule, m.correction) for m, _ in ranking(soap)[2]} == {("pipedream-4", "none")}
