"""`polar-mitm loop`: the RL loop, whose options are generated (polar_mitm/config_options.py): LoopConfig's fields plus
every `polar-mitm grpo` option (`LoopCommand`: from PolarGRPOConfig like grpo's, but for the fields the loop sets
itself, `LOOP_SETS`)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import typer
from rich.console import Console

from polar_mitm.config_options import ConfigOptionsCommand, field_options, option_values
from polar_mitm.engines import router
from polar_mitm.judges.judging import judge_problem
from polar_mitm.judges.options import judge_api_key
from polar_mitm.loop.config import LOOP_SETS, LOOP_TRAINER_DEFAULTS, LoopConfig
from polar_mitm.rollout.cli import fail, load_inputs
from polar_mitm.storage.session_ends import ends_line
from polar_mitm.train.config_options import GRPO_OPTIONS, TRL_OPTIONS, grpo_options

LOOP_OPTIONS = "loop"  # the group of `loop`'s generated options that are LoopConfig fields (`option_values`)

console = Console(width=None if sys.stdout.isatty() else 140)  # full tables in logs and CI too


def loop_trainer_options() -> list:
    """`polar-mitm loop`'s trainer options: `polar-mitm grpo`'s, generated from the same PolarGRPOConfig, without the
    fields the loop sets (LOOP_SETS) and with the loop's defaults where they differ (LOOP_TRAINER_DEFAULTS)."""
    from polar_mitm.train.grpo_config import PolarGRPOConfig

    trl = {
        name: dataclasses.replace(option, default=LOOP_TRAINER_DEFAULTS[name])
        if name in LOOP_TRAINER_DEFAULTS
        else option
        for name, option in TRL_OPTIONS.items()
    }
    return grpo_options(PolarGRPOConfig, trl, exclude=LOOP_SETS)


class LoopCommand(ConfigOptionsCommand):
    """`polar-mitm loop`: LoopConfig's options and `loop_trainer_options()`, whose values become `LoopConfig.grpo`."""

    def generated_options(self) -> dict[str, list]:
        return {LOOP_OPTIONS: field_options(LoopConfig), GRPO_OPTIONS: loop_trainer_options()}


def trust_region_cell(r) -> str:
    """PPO-clipped share of the loss tokens / share of stale tokens at the TIS cap ("–" where none applies)."""

    def pct(value):
        return "–" if value is None else f"{value:.0%}"

    return f"{pct(r.clip_fraction)}/{pct(r.tis_capped_fraction)}"


def update_cell(r) -> str:
    """The iteration's push (the pause running sessions saw, and how they were treated) / the share of its trained
    tokens sampled by older weights than the training started from ("–" where none)."""
    from polar_mitm.loop.figures import stale_share

    push = f"{r.push['pause_seconds'] * 1000:.0f}ms {r.push['mode']}" if r.push else "–"
    share = stale_share(r.token_staleness)
    return f"{push} / {'–' if share is None else f'{share:.0%}'}"


def iteration_table(results):
    from rich.table import Table

    evaluated = [r.eval for r in results if r.eval is not None]
    caption = (
        "seconds per stage: rollout / merge / train (skip: every group flat, no optimizer step); clip/cap: "
        "loss tokens PPO clipped / stale tokens at the TIS cap; "
        "groups: informative / all (+ drawn to replace flat ones); ends: sessions that did not complete, by how they "
        "ended, with the --on-* rules that masked or zeroed them; push / stale: the pause the weight push caused "
        "running sessions (and how they were treated) / trained tokens sampled by older weights"
    )
    if evaluated:
        caption += "; held-out: pass@1 / pass@N (N = --eval-samples)"
    table = Table(title="polar-mitm loop", caption=caption)
    columns = [
        "it",
        "weights",
        "sessions",
        "reward",
        "±",
        "pass",
        "groups",
        "calls",
        "seqs",
        "sampled/total tok",
        "clip/cap",
        "push / stale",
        "seconds",
        "ends",
    ]
    for col in [*columns, *(["held-out"] if evaluated else [])]:
        table.add_column(col, justify="right")
    for r in results:
        s = r.seconds
        held_out = [eval_cell(r.eval)] if evaluated else []
        table.add_row(
            str(r.iteration),
            str(r.weight_version),
            f"{r.sessions} ({r.cut_sessions} cut)" if r.cut_sessions else str(r.sessions),
            f"{r.reward_mean:.3f}",
            f"{r.reward_std:.2f}",
            f"{r.pass_rate:.0%}",
            groups_cell(r),
            str(r.requests),
            str(r.sequences),
            f"{r.trainable_tokens}/{r.total_tokens}",
            trust_region_cell(r),
            update_cell(r),
            f"{s['rollout']:.0f}/{s['merge']:.0f}/" + ("skip" if r.train_skipped else f"{s['train']:.0f}"),
            ends_line(r.session_ends, r.end_rules),
            *held_out,
        )
    return table


def groups_cell(stats) -> str:
    """An iteration's task groups: informative / all, and `+N` when N of them replaced flat ones."""
    cell = f"{stats.groups - stats.uninformative_groups}/{stats.groups}"
    return f"{cell} +{stats.replaced_groups}" if stats.replaced_groups else cell


def eval_cell(result) -> str:
    """An iteration's held-out figures: pass@1 / pass@N (blank where no evaluation was due)."""
    if result is None:
        return ""
    top = max(result.pass_at, key=lambda name: int(name.split("@")[1]), default=None)
    if top is None:
        return "no attempts"
    return f"{result.pass_at['pass@1']:.2f} / {result.pass_at[top]:.2f}"


