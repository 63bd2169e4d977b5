"""One evaluated 2-iteration loop run shared by every test module that needs one (held-out evaluation, trackers,
the live report and its page in a browser), so the suite pays for it once.

The CPU demo tasks, two trained and the third held out; `--report-to tensorboard,mlflow,wandb`. A module fixture
cannot be shared across modules (or across tests/rollout and tests/report), so the run lives under pytest's base
temporary directory for the session: the first caller runs the loop, later callers find it finished there.
After each iteration the loop's own RUN/report.html is copied aside (`report_after`), to show it was rewritten
while the loop ran.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "cpu_tasks"
HELD_OUT = "append-done"
ITERATIONS = 2
EVAL_SAMPLES = 2
REPORT_TO = "tensorboard,mlflow,wandb"
FINISHED = "finished"  # marker beside the run: the loop returned


def split_task_file(out: Path) -> tuple[Path, Path]:
    """The demo's task file as two: the trained tasks and the held-out one (workspaces still found)."""
    lines = (EXAMPLES / "tasks.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    for row in rows:
        row["workspace"]["dir"] = str((EXAMPLES / row["workspace"]["dir"]).resolve())
    train, held_out = out / "train.jsonl", out / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows if r["task_id"] != HELD_OUT))
    held_out.write_text("".join(json.dumps(r) + "\n" for r in rows if r["task_id"] == HELD_OUT))
    return train, held_out


def report_after(run_dir: Path, iteration: int) -> Path:
    """The copy of RUN/report.html taken when the loop reported `iteration`."""
    return run_dir.parent / f"report-after-{iteration}.html"


def evaluated_loop_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared run's directory, running the loop if this session has not yet."""
    from polar_mitm.loop.config import LoopConfig
    from polar_mitm.loop.loop import Loop

    base = tmp_path_factory.getbasetemp() / "evaluated-loop"
    run_dir = base / "run"
    if (base / FINISHED).exists():
        return run_dir
    shutil.rmtree(base, ignore_errors=True)  # a run an earlier caller did not finish
    base.mkdir(parents=True)
    train, held_out = split_task_file(base)
    cfg = LoopConfig(
        tasks=train,
        run_dir=run_dir,
        iterations=ITERATIONS,
        group_size=2,
        concurrency=2,
        model="tiny",
        script=EXAMPLES / "policy.json",
        learning_rate=1e-2,
        max_tokens=128,
        eval_tasks=held_out,
        eval_samples=EVAL_SAMPLES,
        report_to=REPORT_TO,
        # Every iteration trains (and logs its metrics), flat or not.
        grpo={"keep_zero_advantage_groups": True},
    )

    def keep_report(stats) -> None:
        shutil.copyfile(run_dir / "report.html", report_after(run_dir, stats.iteration))

    # Playwright's sync API keeps an event loop running in its thread (the browser test may ask for the run with a
    # browser open) and the rollouts call asyncio.run: the loop runs in a thread of its own.
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(Loop(cfg, on_iteration=keep_report).run).result()
    (base / FINISHED).touch()
    return run_dir
