"""How a rollout starts one harness session: the built-in SDK agent, a custom command template, or a preset.

    sdk:openai_chat | sdk:openai_responses | sdk:anthropic | sdk:google   the reference agent (polar_mitm.agent.sdk_agent)
    cmd:TEMPLATE    a bash command; placeholders {prompt}, {workspace}, {session}, {task}, {index}, {base_url}
                    (reverse gateway URL with the /t/TASK/s/SESSION[/c/CRED] prefix), {proxy_url}
                    (http://TASK%2FSESSION:CRED@host:port for HTTPS_PROXY), {ca_bundle}
    NAME            a real-harness preset from `polar-mitm harness` (claude-code, codex, gemini, qwen, pi, opencode)

The quoting rule of `cmd:` templates (task ids and prompts come from task files, so they are untrusted) is
`shell_template.py`'s: every placeholder becomes exactly one shell word holding its value literally, and a
placeholder may stand only where bash never evaluates a word (an argument of a program or of a builtin known not
to, a plain `NAME=` value, a redirection target); anywhere else the template is refused before any session starts.
Each value is also in the environment (POLAR_PROMPT, POLAR_WORKSPACE, POLAR_SESSION, POLAR_TASK, POLAR_INDEX,
POLAR_BASE_URL, POLAR_PROXY_URL, POLAR_CA_BUNDLE), for a quoted argument where a placeholder is refused.
With a rollout's gateway, the base and proxy URLs carry the session's credential (session_ids.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from polar_mitm.codecs import sdk_base_url
from polar_mitm.harness.base import base_environment
from polar_mitm.rollout.shell_template import ShellTemplate, TemplateError, env_name
from polar_mitm.session_ids import SessionId
from polar_mitm.tasks.task_file import Task

if TYPE_CHECKING:
    from polar_mitm.gateway.processes import GatewayProcess

SDK_PROVIDERS = ("openai_chat", "openai_responses", "anthropic", "google")


@dataclass
class GatewayEndpoints:
    reverse_url: str  # e.g. http://127.0.0.1:8081
    proxy_url: str | None = None  # e.g. http://127.0.0.1:8080 (regular mode)
    ca_bundle: Path | None = None
    session_key: str | None = None  # signs each session's credential when the gateway was started with it

    @classmethod
    def of(cls, gateway: GatewayProcess) -> GatewayEndpoints:
        return cls(gateway.reverse_url, gateway.proxy_url, gateway.ca_bundle(), gateway.session_key)

    def session_id(self, session: str, task: str | None) -> SessionId:
        """The ids a session's hook-up carries, with its credential when this gateway asks for one."""
        return SessionId(session, task).signed(self.session_key)


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: Path


class HarnessSpecError(ValueError):
    """A `--harness` value that cannot be used (unknown provider, unsafe or malformed `cmd:` template)."""


