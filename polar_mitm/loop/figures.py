"""An iteration's figures: what `loop.json` holds per iteration (`IterationStats`), how they are made from a rollout,
a merge and an evaluation, and read back. Apart from the loop so that the resume checks (saved_state.py) and the
report read them without the loop.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_mitm.loop.evaluation import EvalResult
from polar_mitm.loop.informative import group_figures
from polar_mitm.loop.trackers import numeric_metrics
from polar_mitm.rollout.runner import RolloutSummary
from polar_mitm.storage.run_layout import SERVICE_RESULTS_FILE
from polar_mitm.storage.session_ends import end_counts
from polar_mitm.tasks.task_file import passed


@dataclass
class IterationStats:
    iteration: int
    weight_version: str | None
    sessions: int
    reward_mean: float
    reward_std: float
    pass_rate: float
    sequences: int
    requests: int
    trainable_tokens: int
    total_tokens: int
    seconds: dict[str, float] = field(default_factory=dict)
    # --keep: sessions stopped once K of their group were done; no reward, so left out of the group (and of training)
    cut_sessions: int = 0
    # How the sessions ended (storage/session_ends.py: end → sessions), and the --on-* rules the merge applied to the
    # rewarded ones that did not complete (`end:rule` → sessions; mask left them out, zero gave the failure reward)
    session_ends: dict[str, int] = field(default_factory=dict)
    end_rules: dict[str, int] = field(default_factory=dict)
    # --eval-tasks: the held-out evaluation of the weights this iteration's training produced, when one was due
    eval: EvalResult | None = None
    # task groups rolled out, those with zero advantage (all rewards equal: not trained on), and the groups drawn to
    # replace them (--min-informative-groups; 0 without it)
    groups: int = 0
    uninformative_groups: int = 0
    replaced_groups: int = 0
    # the trained calls by staleness: weight updates between the weights that sampled the call (its record's
    # weight_version) and those the training started from — per call, so a session spanning a push counts in two
    call_staleness: dict[str, int] = field(default_factory=dict)
    # every group was flat: no optimizer step, the weights stayed (training.py's IterationTraining.skipped)
    train_skipped: bool = False
    # The training's trust region (`training_fractions`): the share of its loss tokens PPO's clip clipped (0 with
    # num_iterations 1, where the clip never acts), and of its stale tokens the TIS cap held at stale_is_clip_max.
    # None: no training, or no stale token.
    clip_fraction: float | None = None
    tis_capped_fraction: float | None = None
    # the trained (sampled) tokens by staleness, per token: a push that landed mid-call splits the call's tokens
    # between versions (the merged rows' version spans); `call_staleness` counts each call once, by its record
    token_staleness: dict[str, int] = field(default_factory=dict)
    # the push of this iteration's weights (engines' PushReport: pause_seconds the running calls saw, mode, seconds);
    # None: nothing pushed (no engine, every group flat, or the engine already served them)
    push: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "eval": self.eval.to_json() if self.eval else None}

    def tracked_metrics(self) -> dict[str, float]:
        """The figures a tracker gets for this iteration (`loop/…`, `eval/…`)."""
        figures = {
            key: value
            for key, value in self.__dict__.items()
            if key not in ("iteration", "weight_version", "eval")
        }
        metrics = numeric_metrics(figures, "loop")
        if self.eval is not None:
            metrics.update(eval_metrics(self.eval))
        return metrics


def eval_metrics(result: EvalResult) -> dict[str, float]:
    """A held-out evaluation's figures for a tracker (`eval/pass@k`, `eval/reward_mean`)."""
    return {**numeric_metrics(result.pass_at, "eval"), "eval/reward_mean": result.reward_mean}


def cut_sessions(summary: RolloutSummary) -> int:
    """Sessions the straggler cut (--keep) stopped: unevaluated, so without a reward."""
    return sum(s.status == "cut" for s in summary.sessions)


def reward_stats(summary: RolloutSummary) -> tuple[float, float, float]:
    rewards = [s.reward for s in summary.sessions if s.reward is not None]
    if not rewards:
        return 0.0, 0.0, 0.0
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    return mean, std, sum(passed(r) for r in rewards) / len(rewards)


def iteration_stats(
    k: int, version: str | None, summary: RolloutSummary, merged: Any, seconds: dict[str, float]
) -> IterationStats:
    """Iteration k's figures from its rollout and merge summaries."""
    mean, std, pass_rate = reward_stats(summary)
    return IterationStats(
        iteration=k,
        weight_version=version,
        sessions=len(summary.sessions),
        reward_mean=mean,
        reward_std=std,
        pass_rate=pass_rate,
        sequences=merged.sequences,
        requests=merged.trainable_records,
        trainable_tokens=merged.trainable_tokens,
        total_tokens=merged.total_tokens,
        seconds=seconds,
        cut_sessions=cut_sessions(summary),
        session_ends=end_counts([s.end for s in summary.sessions]),
        end_rules=dict(merged.end_rules),
        **group_figures(summary),
    )


