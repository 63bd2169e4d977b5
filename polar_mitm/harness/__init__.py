"""The real agent CLIs (six npm CLIs, mini-swe-agent, Aider, Cline, Kilo, Hermes, OpenClaw, OpenHands),
unmodified, via the gateway: presets.

    from polar_mitm.harness import get_harness, Hookup
    harness = get_harness("codex")
    prepared = harness.prepare(Hookup("proxy", session="s1", task="t1", gateway_proxy=..., ca_bundle=...), home)
    subprocess.run(harness.command("Write hello into out.txt"), env={**base_environment(), **prepared.env})

`polar-mitm harness env NAME …` prints the same environment as `export` lines (see polar_mitm/harness/cli.py);
recipes/<harness>.md show both hook-up modes by hand.
"""

from __future__ import annotations

from pathlib import Path

from polar_mitm.harness.aider import Aider
from polar_mitm.harness.base import (
    MODES,
    Harness,
    HarnessError,
    Hookup,
    Mode,
    Prepared,
    ShellTool,
    base_environment,
)
from polar_mitm.harness.claude_code import ClaudeCode
from polar_mitm.harness.cline import Cline
from polar_mitm.harness.codex import Codex
from polar_mitm.harness.gemini import GeminiCli
from polar_mitm.harness.hermes import Hermes
from polar_mitm.harness.kilo import Kilo
from polar_mitm.harness.mini_swe_agent import MiniSweAgent
from polar_mitm.harness.openclaw import OpenClaw
from polar_mitm.harness.opencode import OpenCode
from polar_mitm.harness.openhands import OpenHands
from polar_mitm.harness.pi import Pi
from polar_mitm.harness.qwen import QwenCode

HARNESSES: dict[str, Harness] = {
    h.name: h
    for h in (
        ClaudeCode(),
        Codex(),
        GeminiCli(),
        QwenCode(),
        Pi(),
        OpenCode(),
        MiniSweAgent(),
        Aider(),
        Cline(),
        Kilo(),
        Hermes(),
        OpenClaw(),
        OpenHands(),
    )
}

__all__ = [
    "HARNESSES",
    "MODES",
    "Harness",
    "HarnessError",
    "Hookup",
    "Mode",
    "Prepared",
    "ShellTool",
    "base_environment",
    "get_harness",
    "rollout_launch",
]


def get_harness(name: str) -> Harness:
    try:
        return HARNESSES[name]
    except KeyError:
        raise HarnessError(f"unknown harness {name!r}; choose from {', '.join(HARNESSES)}") from None


def rollout_launch(
    name: str,
    *,
    prompt: str,
    session: str,
    task: str | None,
    workspace: Path,
    reverse_url: str,
    proxy_url: str | None = None,
    ca_bundle: Path | None = None,
    mode: Mode | None = None,
    home: Path | None = None,
    credential: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """(argv, env) for one rollout session of a preset (used by `polar-mitm rollout --harness NAME`).

    Proxy mode when the gateway's proxy listener and CA bundle are given (the first-party request shape), else
    base-URL mode. HOME defaults to a sibling of the workspace, so the agent never sees its own config.
    """
    harness = get_harness(name)
    chosen: Mode = mode or ("proxy" if proxy_url and ca_bundle else "base-url")
    hookup = Hookup(
        chosen,
        session=session,
        task=task,
        gateway_url=reverse_url,
        gateway_proxy=proxy_url or "http://127.0.0.1:8080",
        ca_bundle=ca_bundle,
        credential=credential,
    )
    prepared = harness.prepare(hookup, home or workspace.parent / f"{workspace.name}.home")
    return harness.command(prompt), prepared.env
