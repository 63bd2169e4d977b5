"""New weights back to the engine: save a checkpoint, then `POST /update_weights_from_disk` (SGLang's endpoint, also
served by `polar-mitm serve`). The engine's `weight_version` then shows up in every new record, which is how
training later measures how stale a rollout is."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from transformers import TrainerCallback

if TYPE_CHECKING:
    from polar_mitm.train.grpo_trainer import PolarGRPOTrainer

logger = logging.getLogger(__name__)

ENGINE_WEIGHTS_DIR = "engine-weights"  # under output_dir: the checkpoint the engine was last told to load


class EngineSyncError(RuntimeError):
    """The engine did not take the new weights (unreachable, or it answered success=false)."""


def engine_weight_version(engine_url: str, *, timeout: float = 30.0) -> str | None:
    """The engine's current `weight_version` (GET /model_info)."""
    try:
        response = httpx.get(f"{engine_url.rstrip('/')}/model_info", timeout=timeout)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise EngineSyncError(f"cannot read {engine_url}/model_info: {exc}") from exc
    return response.json().get("weight_version")


def push_weights(engine_url: str, model_dir: str | Path, *, weight_version: str | None = None,
                 timeout: float = 600.0) -> str:
    """Load `model_dir` into the engine(s) of `engine_url`; return the new weight_version.

    `engine_url` may be SGLang's router or a comma list of engines: the router does not forward weight updates, so
    every worker is pushed and checked (`polar_mitm.engines.push_to_workers`; a lagging worker raises, named).
    """
    from polar_mitm.engines import engine_workers, push_to_workers

    workers = engine_workers(engine_url)
    if workers != [engine_url.rstrip("/")]:
        return push_to_workers(workers, model_dir, weight_version=weight_version, timeout=timeout)
    return push_weights_to_engine(engine_url, model_dir, weight_version=weight_version, timeout=timeout)


def push_weights_to_engine(engine_url: str, model_dir: str | Path, *, weight_version: str | None = None,
                           timeout: float = 600.0) -> str:
    """Tell the one engine at `engine_url` to load the checkpoint in `model_dir`; return its new weight_version.

    `model_dir` must be readable by the engine at that path (same machine or a shared filesystem).
    """
    body: dict[str, str] = {"model_path": str(Path(model_dir).resolve())}
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    try:
        response = httpx.post(f"{engine_url.rstrip('/')}/update_weights_from_disk", json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        raise EngineSyncError(f"cannot reach {engine_url}: {exc}") from exc
    try:
        answer = response.json()
    except ValueError:
        answer = {"success": False, "message": response.text[:500]}
    if response.status_code != 200 or not answer.get("success"):
        raise EngineSyncError(f"{engine_url} refused the weights in {model_dir}: "
                              f"HTTP {response.status_code} {answer.get('message', '')}")
    # SGLang's answer may omit the version: ask for it.
    return str(answer.get("weight_version") or engine_weight_version(engine_url) or weight_version or "")


class EnginePushCallback(TrainerCallback):
    """Push the policy to `args.push_to_engine` every `args.push_every_steps` steps and when training ends."""

    def __init__(self, trainer: PolarGRPOTrainer) -> None:
        self.trainer = trainer
        self.pushed_step = -1
        self.pushes: list[dict] = []

    def push(self) -> str | None:
        trainer = self.trainer
        step = trainer.state.global_step
        if step == self.pushed_step:
            return None
        target = Path(trainer.args.output_dir) / ENGINE_WEIGHTS_DIR
        if trainer.accelerator.is_main_process and target.exists():
            shutil.rmtree(target)  # the engine has loaded it already: the call returns once weights are in memory
        trainer.accelerator.wait_for_everyone()
        trainer.save_for_engine(target)
        version = None
        if trainer.accelerator.is_main_process:
            version = push_weights(trainer.args.push_to_engine, target,
                                   weight_version=trainer.policy_weight_version())
            self.pushes.append({"step": step, "weight_version": version, "path": str(target)})
            logger.info("pushed step %d to %s as weight_version %s", step, trainer.args.push_to_engine, version)
        self.pushed_step = step
        return version

    def on_step_end(self, args, state, control, **kwargs):
        every = self.trainer.args.push_every_steps
        if every and state.global_step % every == 0:
            self.push()

    def on_train_end(self, args, state, control, **kwargs):
        self.push()
