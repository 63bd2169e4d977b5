"""Trackers a training does not report to are not imported.

TRL imports MLflow at its own import whenever MLflow is installed (`trl.extras.profiling`, to time its steps into
it), which is ~1 s of CPU at every training start (`polar-mitm grpo`, each loop process) on a machine with the
`trackers` extra, for runs that never report to MLflow. transformers' own switch (`DISABLE_MLFLOW_INTEGRATION`)
turns that off; it must be set before TRL is first imported, and only where the run does not ask for MLflow
(transformers' MLflow callback honours the same switch). The loop's own MLflow tracker (loop/trackers.py) imports
MLflow itself and is not affected.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

MLFLOW_SWITCH = "DISABLE_MLFLOW_INTEGRATION"


def skip_unrequested_tracker_imports(report_to: Iterable[str]) -> None:
    """Before TRL is imported: leave MLflow out of this process (and the trainer processes it starts) unless
    `report_to` names it or asks for every installed tracker (`all`). A value the user set is kept."""
    names = {name.strip().lower() for name in report_to}
    if not names & {"mlflow", "all"}:
        os.environ.setdefault(MLFLOW_SWITCH, "TRUE")
