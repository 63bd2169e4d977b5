"""README's main job: serve a real small model on CPU and show what the gateway will record for each call."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from polar_mitm.engines import processes as engine_processes
from polar_mitm.processes import children
from polar_mitm.storage.run_layout import iteration_dir

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "cpu_tasks"

# The demo's training settings (benchmarks/bench_demo_learning.py measures them over seeds). Adam's first steps move
# every weight by about the learning rate: at 2e-2 one iteration on a 2-pass/2-fail group moved the tiny model's
# choice the WRONG way (interference from the other tasks' updates outweighed the group's own signal); at 3e-3 with
# two passes over the data (six steps of four sequences — about one task's group each) every informative group moved
# its choice the right way by 1.5-2 nats of log-odds. The final rollout measures the policy the last training
# produced instead of training once more for nothing.
DEMO_LEARNING_RATE = 3e-3
DEMO_EPOCHS = 2.0
DEMO_BATCH_SIZE = 4


def print_chat(
    engine_url: str, prompt: str, *, max_tokens: int, temperature: float, console: Console
) -> dict:
    """One chat request with SGLang's token-id extensions; prints text, ids and logprobs."""
    from openai import OpenAI

    from polar_mitm.engines.router import check_answering

    check_answering(engine_url, embedded=False)  # one line, not the SDK's retries and 350 lines of traceback

    client = OpenAI(base_url=f"{engine_url}/v1", api_key="polar-demo")
    started = time.perf_counter()
    completion = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=temperature,
        logprobs=True,
        extra_body={"return_token_ids": True, "return_meta_info": True},
    )
    elapsed = time.perf_counter() - started
    choice = completion.choices[0]
    extra = choice.model_extra or {}
    prompt_ids, response_ids = extra.get("prompt_token_ids", []), extra.get("response_token_ids", [])
    logprobs = [entry.logprob for entry in choice.logprobs.content]
    console.print(f"[bold]user:[/] {prompt}")
    console.print(f"[bold]{completion.model}:[/] {choice.message.content}")
    table = Table(
        title=f"{len(response_ids)} sampled tokens (prompt: {len(prompt_ids)} tokens, "
        f"finish: {choice.finish_reason}, {elapsed:.2f}s)"
    )
    table.add_column("#", justify="right")
    table.add_column("token id", justify="right")
    table.add_column("text")
    table.add_column("logprob", justify="right")
    for i, (tid, entry) in enumerate(zip(response_ids, choice.logprobs.content, strict=True)):
        table.add_row(str(i), str(tid), repr(entry.token), f"{entry.logprob:.4f}")
    console.print(table)
    meta = extra.get("meta_info", {})
    console.print(
        f"weight_version={meta.get('weight_version')} prefill={meta.get('prefill_latency', 0):.3f}s "
        f"decode={meta.get('decode_latency', 0):.3f}s sum(logprobs)={sum(logprobs):.3f}"
    )
    return {
        "prompt_ids": prompt_ids,
        "response_ids": response_ids,
        "logprobs": logprobs,
        "text": choice.message.content,
    }


def run_demo(
    *,
    model: str,
    prompt: str,
    port: int,
    console: Console,
    loop_model: str = "tiny",
    iterations: int = 4,
    run_dir: Path = Path("runs/demo"),
    learning_rate: float = DEMO_LEARNING_RATE,
    seed: int = 0,
) -> list | None:
    """Step 1: a real model answers through the engine's SGLang contract (ids + logprobs).
    Step 2: the RL loop on the CPU demo tasks — rollout through the gateway → merge → GRPO → weights pushed."""
    console.rule(f"1 · the engine: {model} on CPU, SGLang's HTTP contract")
    with console.status(f"starting the embedded engine with {model} (first run converts the model once)…"):
        proc, url = engine_processes.start_engine(model, port=port or None)
    try:
        console.print(
            f"[green]engine up[/] at {url} — {httpx.get(f'{url}/model_info').json()['served_model_name']}"
        )
        print_chat(url, prompt, max_tokens=48, temperature=0.0, console=console)
    finally:
        children.stop(proc)
    if iterations <= 0:
        return None
    console.rule(
        f"2 · the RL loop: {iterations} iterations on examples/cpu_tasks ({loop_model} + scripted choices)"
    )
    return run_loop_demo(
        console=console,
        model=loop_model,
        iterations=iterations,
        run_dir=run_dir,
        learning_rate=learning_rate,
        seed=seed,
    )


