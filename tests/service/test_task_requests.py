"""A task-file line and a TaskRequest are one task both ways (service/task_requests.py), Harbor tasks and sandbox
limits and judges (evaluator strategy rubric) included; and a loaded task goes to the service as its line would (`task_to_request`, the loop's way)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from polar_mitm.service.models import EvaluatorSpec
from polar_mitm.service.task_requests import (
    RequestError,
    line_to_request,
    request_task,
    request_to_line,
    task_to_request,
)
from polar_mitm.tasks.harbor import ConvertOptions, convert
from polar_mitm.tasks.task_file import TaskLine, parse_task

ROOT = Path(__file__).resolve().parents[2]


def harbor_lines(tmp_path: Path) -> list[dict]:
    lines, problems = convert(
        [ROOT / "examples" / "harbor_tasks"], tmp_path / "tasks.jsonl", ConvertOptions()
    )
    assert not problems and len(lines) >= 8
    return lines


def test_a_harbor_line_and_its_request_are_the_same_task_both_ways(tmp_path):
    for line in harbor_lines(tmp_path):
        request = line_to_request(line, "pi", num_samples=2)
        assert request.evaluator.strategy == "harbor"
        back = request_to_line(request)
        normal = TaskLine.model_validate(line).model_dump(exclude_defaults=True)
        assert TaskLine.model_validate(back).model_dump(exclude_defaults=True) == normal
        # run by the service from its task root, the verifier's folders found as the line's are
        task = request_task(request, tmp_path)
        assert task.harbor is not None and (task.harbor.tests / "test.sh").is_file()


def test_a_loaded_task_is_submitted_as_its_line_would_be(tmp_path):
    for line in harbor_lines(tmp_path) + [
        {
            "task_id": "t",
            "prompt": "p",
            "eval": {"command": "true", "reward": "stdout"},
            "limits": {"pids": 64},
        }
    ]:
        task = parse_task(line, tmp_path)
        request = task_to_request(task, "pi", 3, task_id="run:iter-0:" + task.task_id)
        again = request_task(request, Path("/nonexistent"))  # every folder absolute: no task root needed
        assert again.harbor == task.harbor and again.limits == task.limits
        assert (again.eval_command, again.eval_reward, again.prompt) == (
            task.eval_command,
            task.eval_reward,
            task.prompt,
        )
        assert again.workspace_dir == task.workspace_dir


JUDGED_LINES = [
    {
        "task_id": "rubric",
        "prompt": "p",
        "eval": "test -f out.txt",
        "judge": {"mode": "rubric", "rubric": "out.txt says hello", "weight": 0.5, "scale": [0, 10]},
    },
    {"task_id": "group", "prompt": "p", "eval": {"command": "true"}, "judge": {"mode": "group"}},
    {
        "task_id": "reference",
        "prompt": "p",
        "eval": "true",
        "judge": {"mode": "reference", "reference": "42"},
    },
]


def test_a_judged_line_and_its_rubric_request_are_the_same_task_both_ways(tmp_path):
    for line in JUDGED_LINES + [{**harbor_lines(tmp_path)[0], "judge": {"mode": "group"}}]:
        request = line_to_request(line, "pi", num_samples=2)
        assert request.evaluator.strategy == "rubric"
        assert request.evaluator.config["judge"]["mode"] == line["judge"]["mode"]
        back = request_to_line(request)
        normal = TaskLine.model_validate(line).model_dump(exclude_defaults=True)
        assert TaskLine.model_validate(back).model_dump(exclude_defaults=True) == normal
        task = parse_task(line, tmp_path)
        again = request_task(task_to_request(task, "pi", 2), Path("/nonexistent"))
        assert again.judge == task.judge and again.harbor == task.harbor
        assert (again.eval_command, again.eval_reward) == (task.eval_command, task.eval_reward)


def test_a_rubric_request_is_checked_as_a_task_lines_judge_is():
    judge_only = EvaluatorSpec(strategy="rubric", config={"judge": {"mode": "group"}})
    request = line_to_request(JUDGED_LINES[0], "pi").model_copy(update={"evaluator": judge_only})
    assert request_task(request, Path("/nonexistent")).eval_command == "true"  # no check: the judge decides
    for config, named in (
        ({"judge": {"mode": "rubric"}}, "judge.rubric"),  # the task file's own refusal
        ({"judge": {"mode": "group"}, "scorer": "x"}, "scorer"),
        ({"command": "true"}, "judge (required"),
    ):
        bad = request.model_copy(update={"evaluator": EvaluatorSpec(strategy="rubric", config=config)})
        with pytest.raises(RequestError, match=re.escape(named)):
            request_task(bad, Path("/nonexistent"))