class HarnessSpec:
    """Parses a `--harness` value (a `cmd:` template is checked here, before any session) and builds launches."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.template: ShellTemplate | None = None
        if spec.startswith("sdk:"):
            self.kind, self.value = "sdk", spec[4:]
            if self.value not in SDK_PROVIDERS:
                raise HarnessSpecError(f"unknown SDK provider {self.value!r}; choose from {SDK_PROVIDERS}")
        elif spec.startswith("cmd:"):
            self.kind, self.value = "cmd", spec[4:]
            try:
                self.template = ShellTemplate(self.value)
            except TemplateError as exc:
                raise HarnessSpecError(f"cmd template: {exc}") from exc
        else:
            self.kind, self.value = "preset", spec
            self._check_preset()

    def _check_preset(self) -> None:
        """An unknown preset name fails here, once, rather than in every session."""
        from polar_mitm.harness import HarnessError, get_harness  # the real-CLI presets

        try:
            get_harness(self.value)
        except HarnessError as exc:
            raise HarnessSpecError(f"{exc} (or use sdk:PROVIDER, cmd:TEMPLATE)") from exc

    def check_script(self, path: Path) -> None:
        """A scripted policy (`--script`) whose shell calls name another harness's shell tool: every session of
        this harness would score 0 without a word (the demo's policy calls `shell`; Claude Code offers `Bash`)."""
        from polar_mitm.agent.sdk_agent import SHELL_TOOL_NAME
        from polar_mitm.engine.script import ScriptError, called_tool_names, read_script_file
        from polar_mitm.harness import HARNESSES, get_harness

        called = called_tool_names(read_script_file(path))  # a missing or malformed file, said here too
        if self.kind != "preset":  # an SDK agent or a template: its tools are not known here
            return
        offered = {tool.name for tool in get_harness(self.value).shell_tools}
        shells = {tool.name for h in HARNESSES.values() for tool in h.shell_tools} | {SHELL_TOOL_NAME}
        for names in called:
            if offered and not offered & set(names) and set(names) <= shells:
                raise ScriptError(
                    f"--script {path}: it calls {' / '.join(names)}, a shell tool {self.value} does not offer "
                    f"(it offers {', '.join(sorted(offered))}), so every session would score 0; name its tool, "
                    f'or list candidates ("name": ["{names[0]}", "{sorted(offered)[0]}"])'
                )

    def launch(
        self, task: Task, session: str, workspace: Path, gw: GatewayEndpoints, index: int = 0
    ) -> Launch:
        prefix = gw.session_id(session, task.task_id).path_prefix
        # Only what a harness needs (PATH, LANG, TERM…), never the host's whole environment: a sandbox gets
        # exactly this (`--sandbox none` adds the host's back).
        env = {**base_environment(), "POLAR_SESSION": session, "POLAR_TASK": task.task_id}
        if self.kind == "sdk":
            base = sdk_base_url(self.value, gw.reverse_url + prefix)
            # `--` ends the options: a prompt that starts with `-` is still the prompt.
            argv = [
                sys.executable,
                "-m",
                "polar_mitm.agent.cli",
                "--provider",
                self.value,
                "--base-url",
                base,
                "--workdir",
                str(workspace),
                "--",
                task.prompt,
            ]
            return Launch(argv, env, workspace)
        if self.kind == "cmd":
            values = self._template_values(task, session, workspace, gw, index, prefix)
            env.update({env_name(name): str(value) for name, value in values.items()})
            return Launch(["bash", "-c", self.template.render(values)], env, workspace)  # type: ignore[union-attr]
        return self._preset_launch(task, session, workspace, gw)

    @staticmethod
    def _template_values(
        task: Task, session: str, workspace: Path, gw: GatewayEndpoints, index: int, prefix: str
    ) -> dict[str, object]:
        """The placeholder values of a `cmd:` template, raw: the template quotes them as it substitutes."""
        proxy = ""
        if gw.proxy_url:
            host = gw.proxy_url.split("://", 1)[-1]
            proxy = gw.session_id(session, task.task_id).proxy_url(host)
        return {
            "prompt": task.prompt,
            "workspace": str(workspace),
            "session": session,
            "task": task.task_id,
            "index": index,
            "base_url": gw.reverse_url + prefix,
            "proxy_url": proxy,
            "ca_bundle": str(gw.ca_bundle or ""),
        }

    def _preset_launch(self, task: Task, session: str, workspace: Path, gw: GatewayEndpoints) -> Launch:
        from polar_mitm.harness import rollout_launch  # the real-CLI presets

        argv, env = rollout_launch(
            self.value,
            prompt=task.prompt,
            session=session,
            task=task.task_id,
            workspace=workspace,
            reverse_url=gw.reverse_url,
            proxy_url=gw.proxy_url,
            ca_bundle=gw.ca_bundle,
            credential=gw.session_id(session, task.task_id).credential,
        )
        return Launch(argv, {**base_environment(), **env}, workspace)
