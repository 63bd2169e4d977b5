"""README's main job: serve a real small model on CPU and show what the gateway will record for each call."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from polar_mitm import procs

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "cpu_tasks"


def print_chat(engine_url: str, prompt: str, *, max_tokens: int, temperature: float, console: Console) -> dict:
    """One chat request with SGLang's token-id extensions; prints text, ids and logprobs."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{engine_url}/v1", api_key="polar-demo")
    started = time.perf_counter()
    completion = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=temperature, logprobs=True,
        extra_body={"return_token_ids": True, "return_meta_info": True},
    )
    elapsed = time.perf_counter() - started
    choice = completion.choices[0]
    extra = choice.model_extra or {}
    prompt_ids, response_ids = extra.get("prompt_token_ids", []), extra.get("response_token_ids", [])
    logprobs = [entry.logprob for entry in choice.logprobs.content]
    console.print(f"[bold]user:[/] {prompt}")
    console.print(f"[bold]{completion.model}:[/] {choice.message.content}")
    table = Table(title=f"{len(response_ids)} sampled tokens (prompt: {len(prompt_ids)} tokens, "
                        f"finish: {choice.finish_reason}, {elapsed:.2f}s)")
    table.add_column("#", justify="right")
    table.add_column("token id", justify="right")
    table.add_column("text")
    table.add_column("logprob", justify="right")
    for i, (tid, entry) in enumerate(zip(response_ids, choice.logprobs.content, strict=True)):
        table.add_row(str(i), str(tid), repr(entry.token), f"{entry.logprob:.4f}")
    console.print(table)
    meta = extra.get("meta_info", {})
    console.print(f"weight_version={meta.get('weight_version')} prefill={meta.get('prefill_latency', 0):.3f}s "
                  f"decode={meta.get('decode_latency', 0):.3f}s sum(logprobs)={sum(logprobs):.3f}")
    return {"prompt_ids": prompt_ids, "response_ids": response_ids, "logprobs": logprobs,
            "text": choice.message.content}


def run_demo(*, model: str, prompt: str, port: int, console: Console, loop_model: str = "tiny",
             iterations: int = 3, run_dir: Path = Path("runs/demo"), learning_rate: float = 2e-2) -> None:
    """Step 1: a real model answers through the engine's SGLang contract (ids + logprobs).
    Step 2: the RL loop on the CPU demo tasks — rollout through the gateway → merge → GRPO → weights pushed."""
    console.rule(f"1 · the engine: {model} on CPU, SGLang's HTTP contract")
    with console.status(f"starting the embedded engine with {model} (first run converts the model once)…"):
        proc, url = procs.start_engine(model, port=port or None)
    try:
        console.print(f"[green]engine up[/] at {url} — {httpx.get(f'{url}/model_info').json()['served_model_name']}")
        print_chat(url, prompt, max_tokens=48, temperature=0.0, console=console)
    finally:
        procs.stop(proc)
    if iterations <= 0:
        return
    console.rule(f"2 · the RL loop: {iterations} iterations on examples/cpu_tasks ({loop_model} + scripted choices)")
    run_loop_demo(console=console, model=loop_model, iterations=iterations, run_dir=run_dir,
                  learning_rate=learning_rate)


def run_loop_demo(*, console: Console, model: str, iterations: int, run_dir: Path, learning_rate: float) -> None:
    from polar_mitm.rollout.cli import iteration_table
    from polar_mitm.rollout.loop import Loop, LoopConfig

    tasks = EXAMPLES / "tasks.jsonl"
    script = EXAMPLES / "policy.json" if model == "tiny" else None
    cfg = LoopConfig(tasks=tasks, run_dir=run_dir, iterations=iterations, group_size=4, concurrency=4, model=model,
                     script=script, learning_rate=learning_rate, max_tokens=128)
    done: list = []

    def show(stats) -> None:
        done.append(stats)
        console.print(iteration_table(done))

    console.print("each iteration: 3 tasks × 4 sessions of the reference SDK agent (openai chat, streaming) through "
                  "the gateway → records → prefix-merged sequences with rewards → GRPO (TRL) → weights pushed")
    results = Loop(cfg, on_iteration=show).run()
    png = plot_rewards(results, run_dir / "reward.png")
    last = run_dir / f"iter-{len(results) - 1}"
    console.print(f"records {last / 'flows'} · sequences {last / 'merged'} · checkpoint {last / 'train'} · "
                  f"curve {png}")
    console.print(f"inspect: polar-mitm records {last / 'flows'} · polar-mitm stats {last / 'merged'} · "
                  f"polar-mitm show <session> --data {last / 'merged'} --tokenizer tiny")


def plot_rewards(results, png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    xs = [r.iteration for r in results]
    ax.errorbar(xs, [r.reward_mean for r in results], yerr=[r.reward_std for r in results], marker="o", capsize=3)
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward (±std)")
    ax.set_title("polar-mitm loop on the CPU demo tasks")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
