"""Learning a harness's action protocol with RL: SmolLM2-135M-Instruct learns to answer with tool calls.

The small-scale version of the headline result. The harness is the official `openai` SDK asking chat completions
with three tools (`get_weather`, `read_file`, `shell`); the engine's chat template renders them into the system
prompt and asks for `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, which the engine parses into OpenAI
`tool_calls`. Base SmolLM2 rarely answers that way. Each iteration:

1. sample `--group-size` completions per training prompt through the gateway (task id = the prompt, one session
   per completion, both in the base-URL path `/t/TASK/s/SESSION/v1`), at the gateway-forced temperature;
2. score each from the `tool_calls` the SDK parsed (`score_message`): 1.0 the right tool with the right
   arguments, 0.5 the right tool with other arguments, 0.25 a call of another tool, 0 no parsed call;
3. write the rewards (session_id, task_id, reward) to JSONL and merge the records with them (`prefix_merging`);
4. GRPO on CPU (`PolarGRPOTrainer`, LoRA by default, trained at the sampling temperature), which pushes the new
   weights to the engine (`/update_weights_from_disk`).

Held-out prompts are answered greedily through a second gateway (temperature forced to 0) before and after
training; a held-out prompt passes when it scores 1.0. Prints the per-iteration reward curve and the pass rates,
writes `curve.png` and `summary.json` into `--workdir`.

    # pipeline check, ~1 min: sampling, rewards, merge (GRPO runs once a round's rewards differ)
    .venv/bin/python benchmarks/learn_tool_protocol_smollm2.py --iterations 1 --prompts 2 --group-size 2
    # the run in recipes/training.md: ~35 min on 2 shared CPU cores, ~8 GB peak memory
    .venv/bin/python benchmarks/learn_tool_protocol_smollm2.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def function_tool(name: str, description: str, argument: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {argument: {"type": "string"}},
                "required": [argument],
            },
        },
    }


TOOLS = [
    function_tool("get_weather", "Get the current weather in a city", "city"),
    function_tool("read_file", "Read a file from disk", "path"),
    function_tool("shell", "Run a shell command", "command"),
]
# One worked example in the system prompt: without it the base model almost never emits the protocol at all, and
# GRPO has no reward variance to learn from.
SYSTEM_PROMPT = (
    "You are an agent that acts only through tool calls. Answer every request with a <tool_call>.\n\n"
    "Example:\nUser: What is the weather in Rome?\nAssistant: <tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolTask:
    """A request that calls for exactly one tool call."""

    task_id: str
    prompt: str
    tool: str
    arguments: dict[str, str]


def tasks(prefix: str, rows: list[tuple[str, str, str]]) -> list[ToolTask]:
    argument_of = {t["function"]["name"]: t["function"]["parameters"]["required"][0] for t in TOOLS}
    return [
        ToolTask(f"{prefix}-{i:02d}", prompt, tool, {argument_of[tool]: value})
        for i, (prompt, tool, value) in enumerate(rows)
    ]


# Interleaved by tool, so that `--prompts N` covers all three tools from N = 3.
TRAIN_TASKS = tasks(
    "train",
    [
        ("What's the weather in Paris?", "get_weather", "Paris"),
        ("Read the file notes.txt.", "read_file", "notes.txt"),
        ("Run the command `ls -la`.", "shell", "ls -la"),
        ("How warm is it in Tokyo right now?", "get_weather", "Tokyo"),
        ("Show me what is in config.yaml.", "read_file", "config.yaml"),
        ("Run `git status` for me.", "shell", "git status"),
        ("Is it raining in London?", "get_weather", "London"),
        ("Print the contents of README.md.", "read_file", "README.md"),
        ("Execute the command `pwd`.", "shell", "pwd"),
        ("What is the weather like in Cairo?", "get_weather", "Cairo"),
        ("Open the file main.py.", "read_file", "main.py"),
        ("Run `echo hello`.", "shell", "echo hello"),
    ],
)
HELD_OUT_TASKS = tasks(
    "heldout",
    [
        ("What's the weather in Berlin?", "get_weather", "Berlin"),
        ("Read the file todo.txt.", "read_file", "todo.txt"),
        ("Run the command `date`.", "shell", "date"),
        ("How cold is it in Oslo today?", "get_weather", "Oslo"),
        ("Show me what is in setup.py.", "read_file", "setup.py"),
        ("Run `whoami` for me.", "shell", "whoami"),
        ("Is it sunny in Madrid?", "get_weather", "Madrid"),
        ("Print the contents of data.csv.", "read_file", "data.csv"),
        ("Execute the command `uptime`.", "shell", "uptime"),
    ],
)


# -- reward ------------------------------------------------------------------------------------------------------


def normalise(arguments: Any) -> dict[str, str] | None:
    """Arguments as {name: lower-cased, whitespace-collapsed text}, or None if they are not a JSON object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {str(k): " ".join(str(v).split()).lower() for k, v in arguments.items()}


