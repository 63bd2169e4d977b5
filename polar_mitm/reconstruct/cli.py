"""`polar-mitm merge`, `show` and `stats`: the commands around reconstruction (registered in polar_mitm/cli.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from polar_mitm.reconstruct.builders import BuilderName
from polar_mitm.reconstruct.merge import MergeSummary, merge
from polar_mitm.reconstruct.turns import ListColumn, sequences_from_table
from polar_mitm.storage.location import Location, StorageError
from polar_mitm.storage.merged import SHARD_PREFIX, SUMMARY_FILE, MergedSequence, read_merged
from polar_mitm.storage.session_ends import ends_line
from polar_mitm.terminal import markup_safe, plain, printable

console = Console(width=None if sys.stdout.isatty() else 140)  # full tables in logs and CI too

CONTEXT_STYLE = "grey62"
SAMPLED_STYLE = "bold green"
TURN_STYLE = "bold magenta"


# -- merge -------------------------------------------------------------------------------------------------------


def merge_command(
    inputs: Annotated[
        list[str] | None,
        typer.Argument(
            help="Record shards: folders or files, local or any pyarrow filesystem URI (s3://, gs://, …).",
            show_default="flows/",
        ),
    ] = None,
    output: Annotated[
        str, typer.Option("--output", "--out", "-o", help="Where to write merged shards.")
    ] = "merged/",
    builder: Annotated[BuilderName, typer.Option(help=BuilderName.__doc__)] = BuilderName.prefix_merging,
    rewards: Annotated[
        str | None, typer.Option(help="JSONL or Parquet with session_id, reward (optional task_id).")
    ] = None,
    eot_token: Annotated[
        str | None,
        typer.Option(
            help="End-of-turn token: an id, or a token text with --tokenizer. Default: auto-detected."
        ),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(help="Tokenizer directory or `tiny`/`smollm2`, to find the end-of-turn token."),
    ] = None,
    drop_unrewarded: Annotated[
        bool,
        typer.Option(
            help="Drop sequences of sessions without a reward (default: keep them with a null reward)."
        ),
    ] = False,
    check: Annotated[
        bool, typer.Option(help="Check the token-faithfulness invariants on every session.")
    ] = True,
    overwrite: Annotated[
        bool, typer.Option(help="Replace the merged shards already at --output (else refused).")
    ] = False,
) -> None:
    """Turn per-request records into training sequences (prefix_merging or per_request); nothing is dropped."""
    if not overwrite and holds_merged_output(output):  # an earlier merge, replaced without a word before
        typer.echo(
            f"error: --output {printable(output)} already holds merged shards; pass --overwrite to replace "
            "them, or choose another folder",
            err=True,
        )
        raise typer.Exit(2)
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("[bold]merging"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("records"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("merge", total=None)
        try:
            summary = merge(
                inputs or ["flows/"],
                output,
                builder=builder.value,
                rewards=rewards,
                eot_token=eot_token,
                tokenizer=tokenizer,
                drop_unrewarded=drop_unrewarded,
                check=check,
                on_start=lambda total: progress.update(task, total=total),
                on_progress=lambda n: progress.advance(task, n),
            )
        except StorageError as exc:  # MergeError, or inputs/output the stores cannot use
            console.print(f"[red]merge failed:[/] {markup_safe(exc)}", soft_wrap=True)
            raise typer.Exit(1) from exc
    for problem in summary.problems:  # one line each, naming the file (skipped, or how it was read)
        console.print(f"[yellow]{markup_safe(problem)}[/]", soft_wrap=True)
    if summary.unknown_reward_sessions:  # dropped, but said: a rewards file of another rollout trains nothing
        named = ", ".join(summary.unknown_reward_examples)
        more = "…" if summary.unknown_reward_sessions > len(summary.unknown_reward_examples) else ""
        console.print(
            f"[yellow]warning: {summary.unknown_reward_sessions:,} reward row(s) name sessions in no record "
            f"({markup_safe(named)}{more}): is --rewards the file of this rollout?[/]",
            soft_wrap=True,
        )
    console.print(summary_table(summary, output))


def recorded_tokenizer(data: str) -> str | None:
    """The tokenizer the gateway recorded for the records a merged folder came from (its summary names their
    `_engine.json`), when that path exists here."""
    try:
        summary = json.loads((Path(data) / SUMMARY_FILE).read_text())
        engine = json.loads(Path(str(summary.get("eot_source") or "")).read_text())
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    path = engine.get("tokenizer_path") if isinstance(engine, dict) else None
    return str(path) if path and Path(str(path)).is_dir() else None


def holds_merged_output(output: str) -> bool:
    """Does `output` already hold a merge's shards or summary?"""
    try:
        where = Location.of(output)
        if not where.exists or where.type != pafs.FileType.Directory:
            return False
        names = {f.base_name for f in where.filesystem.get_file_info(pafs.FileSelector(where.path))}
    except (OSError, StorageError):
        return False  # the writer says what is wrong with it
    return SUMMARY_FILE in names or any(n.startswith(SHARD_PREFIX) and n.endswith(".parquet") for n in names)


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "–"


