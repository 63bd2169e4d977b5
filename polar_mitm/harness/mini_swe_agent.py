"""mini-swe-agent (PyPI `mini-swe-agent`, Python on litellm): the SWE-RL community's harness, OpenAI Chat
Completions with one `bash` tool.

It lives in its own venv (scripts/setup-mini-swe-agent.sh): litellm's pins must not decide ours. Proxy mode uses
litellm's built-in `openai/` provider (api.openai.com, the first-party shape); base-URL mode the same provider
with `api_base` set in a config file of ours (`-c mini.yaml -c polar-mitm-hookup.yaml`, found through
MSWEA_CONFIG_DIR). Python's TLS clients (httpx under the OpenAI SDK, requests) read SSL_CERT_FILE /
REQUESTS_CA_BUNDLE. The agent finishes only by running `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`; a turn
without a tool call gets a format-error user message and another call (recipes/mini-swe-agent.md).
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

MODEL = "openai/gpt-4.1-mini"  # litellm's `openai/` provider: Chat Completions, api.openai.com by default
SUBMIT_COMMAND = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # the only way the agent ends its run
HOOKUP_CONFIG = "polar-mitm-hookup.yaml"


class MiniSweAgent(VenvHarness):
    name: ClassVar[str] = "mini-swe-agent"
    package: ClassVar[str] = "mini-swe-agent"  # PyPI, pinned in scripts/setup-mini-swe-agent.sh
    binary: ClassVar[str] = "mini"
    venv: ClassVar[str] = ".venv-mini-swe-agent"
    venv_variable: ClassVar[str] = "POLAR_MINI_SWE_AGENT_VENV"
    setup_script: ClassVar[str] = "scripts/setup-mini-swe-agent.sh"
    distribution: ClassVar[str] = "mini_swe_agent"
    api: ClassVar[ProviderName] = "openai_chat"
    shell_tools: ClassVar[tuple[ShellTool, ...]] = (ShellTool("bash", {"command": COMMAND}),)

    def config_files(self, hookup: Hookup, home: Path) -> dict[str, str]:
        model: dict = {"model_name": MODEL, "cost_tracking": "ignore_errors"}
        if hookup.mode == "base-url":
            model["model_kwargs"] = {"api_base": hookup.base_url("/v1"), "drop_params": True}
        # Unattended: no confirmation, no cost limit (our engine has no price); the rollout's timeout bounds a run.
        config = {"agent": {"mode": "yolo", "confirm_exit": False, "cost_limit": 0}, "model": model}
        # JSON is YAML: no YAML writer needed in our venv.
        return {f".config/mini-swe-agent/{HOOKUP_CONFIG}": json.dumps(config, indent=2) + "\n"}

    def provider_env(self, hookup: Hookup, home: Path) -> dict[str, str]:
        return {
            "OPENAI_API_KEY": hookup.api_key,
            "MSWEA_CONFIG_DIR": str(home / ".config" / "mini-swe-agent"),
            "MSWEA_GLOBAL_CONFIG_DIR": str(home / ".config" / "mini-swe-agent"),
        }

    def unattended_env(self) -> dict[str, str]:
        return {
            "MSWEA_CONFIGURED": "true",  # skips the first-run questions (model, API key) on stdin
            "MSWEA_COST_TRACKING": "ignore_errors",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm would fetch its price list from the internet
            "LITELLM_TELEMETRY": "False",
            "PYTHONUNBUFFERED": "1",
        }

    def prompt_args(self, prompt: str) -> list[str]:
        return ["-y", "--exit-immediately", "-c", "mini.yaml", "-c", HOOKUP_CONFIG, "-t", prompt]