def demo_loop_config(
    *, model: str, iterations: int, run_dir: Path, learning_rate: float = DEMO_LEARNING_RATE, seed: int = 0
):
    """The LoopConfig of the demo's RL loop (also used by its benchmark and tests)."""
    from polar_mitm.loop.config import LoopConfig

    return LoopConfig(
        tasks=EXAMPLES / "tasks.jsonl",
        run_dir=run_dir,
        iterations=iterations,
        group_size=4,
        concurrency=4,
        model=model,
        script=EXAMPLES / "policy.json" if model == "tiny" else None,
        learning_rate=learning_rate,
        per_device_batch_size=DEMO_BATCH_SIZE,
        epochs=DEMO_EPOCHS,
        max_tokens=128,
        seed=seed,
        final_rollout=True,
    )


def run_loop_demo(
    *,
    console: Console,
    model: str,
    iterations: int,
    run_dir: Path,
    learning_rate: float = DEMO_LEARNING_RATE,
    seed: int = 0,
) -> list:
    """The loop with a live progress line and a table per iteration; then the reward curve, the report and a
    closing summary line."""
    from polar_mitm.loop.cli import iteration_table
    from polar_mitm.loop.loop import Loop
    from polar_mitm.loop.progress import RichLoopProgress, quiet_libraries

    cfg = demo_loop_config(
        model=model, iterations=iterations, run_dir=run_dir, learning_rate=learning_rate, seed=seed
    )
    done: list = []

    def show(stats) -> None:
        done.append(stats)
        console.print(iteration_table(done))

    console.print(
        f"each iteration: {len(cfg.tasks.read_text().splitlines())} tasks × {cfg.group_size} sessions of "
        "the reference SDK agent (openai chat, streaming) through the gateway → records → prefix-merged "
        "sequences with rewards → GRPO (TRL) → weights pushed; a last rollout measures the trained policy"
    )
    quiet_libraries()  # the live display below says what runs; library progress bars would only break it up
    started = time.monotonic()
    with RichLoopProgress(console, iterations) as progress:
        results = Loop(cfg, on_iteration=show, progress=progress).run()
    png = plot_rewards(results, run_dir / "reward.png")
    with console.status("writing the report…"):
        from polar_mitm.report import write_report

        report = write_report(run_dir)
    last = iteration_dir(run_dir, len(results) - 1)
    console.print(
        f"inspect: polar-mitm records {last / 'flows'} · polar-mitm stats {last / 'merged'} · "
        f"polar-mitm show <session> --data {last / 'merged'} --tokenizer tiny"
    )
    console.print(closing_line(results, png, report, time.monotonic() - started))
    return results


def closing_line(results, png: Path, report: Path, seconds: float) -> str:
    """`reward 0.50 → 0.92 in 4 rollouts (3 trainings), curve: …, report: …` — the demo's last line."""
    first, last = results[0].reward_mean, results[-1].reward_mean
    trainings = sum(1 for r in results if r.seconds.get("train", 0) > 0)
    return (
        f"[bold]reward {first:.2f} → {last:.2f}[/] in {len(results)} rollouts ({trainings} trainings, "
        f"{seconds / 60:.1f} min), curve: {png}, report: {report}"
    )


def plot_rewards(results, png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    xs = [r.iteration for r in results]
    ax.errorbar(
        xs, [r.reward_mean for r in results], yerr=[r.reward_std for r in results], marker="o", capsize=3
    )
    ax.set_xticks(xs)
    ax.set_xlabel("iteration (last: rollout of the trained policy)")
    ax.set_ylabel("mean reward (±std)")
    ax.set_ylim(-0.05, 1.15)
    ax.set_title("polar-mitm loop on the CPU demo tasks")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def right_choice_probabilities(checkpoint: Path, flows: Path) -> dict[str, float]:
    """Per task: the probability that `checkpoint`'s choice policy picks the task's first candidate at its first turn.

    Measurement only (the benchmark and the learning test): `examples/cpu_tasks/policy.json` lists the candidate that
    passes the task's check first; rewards come from the checks alone. The first-turn prompts are read from `flows`.
    """
    from polar_mitm.engine.generation import Engine
    from polar_mitm.engine.script import choice_probabilities
    from polar_mitm.storage.records import read_all

    engine = Engine(checkpoint, script_path=EXAMPLES / "policy.json")
    assert engine.script is not None
    first_prompts: dict[str, list[int]] = {}
    for row in sorted(read_all(flows).to_pylist(), key=lambda r: (r["task_id"] or "", r["session_id"])):
        if row["seq"] == 0 and row["prompt_ids"]:
            first_prompts.setdefault(row["task_id"], list(row["prompt_ids"]))
    probabilities = {}
    for task, prompt in sorted(first_prompts.items()):
        candidates = engine.script.candidate_ids_for(prompt, ["shell"])
        probabilities[task] = choice_probabilities([engine.score(prompt, ids) for ids in candidates])[0]
    return probabilities
