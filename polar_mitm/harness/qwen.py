"""Qwen Code (`@qwen-code/qwen-code`, Node): OpenAI Chat Completions, to DashScope or a base URL.

With `--auth-type openai` and no OPENAI_BASE_URL it calls dashscope.aliyuncs.com (proxy mode); base-URL mode
sets OPENAI_BASE_URL. It declares Node ≥ 22 but runs on Node 20. Node reads only NODE_EXTRA_CA_CERTS.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from polar_mitm.harness.base import COMMAND, Harness, Hookup, ProviderName, Runtime, ShellTool

MODEL = "qwen3-coder-plus"


class QwenCode(Harness):
    name: ClassVar[str] = "qwen"
    package: ClassVar[str] = "@qwen-code/qwen-code"
    binary: ClassVar[str] = "qwen"
    runtime: ClassVar[Runtime] = "node"
    api: ClassVar[ProviderName] = "openai_chat"
    shell_tools: ClassVar[tuple[ShellTool, ...]] = (ShellTool("run_shell_command", {"command": COMMAND}),)

    def config_files(self, hookup: Hookup, home: Path) -> dict[str, str]:
        settings = {
            "general": {"enableAutoUpdate": False},
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
        }
        return {".qwen/settings.json": json.dumps(settings, indent=2) + "\n"}

    def provider_env(self, hookup: Hookup, home: Path) -> dict[str, str]:
        env = {"OPENAI_API_KEY": hookup.api_key, "OPENAI_MODEL": MODEL}
        if hookup.mode == "base-url":
            env["OPENAI_BASE_URL"] = hookup.base_url("/v1")
        return env

    def unattended_env(self) -> dict[str, str]:
        return {"QWEN_CODE_SUPPRESS_YOLO_WARNING": "1"}

    def prompt_args(self, prompt: str) -> list[str]:
        return ["-p", prompt, "--yolo", "--auth-type", "openai"]
