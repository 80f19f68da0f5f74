"""Installed names: one distribution, one import namespace, the `strata` command."""

from __future__ import annotations

import pathlib
from importlib.metadata import distribution

import pytest

import strata
from strata.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"strata {strata.__version__}"
    assert strata.__version__ == distribution("strata-training").version


def test_directories_install_under_the_strata_namespace():
    import strata.coordinator.core
    import strata.protos.strata_pb2
    import strata.worker.agent

    assert pathlib.Path(strata.coordinator.core.__file__).parent == ROOT / "coordinator"
    assert pathlib.Path(strata.worker.agent.__file__).parent == ROOT / "worker"
    assert pathlib.Path(strata.protos.strata_pb2.__file__).parent == ROOT / "protos"
    top = (distribution("strata-training").read_text("top_level.txt") or "strata").split()
    assert top in (["strata"], [])  # nothing else at the top level
