"""A training that does not report to MLflow does not import it (train/tracker_imports.py): TRL would at its own
import, ~1 s of CPU at every training start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from polar_mitm.train.tracker_imports import MLFLOW_SWITCH, skip_unrequested_tracker_imports


@pytest.mark.parametrize(
    "report_to,switched_off",
    [
        ([], True),
        (["none"], True),
        (["tensorboard", "wandb"], True),
        (["tensorboard", " MLflow"], False),
        (["all"], False),
    ],
)
def test_mlflow_is_left_out_unless_the_run_reports_to_it(monkeypatch, report_to, switched_off):
    monkeypatch.delenv(MLFLOW_SWITCH, raising=False)
    skip_unrequested_tracker_imports(report_to)
    assert (os.environ.get(MLFLOW_SWITCH) == "TRUE") is switched_off


def test_a_switch_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv(MLFLOW_SWITCH, "FALSE")
    skip_unrequested_tracker_imports([])
    assert os.environ[MLFLOW_SWITCH] == "FALSE"


def test_with_the_switch_trls_trainer_imports_without_mlflow():
    """What the switch relies on: TRL's GRPO trainer (its profiling module among it) imports without MLflow, which
    is installed here (the loop's MLflow tracker is tested with it)."""
    code = (
        "import importlib.util, sys\n"
        "from polar_mitm.train.tracker_imports import skip_unrequested_tracker_imports\n"
        "skip_unrequested_tracker_imports(['tensorboard'])\n"
        "import polar_mitm.train.grpo_trainer\n"
        "print(importlib.util.find_spec('mlflow') is not None, 'mlflow' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != MLFLOW_SWITCH}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # the last line: importing W&B may say something first (its offline mode, when a test before set it)
    assert out.stdout.splitlines()[-1].split() == ["True", "False"], out.stdout
