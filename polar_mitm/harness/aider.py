"""Aider (PyPI `aider-chat`, Python on litellm): OpenAI Chat Completions, streamed, and **no tools** — the model
edits files by writing them out in Aider's edit format (`--edit-format whole`: a file name, then the whole file
in a fence), and Aider applies the edit.

Its own venv (scripts/setup-aider.sh): aider-chat pins all of its dependencies exactly. Proxy mode uses litellm's
`openai/` provider (api.openai.com); base-URL mode adds `--openai-api-base` with the session prefix, written in
`.aider.conf.yml` in HOME (Aider reads it there). A one-shot `--message` run is one model call, plus one more per
reflection (an edit that did not apply, a file the answer mentions); shell commands the model suggests are never
run unattended (they need an explicit yes, which `--yes-always` does not give): recipes/aider.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from polar_mitm.harness.base import (
    Hookup,
    ProviderName,
    ShellTool,
    VenvHarness,
)

MODEL = "openai/gpt-4.1-mini"
# Aider's whole-file format reminder: every main-thread prompt holds it (the scripted policy keys on it).
WHOLE_FORMAT_MARKER = "To suggest changes to a file you MUST return the entire content of the updated file."
# For scripted sessions: a test command (`--auto-test --test-cmd`) that fails once, then passes — Aider then sends
# the test's output back for a fix, so a session has a second, reflected call.
FAIL_ONCE_TEST = "test -e .checked && grep -qx hello out.txt || { touch .checked; echo 'out.txt: not checked yet'; false; }"
FAIL_ONCE_ARGS = ["--auto-test", "--test-cmd", FAIL_ONCE_TEST]


class Aider(VenvHarness):
    name: ClassVar[str] = "aider"
    package: ClassVar[str] = "aider-chat"  # PyPI, pinned in scripts/setup-aider.sh
    binary: ClassVar[str] = "aider"
    venv: ClassVar[str] = ".venv-aider"
    venv_variable: ClassVar[str] = "POLAR_AIDER_VENV"
    setup_script: ClassVar[str] = "scripts/setup-aider.sh"
    distribution: ClassVar[str] = "aider_chat"
    api: ClassVar[ProviderName] = "openai_chat"
    shell_tools: ClassVar[tuple[ShellTool, ...]] = ()  # none: it edits through its text edit format

    def config_files(self, hookup: Hookup, home: Path) -> dict[str, str]:
        config: dict[str, object] = {
            "model": MODEL,
            "weak-model": MODEL,  # its summaries and commit messages go to the same engine
            "edit-format": "whole",
            "yes-always": True,
            "git": False,  # a rollout workspace need not be a repository, and commits are not ours to make
            "map-tokens": 0,  # no tree-sitter repository map
            "auto-lint": False,
            "analytics-disable": True,
            "check-update": False,
            "show-release-notes": False,
            "show-model-warnings": False,
            "pretty": False,
            "fancy-input": False,
            "suggest-shell-commands": False,
            "detect-urls": False,
        }
        if hookup.mode == "base-url":
            config["openai-api-base"] = hookup.base_url("/v1")
        # Known to Aider from this file, it never fetches litellm's price list from the internet for the model.
        metadata = {
            MODEL: {
                "max_input_tokens": 131072,
                "max_output_tokens": 8192,
                "input_cost_per_token": 0.0,
                "output_cost_per_token": 0.0,
                "litellm_provider": "openai",
                "mode": "chat",
            }
        }
        # JSON is YAML: no YAML writer needed in our venv.
        return {
            ".aider.conf.yml": json.dumps(config, indent=2) + "\n",
            ".aider.model.metadata.json": json.dumps(metadata, indent=2) + "\n",
        }

    def provider_env(self, hookup: Hookup, home: Path) -> dict[str, str]:
        return {"OPENAI_API_KEY": hookup.api_key}

    def unattended_env(self) -> dict[str, str]:
        return {
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm would fetch its price list from the internet
            "AIDER_ANALYTICS": "false",
            "AIDER_CHECK_UPDATE": "false",
            "PYTHONUNBUFFERED": "1",
        }

    def prompt_args(self, prompt: str) -> list[str]:
        return ["--message", prompt]
