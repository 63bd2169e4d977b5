"""LLM judges: rewards beyond a test script, applied to a finished rollout's sessions before its rewards are written.

A task's `judge` (task file, tasks/judge_spec.py) names a mode; this registry picks its class once, as codecs/ does
for providers, and judging.py runs any of them the same way (trace, cache, client, files, rewards):

- `rubric` (rubric.py): one call per session, a score on the task's scale;
- `group` (group.py): one call ranks a whole GRPO group, 0..1 per session (ART's RULER);
- `reference` (reference.py): yes/no against the task's reference answer.

Judges run after the sessions, never inside the runner: their calls go to `--judge-url` directly (client.py), never
through a gateway of the run, so they are never recorded and never trained on. What they said is kept per session
(storage/judgments.py).
"""

from __future__ import annotations

from polar_mitm.judges.base import JudgeMode
from polar_mitm.judges.group import GroupMode
from polar_mitm.judges.reference import ReferenceMode
from polar_mitm.judges.rubric import RubricMode
from polar_mitm.tasks.judge_spec import JUDGE_MODES

MODES: dict[str, JudgeMode] = {mode.name: mode for mode in (RubricMode(), GroupMode(), ReferenceMode())}
assert tuple(MODES) == JUDGE_MODES, "the task file's modes and the registry's must be the same"

__all__ = ["MODES", "JudgeMode"]