def given_or_resumed_config(ctx: typer.Context) -> LoopConfig:
    """The options as given; with --resume, the run's recorded config (RUN/run.json, every saved file checked first:
    saved_state.py) for the folder given, any option given again checked against it (a different value ends the
    command with one line), and a recorded harness other than this command line's run only with --yes."""
    from polar_mitm.loop.run_state import RunRecordError, resumed_config
    from polar_mitm.loop.saved_state import check_saved_run

    given, grpo = option_values(ctx, LOOP_OPTIONS), option_values(ctx, GRPO_OPTIONS)
    if not given["resume"]:
        if given["tasks"] is None:
            raise fail("missing TASKS (the task file), or --resume -o RUN to carry on a run")
        return LoopConfig(**given, grpo=dict(grpo))
    # (typer vendors its own click: the source is compared by name, not with click's enum)
    typed = {
        name
        for name in [*given, *grpo]
        if getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"
    }
    explicit: dict[str, Any] = {k: v for k, v in given.items() if k in typed and k != "run_dir"}
    explicit["grpo"] = {k: v for k, v in grpo.items() if k in typed}
    try:
        cfg = resumed_config(given["run_dir"], check_saved_run(given["run_dir"]), explicit)
    except RunRecordError as exc:
        raise fail(str(exc)) from None
    # run.json says what command the sessions run: one edited by anyone else must not run unseen.
    if cfg.harness != given["harness"] and not given["yes"]:
        raise fail(
            f"--resume: {cfg.run_dir / 'run.json'} runs the harness {cfg.harness!r}, this command line's --harness "
            f"is {given['harness']!r}: add --yes to run the recorded one, or start a new run directory"
        )
    return cfg


def loop_command(ctx: typer.Context) -> None:
    """The RL loop: rollout → merge → GRPO → push weights → repeat, with a table per iteration. One optimizer, LR
    schedule and KL reference (the initial model) for the whole run; every `polar-mitm grpo` option applies to each
    iteration's training (--learning-rate, --batch-size, --epochs and --temperature are the loop's own)."""
    loop = checked_loop(given_or_resumed_config(ctx))
    from polar_mitm.log_format import EventLog, events_stdout, resolved
    from polar_mitm.loop.progress import quiet_libraries
    from polar_mitm.train.tracker_imports import skip_unrequested_tracker_imports

    # The process is this command's: its trainings report to no tracker (the loop's own trackers do, MLflow's
    # importing MLflow itself), so TRL need not import MLflow when the first training imports it.
    skip_unrequested_tracker_imports([])

    quiet_libraries()  # the progress line says what runs; library progress bars would break the tables up
    shown = resolved(loop.cfg.log_format, console.is_terminal)
    with events_stdout(shown) as stream:
        run_shown(loop, shown, EventLog(shown, stream=stream))


def run_shown(loop, shown, log) -> None:
    """Run the loop, shown as `shown` says, and say how it ended."""
    from polar_mitm.log_format import LogFormat
    from polar_mitm.loop.progress import LineLoopProgress, RichLoopProgress

    if shown is LogFormat.json:  # stdout stays JSON lines: the tables and notes become events
        loop.on_iteration = lambda stats: log.event("iteration", "", **stats.to_json())
        loop.on_note = lambda line: log.event("note", line, text=line)
    else:
        loop.on_note = console.print
    if shown is LogFormat.rich:
        with RichLoopProgress(console, loop.cfg.iterations) as progress:
            loop.progress = progress
            results = loop.run()
    else:
        loop.progress = LineLoopProgress(log, loop.cfg.iterations)
        results = loop.run()
    closing = [f"run → {loop.cfg.run_dir} (loop.json, iter-*/flows, merged, train, rewards.parquet)"]
    if loop.start_eval is not None:
        closing.insert(0, f"held-out at the start (pass@1 / pass@N): {eval_cell(loop.start_eval)}")
    if len(results) > 1:
        first, last = results[0], results[-1]
        closing.append(
            f"reward {first.reward_mean:.3f} → {last.reward_mean:.3f} over {len(results)} iterations"
        )
    if shown is LogFormat.json:
        log.event("finished", " · ".join(closing), run_dir=str(loop.cfg.run_dir), iterations=len(results))
        return
    for line in closing:
        console.print(line)


def checked_loop(cfg: LoopConfig):
    """The Loop of `cfg`, printing a table after each iteration; a bad task file, harness, shared eval task id or
    unavailable tracker ends the command with one line, before the engine starts."""
    from polar_mitm.loop.informative import check_dynamic_sampling
    from polar_mitm.loop.loop import Loop
    from polar_mitm.loop.trackers import TrackerUnavailable

    done = []

    def show(stats) -> None:
        done.append(stats)
        console.print(iteration_table(done))

    tasks, _ = load_inputs(cfg.tasks, cfg.harness, cfg.script)
    if cfg.eval_tasks is not None:
        tasks += load_inputs(cfg.eval_tasks, cfg.harness)[0]
    # With --service the service judges (serve-rollouts --judge-url …): its own options, checked at submit.
    if cfg.service_url is None and (problem := judge_problem(tasks, cfg.judge_options())) is not None:
        raise fail(problem)
    judge_api_key(cfg.judge_api_key_env)  # out of the environment before any session inherits it
    if cfg.engine_url is not None:  # before the run starts: every session would score 0.0
        try:
            router.check_answering(cfg.engine_url)
        except router.EngineUnreachable as exc:
            raise fail(str(exc)) from None
    try:
        check_dynamic_sampling(cfg)
        return Loop(cfg, on_iteration=show)
    except (ValueError, TrackerUnavailable) as exc:
        raise fail(str(exc)) from None
