"""OpenHands (PyPI `openhands`, the CLI on the OpenHands SDK; Python 3.12 on litellm): OpenAI Chat Completions
through litellm's `openai/` provider, in both modes.

Its own venv on Python 3.12 (scripts/setup-openhands.sh): the CLI requires `==3.12.*` and pins ~200 packages that
must not decide ours. A one-shot run is `openhands --headless --override-with-envs -t PROMPT`: headless approves
every action and skips the critic; `--override-with-envs` builds the CLI's default agent (terminal, file_editor,
task_tracker and task tools; an LLM-summarising condenser) from LLM_MODEL / LLM_API_KEY / LLM_BASE_URL, with no
settings file and no login. Tools run as local processes (tmux) in the working directory — no Docker. Settings
and conversations stay under OPENHANDS_PERSISTENCE_DIR in the isolated HOME. Python's TLS clients (httpx under
litellm, requests) read SSL_CERT_FILE / REQUESTS_CA_BUNDLE. recipes/openhands.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from polar_mitm.harness.base import (
    COMMAND,
    Hookup,
    ProviderName,
    ShellTool,
    VenvHarness,
)

# litellm's `openai/` provider: Chat Completions, api.openai.com unless LLM_BASE_URL says otherwise. Not a gpt-5 or
# codex name, which the SDK sends to the Responses API instead.
MODEL = "openai/gpt-4.1-mini"
# The tools the CLI's default agent offers on every main call, in order (openhands 1.16.0).
DEFAULT_TOOLS = ["terminal", "file_editor", "task_tracker", "task", "finish", "think"]


class OpenHands(VenvHarness):
    name: ClassVar[str] = "openhands"
    package: ClassVar[str] = "openhands"  # PyPI, pinned in scripts/setup-openhands.sh
    binary: ClassVar[str] = "openhands"
    venv: ClassVar[str] = ".venv-openhands"
    venv_variable: ClassVar[str] = "POLAR_OPENHANDS_VENV"
    setup_script: ClassVar[str] = "scripts/setup-openhands.sh"
    distribution: ClassVar[str] = "openhands"
    api: ClassVar[ProviderName] = "openai_chat"
    # Its `terminal` tool takes `command` (optional: is_input, timeout, reset) plus the `security_risk` and `summary`
    # the SDK adds to every schema. The CLI always sets an LLM security analyzer, so a call without security_risk
    # is refused ("Failed to provide security_risk field") and the model is told so instead of the command running.
    shell_tools: ClassVar[tuple[ShellTool, ...]] = (
        ShellTool("terminal", {"command": COMMAND, "security_risk": "LOW"}),
    )

    def config_files(self, hookup: Hookup, home: Path) -> dict[str, str]:
        # What the CLI keeps besides its agent settings (which --override-with-envs builds): no critic (only ever
        # used with All Hands' own LLM proxy; headless turns it off too) and no MCP servers.
        return {
            ".openhands/cli_config.json": json.dumps({"critic": {"enable_critic": False}}, indent=2) + "\n",
            ".openhands/mcp.json": json.dumps({"mcpServers": {}}, indent=2) + "\n",
        }

    def provider_env(self, hookup: Hookup, home: Path) -> dict[str, str]:
        env = {
            "LLM_MODEL": MODEL,
            "LLM_API_KEY": hookup.api_key,
            "OPENHANDS_PERSISTENCE_DIR": str(home / ".openhands"),
        }
        if hookup.mode == "base-url":
            env["LLM_BASE_URL"] = hookup.base_url("/v1")
        return env

    def unattended_env(self) -> dict[str, str]:
        return {
            "OPENHANDS_SUPPRESS_BANNER": "1",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm would fetch its price list from GitHub at import
            "LITELLM_TELEMETRY": "False",
            "PYTHONUNBUFFERED": "1",
        }

    def prompt_args(self, prompt: str) -> list[str]:
        return ["--headless", "--override-with-envs", "-t", prompt]