def context_exact_text(exact: int, checked: int) -> str:
    """The context-fidelity figure as shown to users (reconstruct/fidelity.py)."""
    if not checked:
        return "–"
    share = exact / checked
    style = "green" if exact == checked else ("yellow" if share >= 0.95 else "red")
    return f"[{style}]{_pct(exact, checked)}[/] ({exact:,} / {checked:,})"


def summary_table(summary: MergeSummary, output: str) -> Table:
    """The merge summary as a Rich table."""
    table = Table(title=f"merge · {summary.builder}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    excluded = sum(summary.excluded.values())
    rows: list[tuple[str, str]] = [
        ("sessions", f"{summary.sessions:,}"),
        ("records read", f"{summary.records:,} from {summary.inputs} input(s)"),
        (
            "excluded",
            f"{excluded:,}" + "".join(f"\n  {cause}: {n:,}" for cause, n in summary.excluded.items()),
        ),
        ("requests merged", f"{summary.trainable_records:,}"),
        ("sequences", f"{summary.sequences:,}"),
        ("requests / sequence", f"{summary.records_per_sequence:.2f}"),
        (
            "breaks (new sequence) by cause",
            (
                f"{sum(summary.breaks.values()):,}"
                + "".join(f"\n  {cause}: {n:,}" for cause, n in summary.breaks.items())
            )
            if summary.builder == "prefix_merging"
            else "– (one per request)",
        ),
        (
            "trainable / total tokens",
            f"{summary.trainable_tokens:,} / {summary.total_tokens:,} "
            f"({_pct(summary.trainable_tokens, summary.total_tokens)})",
        ),
    ]
    rows.append(
        (
            "context-exact sampled tokens",
            context_exact_text(summary.context_exact_tokens, summary.context_checked_tokens),
        )
    )
    if summary.eot_token_id is not None:
        rows.append(("end-of-turn token", f"{summary.eot_token_id} ({markup_safe(summary.eot_source)})"))
    if summary.rewarded_sessions or summary.unrewarded_sessions:
        unrewarded = f"{summary.unrewarded_sessions:,} without"
        if summary.dropped_unrewarded_sequences:
            unrewarded += f" ({summary.dropped_unrewarded_sequences:,} sequences dropped)"
        rows.append(("rewards", f"{summary.rewarded_sessions:,} sessions rewarded, {unrewarded}"))
    if (
        summary.session_ends
    ):  # how the sessions ended (storage/session_ends.py), and the rules a caller applied
        rows.append(("session ends", ends_line(summary.session_ends, summary.end_rules)))
    if summary.skipped_files:
        rows.append(("skipped (not records)", "\n".join(markup_safe(f) for f in summary.skipped_files)))
    if summary.problems:
        rows.append(("input problems", f"[yellow]{len(summary.problems):,}[/] (listed above)"))
    rows += [
        ("invariants", "checked" if summary.invariants_checked else "[yellow]not checked[/]"),
        ("time", f"{summary.seconds:.2f} s"),
        ("output", f"{markup_safe(output)} ({len(summary.shards)} shard(s))"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


# -- reading merged shards ---------------------------------------------------------------------------------------


def find_sequences(data: str, ident: str) -> pa.Table:
    """Sequences whose sequence id or session id is `ident`, or that contain the request `ident`."""
    import pyarrow.dataset as ds

    keys = read_merged(data, ["sequence_id", "session_id", "request_ids"])
    hit = pc.or_(pc.equal(keys["sequence_id"], ident), pc.equal(keys["session_id"], ident))
    wanted = pc.filter(keys["sequence_id"], hit)
    if len(wanted) == 0:
        requests = keys["request_ids"].combine_chunks()
        rows = pc.list_parent_indices(requests).to_numpy()[
            pc.equal(pc.list_flatten(requests), ident).to_numpy(zero_copy_only=False)
        ]
        wanted = pc.take(keys["sequence_id"], pa.array(np.unique(rows)))
    if len(wanted) == 0:
        return keys.schema.empty_table()
    table = read_merged(data, filter_expr=ds.field("sequence_id").isin(wanted))
    order = pc.sort_indices(table, sort_keys=[("session_id", "ascending"), ("sequence_id", "ascending")])
    return table.take(order)


# -- show --------------------------------------------------------------------------------------------------------


def mask_runs(loss_mask: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, mask value) of each maximal run of equal loss-mask values."""
    mask = np.asarray(loss_mask)
    if len(mask) == 0:
        return []
    cuts = np.flatnonzero(np.diff(mask)) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [len(mask)]])
    return [(int(s), int(e), int(mask[s])) for s, e in zip(starts, ends, strict=True)]


def _elide(text: str, limit: int) -> str:
    if limit <= 0 or len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} … [{len(text) - 2 * half:,} characters elided; --full shows all] … {text[-half:]}"


def render_sequence(
    seq: MergedSequence, tokenizer, *, logprobs: bool = False, context_chars: int = 1500
) -> Text:
    """A sequence as Rich text: context dim, sampled ids green, a marker before each turn's sampled ids."""

    def decode(ids: np.ndarray) -> str:
        if tokenizer is None:
            return "[" + " ".join(str(int(i)) for i in ids) + "]"
        # Sampled text is untrusted: an ESC the model wrote must not drive the terminal.
        return printable(tokenizer.decode([int(i) for i in ids], skip_special_tokens=False), multiline=True)

    ids, mask, lps = (np.asarray(a) for a in (seq.input_ids, seq.loss_mask, seq.logprobs))
    runs = mask_runs(mask)
    n_sampled_runs = sum(1 for *_, value in runs if value == 1)
    text = Text()
    turn = 0
    for start, end, value in runs:
        if value == 0:
            text.append(_elide(decode(ids[start:end]), context_chars), style=CONTEXT_STYLE)
            continue
        label = printable(seq.request_ids[turn]) if n_sampled_runs == len(seq.request_ids) else "?"
        text.append(f"\n⟦turn {turn + 1} · {label} · {end - start} sampled⟧\n", style=TURN_STYLE)
        turn += 1
        if not logprobs:
            text.append(decode(ids[start:end]), style=SAMPLED_STYLE)
            continue
        for token, lp in zip(ids[start:end], lps[start:end], strict=True):
            text.append(decode(np.array([token])), style=SAMPLED_STYLE)
            text.append(f"⁽{lp:.2f}⁾", style="dim cyan")
    return text


def _header(seq: MergedSequence) -> Table:
    mask = np.asarray(seq.loss_mask)
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for name, value in (
        ("sequence", seq.sequence_id),
        ("session", seq.session_id),
        ("task", seq.task_id),
        ("builder", seq.builder),
        ("turns", f"{seq.n_turns}  ({', '.join(seq.request_ids)})"),
        ("tokens", f"{len(mask):,} ({int(mask.sum()):,} trainable, prompt {seq.prompt_len:,})"),
        ("weights", f"{seq.weight_version_min} … {seq.weight_version_max}"),
        ("finish", seq.finish_reason),  # the engine's, of the last turn
        ("session end", seq.end or "not recorded"),
        ("reward", "null" if seq.reward is None else f"{seq.reward:g}"),
    ):
        table.add_row(name, plain(value))
    return table


def show_command(
    ident: Annotated[str, typer.Argument(metavar="ID", help="A sequence id, a session id, or a request id.")],
    data: Annotated[str, typer.Option(help="Merged shards (folder, file or URI).")] = "merged/",
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="Tokenizer directory or `tiny`/`smollm2` to decode with (default: the one the gateway recorded "
            "for these records, else tiny); `none` prints ids."
        ),
    ] = None,
    logprobs: Annotated[bool, typer.Option("--logprobs", help="Show each sampled token's logprob.")] = False,
    full: Annotated[bool, typer.Option("--full", help="Do not elide long context runs.")] = False,
) -> None:
    """Show merged sequences decoded: context grey, sampled tokens green, turn boundaries marked."""
    try:
        table = find_sequences(data, ident)
    except (StorageError, FileNotFoundError) as exc:
        console.print(f"[red]{markup_safe(exc)}[/]", soft_wrap=True)
        raise typer.Exit(1) from exc
    if table.num_rows == 0:
        console.print(
            f"[red]no sequence, session or request {markup_safe(repr(ident))} in {markup_safe(data)}[/]",
            soft_wrap=True,
        )
        raise typer.Exit(1)
    tok = None
    tokenizer = tokenizer or recorded_tokenizer(data) or "tiny"
    if tokenizer.lower() != "none":
        from polar_mitm.reconstruct.merge import load_tokenizer

        try:
            tok = load_tokenizer(tokenizer)
        except (OSError, ValueError) as exc:
            console.print(
                f"[yellow]cannot load tokenizer {markup_safe(repr(tokenizer))} ({markup_safe(exc)}); "
                "showing token ids[/]"
            )
    for seq in sequences_from_table(table):
        console.rule(plain(seq.sequence_id))
        console.print(_header(seq))
        console.print(render_sequence(seq, tok, logprobs=logprobs, context_chars=0 if full else 1500))
    console.print(
        Text.assemble(
            ("legend: ", "bold"),
            ("context (mask 0)", CONTEXT_STYLE),
            "  ",
            ("sampled (mask 1)", SAMPLED_STYLE),
        )
    )


# -- stats -------------------------------------------------------------------------------------------------------


def sequence_stats(table: pa.Table) -> dict[str, Any]:
    """Per-sequence lengths and trainable tokens, plus totals, of a merged table."""
    lengths = pc.list_value_length(table["input_ids"]).to_numpy(zero_copy_only=False).astype(np.int64)
    mask = ListColumn.from_arrow(table["loss_mask"], np.int8)
    summed = np.concatenate([[0], np.cumsum(mask.values, dtype=np.int64)])
    trainable = summed[mask.offsets[1:]] - summed[mask.offsets[:-1]]
    rewards = np.array([r for r in table["reward"].to_pylist() if r is not None], dtype=np.float64)
    return {
        "sequences": table.num_rows,
        "sessions": len(pc.unique(table["session_id"])),
        "requests": int(pc.sum(table["n_turns"]).as_py() or 0),
        "builders": sorted(set(table["builder"].to_pylist())),
        "lengths": lengths,
        "trainable": trainable,
        "rewards": rewards,
    }


def context_exact_of(data: str, records: str | None) -> str:
    """Context-exact sampled tokens of merged `data`: measured against `records`, else merge's saved figure."""
    if records is not None:
        from polar_mitm.reconstruct.fidelity import sequence_fidelity
        from polar_mitm.storage.records import read_all

        recorded = read_all(records).select(["request_id", "prompt_ids"])
        prompts = {
            rid: None if ids is None else np.asarray(ids, dtype=np.int32)
            for rid, ids in zip(
                recorded["request_id"].to_pylist(), recorded["prompt_ids"].to_pylist(), strict=True
            )
        }
        merged = read_merged(data, ["input_ids", "loss_mask", "request_ids"])
        exact = checked = 0
        for ids, mask, request_ids in zip(
            merged["input_ids"].to_pylist(),
            merged["loss_mask"].to_pylist(),
            merged["request_ids"].to_pylist(),
            strict=True,
        ):
            fidelity = sequence_fidelity(np.asarray(ids), np.asarray(mask), request_ids, prompts)
            exact, checked = exact + fidelity.exact_tokens, checked + fidelity.sampled_tokens
        return context_exact_text(exact, checked)
    summary_file = Path(data) / SUMMARY_FILE
    if "://" in data or not summary_file.is_file():
        return "– (pass --records)"
    try:
        saved = json.loads(summary_file.read_text())
        return context_exact_text(int(saved["context_exact_tokens"]), int(saved["context_checked_tokens"]))
    except (ValueError, KeyError, TypeError):
        return "– (pass --records)"


def write_histograms(stats: dict[str, Any], png: Path) -> None:
    """A PNG with histograms of sequence length and trainable tokens per sequence."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, values, title in (
        (axes[0], stats["lengths"], "sequence length (tokens)"),
        (axes[1], stats["trainable"], "trainable tokens per sequence"),
    ):
        ax.hist(values, bins=min(50, max(1, len(values))), color="#3b7dd8", edgecolor="white")
        ax.set_title(title)
        ax.set_xlabel("tokens")
        ax.set_ylabel("sequences")
    fig.suptitle(f"{stats['sequences']:,} sequences · {', '.join(stats['builders'])}")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def stats_command(
    data: Annotated[str, typer.Argument(help="Merged shards (folder, file or URI).")] = "merged/",
    png: Annotated[
        Path | None,
        typer.Option(
            help="Histogram PNG (default: DATA/stats.png for a local folder, else ./merged-stats.png)."
        ),
    ] = None,
    records: Annotated[
        str | None,
        typer.Option(
            help="Record folder to measure context fidelity against (default: the figure merge saved)."
        ),
    ] = None,
) -> None:
    """Summarise merged sequences: a table, plus a PNG with length and trainable-token histograms."""
    try:
        table = read_merged(data, ["session_id", "input_ids", "loss_mask", "n_turns", "reward", "builder"])
    except (StorageError, FileNotFoundError) as exc:
        console.print(f"[red]{markup_safe(exc)}[/]", soft_wrap=True)
        raise typer.Exit(1) from exc
    if table.num_rows == 0:
        console.print(f"[red]no merged sequences in {markup_safe(data)}[/]", soft_wrap=True)
        raise typer.Exit(1)
    stats = sequence_stats(table)
    lengths, trainable = stats["lengths"], stats["trainable"]
    out = Table(title=f"stats · {markup_safe(data)}", title_justify="left")
    out.add_column("")
    for name in ("total", "mean", "median", "p90", "max"):
        out.add_column(name, justify="right")
    for name, values in (
        ("sequence length", lengths),
        ("trainable tokens", trainable),
        ("context tokens", lengths - trainable),
    ):
        out.add_row(
            name,
            f"{int(values.sum()):,}",
            f"{values.mean():,.0f}",
            f"{np.median(values):,.0f}",
            f"{np.percentile(values, 90):,.0f}",
            f"{int(values.max()):,}",
        )
    console.print(out)
    facts = Table(show_header=False, box=None)
    facts.add_column(style="bold")
    facts.add_column()
    rewards = stats["rewards"]
    for name, value in (
        ("builder", markup_safe(", ".join(stats["builders"]))),
        ("sessions", f"{stats['sessions']:,}"),
        ("sequences", f"{stats['sequences']:,}"),
        ("requests", f"{stats['requests']:,}"),
        ("requests / sequence", f"{stats['requests'] / stats['sequences']:.2f}"),
        ("trainable share", _pct(int(trainable.sum()), int(lengths.sum()))),
        (
            "rewarded sequences",
            f"{len(rewards):,}" + (f" (mean reward {rewards.mean():.3f})" if len(rewards) else ""),
        ),
        ("context-exact sampled tokens", context_exact_of(data, records)),
    ):
        facts.add_row(name, value)
    console.print(facts)
    if png is None:
        png = (
            Path(data) / "stats.png"
            if "://" not in data and Path(data).is_dir()
            else Path("merged-stats.png")
        )
    write_histograms(stats, png)
    console.print(f"histograms: {markup_safe(png)}", soft_wrap=True)