def score_message(task: ToolTask, message: Any) -> float:
    """The reward of one SDK `ChatCompletionMessage` for `task` (its first parsed tool call counts)."""
    calls = message.tool_calls or []
    if not calls:  # no credit for text that merely looks like a call: the model learns to game such a reward
        return 0.0
    call = calls[0].function
    if call.name != task.tool:
        return 0.25
    return 1.0 if normalise(call.arguments) == normalise(task.arguments) else 0.5


# -- rollouts through the gateway ---------------------------------------------------------------------------------


@dataclass
class Rollout:
    task_id: str
    session_id: str
    reward: float
    parsed_call: bool
    completion_tokens: int
    text: str


def ask(gateway_url: str, task: ToolTask, session_id: str, max_tokens: int) -> Rollout:
    """One chat completion with the tools, as its own gateway session under the task's id."""
    import openai

    from polar_mitm.session_ids import SessionId

    base_url = SessionId(session_id, task.task_id).base_url(gateway_url, "/v1")
    with openai.OpenAI(base_url=base_url, api_key="polar", max_retries=0, timeout=600) as client:
        response = client.chat.completions.create(
            model="smollm2",
            tools=TOOLS,
            max_tokens=max_tokens,  # type: ignore[arg-type]
            messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.prompt}],
        )
    message = response.choices[0].message
    calls = [f"{c.function.name}({c.function.arguments})" for c in message.tool_calls or []]  # type: ignore[union-attr]
    return Rollout(
        task.task_id,
        session_id,
        score_message(task, message),
        bool(calls),
        response.usage.completion_tokens if response.usage else 0,
        " ".join(calls) or message.content or "",
    )


def sample_groups(
    gateway_url: str, train: list[ToolTask], *, group_size: int, iteration: int, max_tokens: int
) -> list[Rollout]:
    return [
        ask(gateway_url, task, f"it{iteration:02d}-{task.task_id}-g{g}", max_tokens)
        for task in train
        for g in range(group_size)
    ]


def evaluate(gateway_url: str, held_out: list[ToolTask], *, label: str, max_tokens: int) -> list[Rollout]:
    return [ask(gateway_url, task, f"eval-{label}-{task.task_id}", max_tokens) for task in held_out]


def write_rewards(rollouts: list[Rollout], path: Path) -> Path:
    path.write_text(
        "".join(
            json.dumps({"session_id": r.session_id, "task_id": r.task_id, "reward": r.reward}) + "\n"
            for r in rollouts
        )
    )
    return path


# -- training ----------------------------------------------------------------------------------------------------


