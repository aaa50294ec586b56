"""Recipes by name (lightning_async.recipes_index): resolution of --config values, the `recipes` command,
study files and the packaging that ships the recipes (tests/cli/test_wheel.py installs a real wheel)."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest
from setuptools import find_packages

from lightning_async.recipes_index import (
    RecipeNotFound,
    copy_recipe,
    description,
    find_recipe,
    listing,
    recipe_names,
    recipes_main,
    recipes_root,
    resolve_config,
    resolve_config_args,
)
from lightning_async.tools.study import StudyError, build_parser, load_study, study_from_args

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "recipes"


def test_root_is_the_repositorys_recipes_folder():
    assert recipes_root().samefile(SHIPPED)
    files = {p.relative_to(SHIPPED).with_suffix("").as_posix() for p in SHIPPED.rglob("*.yaml")}
    names = recipe_names()
    assert sorted(names) == sorted(files) and len(names) == len(set(names))
    assert names[0] == "quickstart"  # top level first, then folder by folder
    assert {"optimizers/muon", "modes/delayed-ef", "pipeline/async", "study/quickstart"} <= set(names)


@pytest.mark.parametrize("spelling", ["optimizers/muon", "optimizers/muon.yaml", "recipes/optimizers/muon.yaml"])
def test_names_resolve_from_any_directory(spelling, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    resolved = resolve_config(spelling)
    assert Path(resolved).samefile(SHIPPED / "optimizers" / "muon.yaml")
    assert find_recipe(spelling) == Path(resolved)


def test_paths_and_inline_yaml_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quickstart").write_text("trainer: {max_steps: 1}\n")  # a local file wins over the shipped name
    (tmp_path / "mine.yaml").write_text("model: {optimizer: adamw}\n")
    assert resolve_config("quickstart") == "quickstart"
    assert resolve_config("mine.yaml") == "mine.yaml"
    assert resolve_config(str(tmp_path / "mine.yaml")) == str(tmp_path / "mine.yaml")
    assert resolve_config("{trainer: {max_steps: 3}}") == "{trainer: {max_steps: 3}}"  # jsonargparse parses it
    assert Path(resolve_config("modes/sync")).samefile(SHIPPED / "modes" / "sync.yaml")


def test_unknown_names_are_refused_with_close_matches(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeNotFound, match=r"--config optimizers/muno: no such file, and no shipped recipe of "
                                             r"that name\. Did you mean optimizers/muon[,?]"):
        resolve_config("optimizers/muno")
    with pytest.raises(RecipeNotFound, match="`lightning-async recipes` lists the recipes"):
        resolve_config("nothing-like-it/at-all.yaml")
    with pytest.raises(RecipeNotFound):
        resolve_config("../recipes/quickstart")  # no escaping the recipes folder
    assert find_recipe("/quickstart") is None


def test_every_config_flag_form_is_resolved_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["fit", "--config", "quickstart", "-c", "optimizers/muon", "--config=modes/delayed-ef",
            "--model.optimizer", "muon", "--trainer.max_steps", "3", "--config", "{seed_everything: 1}"]
    out = resolve_config_args(argv)
    assert out[0] == "fit" and out[1] == "--config" and out[3] == "-c" and out[7:] == argv[7:]
    assert Path(out[2]).samefile(SHIPPED / "quickstart.yaml")
    assert Path(out[4]).samefile(SHIPPED / "optimizers" / "muon.yaml")
    assert out[5].startswith("--config=") and Path(out[5][9:]).samefile(SHIPPED / "modes" / "delayed-ef.yaml")
    assert resolve_config_args(out) == out  # resolving twice changes nothing


def test_description_is_the_first_comment_line(tmp_path):
    assert description(SHIPPED / "modes" / "sync.yaml") == (SHIPPED / "modes" / "sync.yaml").read_text(
    ).splitlines()[0].lstrip("# ")
    plain = tmp_path / "plain.yaml"
    plain.write_text("model: {optimizer: adamw}  # not a description\n# later comment\n")
    assert description(plain) == ""
    long = tmp_path / "long.yaml"
    long.write_text("\n#  " + "word " * 40 + "\nmodel: {}\n")
    assert description(long).startswith("word word") and description(long).endswith("...")
    assert len(description(long)) == 100


def test_listing_groups_by_folder_with_descriptions():
    lines = listing().splitlines()
    headers = [line for line in lines if line and not line.startswith(" ") and line.endswith("/")]
    assert headers == sorted(headers) and {"modes/", "optimizers/", "pipeline/", "study/"} <= set(headers)
    assert lines.index("(top level)") < lines.index("modes/") < lines.index("optimizers/")
    entries = [line.split()[0] for line in lines if line.startswith("  ")]
    assert entries == recipe_names()
    delayed_ef = next(line for line in lines if line.split()[:1] == ["modes/delayed-ef"])
    assert delayed_ef.endswith(description(SHIPPED / "modes" / "delayed-ef.yaml"))
    header = None  # each entry sits under its own folder's header
    for line in lines:
        if line in headers or line == "(top level)":
            header = line
        elif line.startswith("  "):
            folder = line.split()[0].rpartition("/")[0]
            assert header == (f"{folder}/" if folder else "(top level)"), line


def test_recipes_command_lists_and_copies(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert recipes_main([]) == 0 and "optimizers/muon" in capsys.readouterr().out
    assert recipes_main(["list"]) == 0 and "study/quickstart" in capsys.readouterr().out

    assert recipes_main(["copy", "optimizers/muon"]) == 0
    copied = tmp_path / "muon.yaml"
    assert copied.read_bytes() == (SHIPPED / "optimizers" / "muon.yaml").read_bytes()
    assert f"use it with --config {copied.name}" in capsys.readouterr().out
    assert resolve_config("muon.yaml") == "muon.yaml"  # the copy is what --config muon.yaml now means

    copied.write_text("edited\n")
    assert recipes_main(["copy", "optimizers/muon"]) == 2  # no silent overwrite of an edited copy
    assert "muon.yaml exists; give another DEST, or --force" in capsys.readouterr().err
    assert copied.read_text() == "edited\n"
    assert recipes_main(["copy", "optimizers/muon", "--force"]) == 0
    assert copied.read_bytes() == (SHIPPED / "optimizers" / "muon.yaml").read_bytes()

    assert recipes_main(["copy", "recipes/quickstart.yaml", "sub/mine.yaml"]) == 0  # parents are created
    assert (tmp_path / "sub" / "mine.yaml").read_bytes() == (SHIPPED / "quickstart.yaml").read_bytes()
    assert copy_recipe("modes/sync", tmp_path / "sub") == tmp_path / "sub" / "sync.yaml"  # into a folder

    assert recipes_main(["copy", "optimizers/nope"]) == 2
    assert "no shipped recipe of that name" in capsys.readouterr().err


def test_studies_resolve_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for spelling in ("quickstart", "study/quickstart", "recipes/study/quickstart.yaml"):
        study = load_study(spelling)
        assert study.name == "quickstart" and len(study.expand()) == 21
        assert [Path(b).resolve() for b in study.base] == [(SHIPPED / "quickstart.yaml").resolve()]
        assert not study.missing_files()
        configs = [a for s in study.expand() for i, a in enumerate(s.command) if s.command[i - 1] == "--config"]
        assert all(Path(c).is_file() for c in configs)
    with pytest.raises(StudyError, match="study file nope not found, and no shipped study of that name"):
        load_study("nope")


def test_study_data_override_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["--config", "quickstart", "--data-override", "study/repro-data"])
    study = study_from_args(args)
    assert Path(study.extra_configs[-1]).samefile(SHIPPED / "study" / "repro-data.yaml")
    args = build_parser().parse_args(["--config", "quickstart", "--data-override", "nope.yaml"])
    with pytest.raises(StudyError, match="--data-override nope.yaml: no such file, and no shipped recipe"):
        study_from_args(args)


def test_setup_cfg_lists_every_package_and_ships_the_recipes():
    """setup.cfg lists the packages (find: cannot see the mapped recipes folder): a new package under
    lightning_async/ that is not listed would be missing from the wheel."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    listed = config["options"]["packages"].split()
    found = find_packages(str(REPO), include=["lightning_async*"])
    assert sorted(listed) == sorted(found + ["lightning_async.recipes"]), (
        "setup.cfg [options] packages must list exactly the packages under lightning_async/ plus "
        f"lightning_async.recipes; missing: {sorted(set(found) - set(listed))}, extra: "
        f"{sorted(set(listed) - set(found) - {'lightning_async.recipes'})}")
    assert config["options"]["package_dir"].split() == ["lightning_async.recipes", "=", "recipes"]
    assert "**/*.yaml" in config["options.package_data"]["lightning_async.recipes"]


def test_unknown_recipe_name_is_one_error_line(tmp_path, monkeypatch, capsys):
    from lightning_async.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", "quickstart", "--config", "optimizers/muno"]) == 2
    assert capsys.readouterr().err.startswith(
        "error: --config optimizers/muno: no such file, and no shipped recipe of that name. Did you mean optimizers/muon"
    )