@dataclass
class MergeFigures:
    """What the loop keeps of a merge's summary (in iter-K/state.json, for a resumed run)."""

    sequences: int
    trainable_records: int
    trainable_tokens: int
    total_tokens: int
    end_rules: dict[str, int] = field(
        default_factory=dict
    )  # the --on-* rules applied (`end:rule` → sessions)

    @classmethod
    def of(cls, merged: Any) -> MergeFigures:
        return cls(
            merged.sequences,
            merged.trainable_records,
            merged.trainable_tokens,
            merged.total_tokens,
            dict(merged.end_rules),
        )


def call_staleness(it: Path, base_version: str | None) -> dict[str, int]:
    """Iteration `it`'s trained calls (the records of the sessions in its training shards) counted by staleness
    against `base_version`, the weights the training started from."""
    import pyarrow.parquet as pq

    from polar_mitm.storage.records import read_all
    from polar_mitm.train.stats import version_distance

    shards = sorted((it / "merged").rglob("*.parquet"))
    trained = {
        sid
        for shard in shards
        for sid in pq.read_table(shard, columns=["session_id"])["session_id"].to_pylist()
    }
    counts: Counter = Counter()
    if (it / SERVICE_RESULTS_FILE).exists():  # --service: the calls' versions are in the traces it answered
        from polar_mitm.loop.service_rollouts import call_versions

        for version in call_versions(it, trained):
            counts[str(version_distance(base_version, version))] += 1
    else:
        rows = read_all(it / "flows").select(["session_id", "weight_version"]).to_pylist()
        for row in rows:
            if row["session_id"] in trained:
                counts[str(version_distance(base_version, row["weight_version"]))] += 1
    return dict(sorted(counts.items(), key=lambda item: int(item[0])))


def token_staleness(it: Path, base_version: str | None) -> dict[str, int]:
    """Iteration `it`'s trained tokens (loss_mask 1 in its merged rows) counted by staleness against
    `base_version`, span by span: a push between two tokens of a call counts each side at its own version."""
    import pyarrow.parquet as pq

    from polar_mitm.storage.merged import sequences_in
    from polar_mitm.train.stats import version_distance

    counts: Counter = Counter()
    for shard in sorted((it / "merged").rglob("*.parquet")):
        for seq in sequences_in(pq.read_table(shard), str(shard)):
            spans = seq.version_spans()
            ends = [start for start, _ in spans[1:]] + [len(seq.loss_mask)]
            for (start, version), end in zip(spans, ends, strict=True):
                tokens = sum(seq.loss_mask[start:end])
                if tokens:
                    counts[str(version_distance(base_version, version))] += tokens
    return dict(sorted(counts.items(), key=lambda item: int(item[0])))


def stale_share(staleness: dict[str, int]) -> float | None:
    """The share of a staleness histogram at least one version behind (None: empty)."""
    total = sum(staleness.values())
    return sum(n for k, n in staleness.items() if int(k) > 0) / total if total else None


def training_fractions(metrics_file: Path) -> dict[str, float | None]:
    """A training's clip and TIS-cap fractions (IterationStats' `clip_fraction`, `tis_capped_fraction`) from its
    metrics.jsonl: PPO's clipped share weighted by each step's loss tokens; the capped stale tokens over all stale
    tokens."""
    from polar_mitm.train.metrics import read_metrics

    steps = [row for row in read_metrics(metrics_file) if "loss" in row] if metrics_file.exists() else []
    clipped = [
        (row["clip_ratio/region_mean"], row.get("batch/loss_tokens", 1.0))
        for row in steps
        if "clip_ratio/region_mean" in row
    ]
    tokens = sum(weight for _, weight in clipped)
    stale = sum(row.get("importance_weight/stale_tokens", 0.0) for row in steps)
    capped = sum(row.get("importance_weight/capped_tokens", 0.0) for row in steps)
    return {
        "clip_fraction": sum(value * weight for value, weight in clipped) / tokens if tokens else None,
        "tis_capped_fraction": capped / stale if stale else None,
    }


def stats_from_json(row: dict[str, Any]) -> IterationStats:
    """An iteration's figures back from loop.json."""
    names = {f.name for f in IterationStats.__dataclass_fields__.values()}
    values = {key: value for key, value in row.items() if key in names}
    if values.get("eval") is not None:
        values["eval"] = EvalResult(**values["eval"])
    return IterationStats(**values)