def train_iteration(
    policy: Path, merged_dir: Path, out_dir: Path, args: argparse.Namespace, engine_url: str, iteration: int
) -> tuple[Path, dict[str, Any]]:
    """GRPO on one iteration's merged rollouts; the trainer pushes the result to the engine.

    Returns the new policy checkpoint (the one the engine loaded) and the last step's metrics.
    """
    import torch
    from transformers import PrinterCallback

    from polar_mitm.storage.run_layout import ENGINE_WEIGHTS_DIR
    from polar_mitm.train.data import build_training_data, load_sequences
    from polar_mitm.train.grpo_config import PolarGRPOConfig
    from polar_mitm.train.grpo_trainer import PolarGRPOTrainer
    from polar_mitm.train.sync import attach_engine_push

    data = build_training_data(load_sequences([merged_dir]), group_size=args.group_size)
    # Micro-batches bound memory (each row carries ~49k-wide logits per token); one optimizer step sees
    # `per_step` rows through gradient accumulation.
    per_step = max(1, len(data.rows) // args.steps_per_iteration)
    micro_batch = max(d for d in range(1, min(args.micro_batch, per_step) + 1) if per_step % d == 0)
    config = PolarGRPOConfig(
        output_dir=str(out_dir),
        learning_rate=args.lr,
        max_steps=args.steps_per_iteration,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=per_step // micro_batch,
        lr_scheduler_type="constant",
        loss_type="dapo",
        beta=0.0,
        temperature=args.temperature,
        report_to=[],
        seed=args.seed + iteration,
        disable_tqdm=True,
        push_to_engine=engine_url,
        save_merged=False,
        bf16=args.bf16,
        check_behaviour_logps=args.check_logprobs,
        use_cpu=not torch.cuda.is_available(),  # transformers refuses bf16 on CPU unless told it is a CPU run
    )
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear", task_type="CAUSAL_LM"
        )
    trainer = PolarGRPOTrainer(str(policy), args=config, train_data=data, peft_config=peft_config)
    attach_engine_push(trainer)
    trainer.remove_callback(PrinterCallback)  # the curve is the output; metrics.jsonl keeps the rest
    trainer.train()  # EnginePushCallback saves out_dir/engine-weights and POSTs /update_weights_from_disk
    metrics = json.loads((out_dir / config.metrics_file).read_text().splitlines()[-1])
    return out_dir / ENGINE_WEIGHTS_DIR, metrics


# -- reporting ---------------------------------------------------------------------------------------------------


@dataclass
class IterationResult:
    iteration: int
    weight_version: str
    mean_reward: float
    exact_rate: float
    parsed_call_rate: float
    sample_seconds: float
    train_seconds: float
    trained: bool


def summarise(
    iteration: int, version: str, rollouts: list[Rollout], sample_seconds: float
) -> IterationResult:
    n = max(1, len(rollouts))
    return IterationResult(
        iteration,
        version,
        statistics.fmean(r.reward for r in rollouts),
        sum(r.reward == 1.0 for r in rollouts) / n,
        sum(r.parsed_call for r in rollouts) / n,
        sample_seconds,
        0.0,
        False,
    )


def pass_rate(rollouts: list[Rollout]) -> float:
    return sum(r.reward == 1.0 for r in rollouts) / max(1, len(rollouts))


