"""A task-file line and a TaskRequest are one task both ways (service/task_requests.py), Harbor tasks and sandbox
limits included; and a loaded task goes to the service as its line would (`task_to_request`, the loop's way)."""

from __future__ import annotations

from pathlib import Path

from polar_mitm.service.task_requests import line_to_request, request_task, request_to_line, task_to_request
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
