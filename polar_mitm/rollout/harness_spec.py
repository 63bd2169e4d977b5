"""How a rollout starts one harness session: the built-in SDK agent, a custom command template, or a preset.

    sdk:openai_chat | sdk:openai_responses | sdk:anthropic | sdk:google   the reference agent (polar_mitm.sdk_agent)
    cmd:TEMPLATE    a shell command; placeholders {prompt} (shell-quoted), {workspace}, {session}, {task}, {index},
                    {base_url} (reverse gateway URL with the /t/TASK/s/SESSION prefix), {proxy_url}
                    (http://TASK%2FSESSION:x@host:port for HTTPS_PROXY), {ca_bundle}
    NAME            a real-harness preset from `polar-mitm harness` (claude-code, codex, gemini, qwen, pi, opencode)
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from polar_mitm.rollout.tasks import Task

SDK_PROVIDERS = ("openai_chat", "openai_responses", "anthropic", "google")


@dataclass
class GatewayEndpoints:
    reverse_url: str  # e.g. http://127.0.0.1:8081
    proxy_url: str | None = None  # e.g. http://127.0.0.1:8080 (regular mode)
    ca_bundle: Path | None = None


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: Path


class HarnessSpec:
    """Parses a `--harness` value and builds the launch of one session."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        if spec.startswith("sdk:"):
            self.kind, self.value = "sdk", spec[4:]
            if self.value not in SDK_PROVIDERS:
                raise ValueError(f"unknown SDK provider {self.value!r}; choose from {SDK_PROVIDERS}")
        elif spec.startswith("cmd:"):
            self.kind, self.value = "cmd", spec[4:]
        else:
            self.kind, self.value = "preset", spec

    def launch(self, task: Task, session: str, workspace: Path, gw: GatewayEndpoints, index: int = 0) -> Launch:
        prefix = f"/t/{quote(task.task_id, safe='')}/s/{quote(session, safe='')}"
        env = {**os.environ, "POLAR_SESSION": session, "POLAR_TASK": task.task_id}
        if self.kind == "sdk":
            base = gw.reverse_url + prefix + ("/v1" if self.value.startswith("openai") else "")
            argv = [sys.executable, "-m", "polar_mitm.cli", "agent", task.prompt, "--provider", self.value,
                    "--base-url", base, "--workdir", str(workspace)]
            return Launch(argv, env, workspace)
        if self.kind == "cmd":
            proxy = None
            if gw.proxy_url:
                host = gw.proxy_url.split("://", 1)[-1]
                proxy = f"http://{quote(task.task_id, safe='')}%2F{quote(session, safe='')}:x@{host}"
            command = self.value.format(prompt=shlex.quote(task.prompt), workspace=shlex.quote(str(workspace)),
                                        session=session, task=task.task_id, index=index,
                                        base_url=gw.reverse_url + prefix,
                                        proxy_url=proxy or "", ca_bundle=str(gw.ca_bundle or ""))
            return Launch(["bash", "-c", command], env, workspace)
        return self._preset_launch(task, session, workspace, gw)

    def _preset_launch(self, task: Task, session: str, workspace: Path, gw: GatewayEndpoints) -> Launch:
        try:
            from polar_mitm.harness import rollout_launch  # the real-CLI presets
        except ImportError as exc:
            raise ValueError(f"unknown harness {self.spec!r} (use sdk:PROVIDER, cmd:TEMPLATE or a preset)") from exc
        argv, env = rollout_launch(self.value, prompt=task.prompt, session=session, task=task.task_id,
                                   workspace=workspace, reverse_url=gw.reverse_url, proxy_url=gw.proxy_url,
                                   ca_bundle=gw.ca_bundle)
        return Launch(argv, {**os.environ, **env}, workspace)