def plot_curve(
    results: list[IterationResult], before: list[Rollout], after: list[Rollout], path: Path, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    xs = [r.iteration for r in results]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [r.mean_reward for r in results], marker="o", label="mean reward (sampled, training prompts)")
    ax.plot(xs, [r.exact_rate for r in results], marker="s", label="right tool + arguments (sampled)")
    ax.plot(
        xs,
        [r.parsed_call_rate for r in results],
        marker="^",
        linestyle="--",
        label="parsed tool call (sampled)",
    )
    ax.scatter(
        [xs[0], xs[-1]],
        [pass_rate(before), pass_rate(after)],
        marker="*",
        s=160,
        color="black",
        zorder=3,
        label="held-out pass rate (greedy)",
    )
    ax.set(
        xlabel="iteration (sample → merge → GRPO → push)",
        ylabel="rate / reward",
        ylim=(-0.03, 1.05),
        title=title,
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- main --------------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=8, help="sample → merge → GRPO → push rounds")
    parser.add_argument(
        "--group-size", type=int, default=8, help="completions per training prompt (GRPO group)"
    )
    parser.add_argument(
        "--prompts", type=int, default=6, help=f"training prompts (at most {len(TRAIN_TASKS)})"
    )
    parser.add_argument(
        "--held-out", type=int, default=len(HELD_OUT_TASKS), help="held-out prompts to evaluate"
    )
    parser.add_argument("--max-tokens", type=int, default=40, help="completion budget per call")
    parser.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature = trainer temperature"
    )
    parser.add_argument("--lr", type=float, default=5e-4, help="AdamW learning rate")
    parser.add_argument(
        "--lora",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="train LoRA adapters (merged into the pushed weights) instead of all weights",
    )
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank (alpha = 2r)")
    parser.add_argument("--steps-per-iteration", type=int, default=2, help="optimizer steps per round")
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=4,
        help="sequences per forward/backward pass (gradient accumulation makes up the rest)",
    )
    parser.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="bf16 autocast in the trainer (~2.4x faster on a CPU with avx512_bf16; the recomputed "
        "logprobs then differ from the engine's fp32 ones by ~1e-2)",
    )
    parser.add_argument(
        "--check-logprobs",
        action="store_true",
        help="log |recomputed - recorded| logprobs (logp_diff/*; one more forward pass per batch)",
    )
    parser.add_argument(
        "--engine-threads",
        type=int,
        default=1,
        help="engine torch threads (decoding one sequence: 1 thread is fastest on a busy machine)",
    )
    parser.add_argument(
        "--train-threads", type=int, default=os.cpu_count() or 1, help="trainer torch threads"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path("runs/learn-tool-protocol"),
        help="records, merged data, checkpoints, curve.png, summary.json (emptied first)",
    )
    args = parser.parse_args()
    if not 1 <= args.prompts <= len(TRAIN_TASKS):
        parser.error(f"--prompts must be 1..{len(TRAIN_TASKS)}")
    if args.group_size < 2:
        parser.error("--group-size must be at least 2 (GRPO compares completions within a group)")
    return args


def main() -> None:
    args = parse_args()

    import torch
    import transformers

    from polar_mitm.engine.model_zoo import resolve_model
    from polar_mitm.engines import processes as engine_processes
    from polar_mitm.engines.weights import engine_weight_version
    from polar_mitm.gateway import processes as gateway_processes
    from polar_mitm.processes import children
    from polar_mitm.reconstruct.merge import merge

    torch.set_num_threads(args.train_threads)
    transformers.logging.set_verbosity_error()
    started = time.perf_counter()
    work: Path = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model_dir = resolve_model("smollm2")
    train, held_out = TRAIN_TASKS[: args.prompts], HELD_OUT_TASKS[: args.held_out]
    print(
        f"SmolLM2-135M-Instruct learns the <tool_call> protocol: {len(train)} prompts × {args.group_size} "
        f"samples × ≤{args.max_tokens} tokens, T={args.temperature}, lr={args.lr}, "
        f"{'LoRA r=' + str(args.lora_r) if args.lora else 'full weights'}{', bf16' if args.bf16 else ''}, "
        f"{args.steps_per_iteration} steps/round, "
        f"{args.iterations} rounds; {len(held_out)} held-out prompts (greedy)",
        flush=True,
    )

    engine, engine_url = engine_processes.start_engine(
        "smollm2", log=work / "engine.log", extra_args=["--threads", str(args.engine_threads)]
    )
    sampling = evaluation = None
    try:
        sampling = gateway_processes.start_gateway(
            engine_url,
            work / "records",
            confdir=work / "mitmproxy",
            log=work / "gateway.log",
            options={"polar_temperature": str(args.temperature)},
        )
        evaluation = gateway_processes.start_gateway(
            engine_url,
            work / "eval-records",
            confdir=work / "mitmproxy",
            log=work / "gateway-eval.log",
            options={"polar_temperature": "0"},
        )
        before = evaluate(evaluation.reverse_url, held_out, label="before", max_tokens=args.max_tokens)
        print(
            f"held-out before: pass {pass_rate(before):.0%}, mean reward "
            f"{statistics.fmean(r.reward for r in before):.3f}  ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
        print(
            f"{'iter':>4} {'weights':>7} {'reward':>7} {'exact':>6} {'parsed':>7} {'sample s':>8} {'train s':>8}"
            f" {'elapsed s':>9}",
            flush=True,
        )
        results: list[IterationResult] = []
        policy = model_dir
        for it in range(args.iterations + 1):
            version = engine_weight_version(engine_url) or "?"
            t0 = time.perf_counter()
            rollouts = sample_groups(
                sampling.reverse_url,
                train,
                group_size=args.group_size,
                iteration=it,
                max_tokens=args.max_tokens,
            )
            result = summarise(it, version, rollouts, time.perf_counter() - t0)
            (work / f"rollouts-{it:02d}.jsonl").write_text(
                "".join(json.dumps(asdict(r)) + "\n" for r in rollouts)
            )
            if it < args.iterations:  # the last round only measures the final weights
                t1 = time.perf_counter()
                rewards = write_rewards(rollouts, work / f"rewards-{it:02d}.jsonl")
                merged_dir = work / f"merged-{it:02d}"
                merge(
                    [str(work / "records")],
                    str(merged_dir),
                    builder="prefix_merging",
                    rewards=str(rewards),
                    tokenizer=str(model_dir),
                    drop_unrewarded=True,
                )
                if len({r.reward for r in rollouts}) > 1:  # otherwise every advantage is 0: nothing to learn
                    new_policy, metrics = train_iteration(
                        policy, merged_dir, work / f"train-{it:02d}", args, engine_url, it
                    )
                    if policy != model_dir:
                        shutil.rmtree(policy, ignore_errors=True)  # keep only the live checkpoint
                    policy, result.trained = new_policy, True
                    (work / f"train-{it:02d}" / "last_metrics.json").write_text(json.dumps(metrics, indent=2))
                result.train_seconds = time.perf_counter() - t1
            results.append(result)
            print(
                f"{it:>4} {version:>7} {result.mean_reward:>7.3f} {result.exact_rate:>6.0%} "
                f"{result.parsed_call_rate:>7.0%} {result.sample_seconds:>8.0f} {result.train_seconds:>8.0f} "
                f"{time.perf_counter() - started:>9.0f}"
                + ("" if result.trained or it == args.iterations else "  (no reward variance: not trained)"),
                flush=True,
            )
        after = evaluate(evaluation.reverse_url, held_out, label="after", max_tokens=args.max_tokens)
    finally:
        for gateway in (sampling, evaluation):
            if gateway is not None:
                gateway.stop()
        children.stop(engine)

    wall = time.perf_counter() - started
    print("\nheld-out (greedy)      before  after")
    print(f"  pass rate            {pass_rate(before):>6.0%} {pass_rate(after):>6.0%}")
    print(
        f"  mean reward          {statistics.fmean(r.reward for r in before):>6.3f} "
        f"{statistics.fmean(r.reward for r in after):>6.3f}"
    )
    print(
        f"  parsed tool call     {sum(r.parsed_call for r in before) / len(before):>6.0%} "
        f"{sum(r.parsed_call for r in after) / len(after):>6.0%}"
    )
    for b, a in zip(before, after, strict=True):
        print(f"  {b.task_id}: {b.reward:.2f} → {a.reward:.2f}   {a.text[:90]!r}")
    print(
        f"training-prompt reward {results[0].mean_reward:.3f} → {results[-1].mean_reward:.3f} "
        f"in {args.iterations} rounds; wall time {wall / 60:.1f} min"
    )
    plot_curve(
        results,
        before,
        after,
        work / "curve.png",
        f"SmolLM2-135M learns tool calls via GRPO (CPU, {'LoRA' if args.lora else 'full'}, lr {args.lr:g})",
    )
    (work / "summary.json").write_text(
        json.dumps(
            {
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "iterations": [asdict(r) for r in results],
                "held_out_before": [asdict(r) for r in before],
                "held_out_after": [asdict(r) for r in after],
                "pass_rate_before": pass_rate(before),
                "pass_rate_after": pass_rate(after),
                "wall_seconds": wall,
            },
            indent=2,
        )
    )
    print(f"curve → {work / 'curve.png'}; details → {work / 'summary.json'}")


if __name__ == "__main__":
    main()
