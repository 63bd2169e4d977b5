"""A scripted engine and a gateway (inside a private network namespace when possible) that real harnesses run
against: used by tests/harness/test_harnesses.py and scripts/record_harness_flows.py. Given an engine URL (a
scripted vLLM: tests/vllm/test_vllm_harnesses.py) only the gateway is started, outside any namespace, since the
engine listens on this host's loopback.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.harness.base import REPO_ROOT, Harness, Hookup, Mode, base_environment
from polar_mitm.harness.netns import LoopbackNamespace, try_namespace
from polar_mitm.processes import children


@dataclass
class HarnessRun:
    """One finished harness process."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    session: str
    workspace: Path

    def describe(self) -> str:
        """For assertion messages: what ran and what it said."""
        return (
            f"$ {' '.join(self.argv[-6:])}\nexit {self.returncode} after {self.wall_s:.1f}s\n"
            f"--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-4000:]}"
        )


@dataclass
class HarnessStack:
    """The scripted tiny engine and mitmdump + polar addon, both listening only where the harnesses run."""

    root: Path
    netns: LoopbackNamespace | None
    isolation: str  # how harnesses are kept offline, in words
    gateway: gateway_processes.GatewayProcess
    running: ExitStack  # what `stop` takes down: gateway, engine, namespace
    bin_dir: Path = field(default_factory=lambda: REPO_ROOT / "node_modules" / ".bin")

    @classmethod
    def start(
        cls,
        root: Path,
        script: dict[str, Any],
        *,
        isolate: bool = True,
        gateway_options: dict[str, str] | None = None,
        engine_threads: int | None = None,
        engine_args: list[str] | None = None,
        engine_url: str | None = None,
    ) -> HarnessStack:
        root.mkdir(parents=True, exist_ok=True)
        # The embedded engine's --script; an engine at engine_url is given it by the caller.
        script_file = root / "script.json"
        script_file.write_text(json.dumps(script, indent=1))
        isolate = isolate and engine_url is None
        netns, isolation = try_namespace() if isolate else (None, "isolation by environment only")
        with ExitStack() as running:
            if netns is not None:
                running.callback(netns.close)  # last: after the gateway and the engine inside it
            extra = ["--script", str(script_file)] + (
                ["--threads", str(engine_threads)] if engine_threads else []
            )
            extra += engine_args or []
            _, gateway = running.enter_context(
                gateway_processes.engine_and_gateway(
                    root / "flows",
                    confdir=root / "conf",
                    engine=engine_url,
                    model="tiny",
                    engine_args=extra,
                    engine_log=root / "engine.log",
                    gateway_log=root / "gateway.log",
                    gateway_options=gateway_options,
                    netns=netns,
                )
            )
            return cls(
                root=root, netns=netns, isolation=isolation, gateway=gateway, running=running.pop_all()
            )

    def stop(self) -> None:
        """The gateway, then the engine, then the namespace."""
        self.running.close()

    def hookup(self, mode: Mode, session: str, task: str | None = None) -> Hookup:
        return Hookup(
            mode,
            session=session,
            task=task,
            gateway_proxy=self.gateway.proxy_url,
            gateway_url=self.gateway.reverse_url,
            ca_bundle=self.gateway.ca_bundle() if mode == "proxy" else None,
        )

    def run(
        self,
        harness: Harness,
        prompt: str,
        *,
        mode: Mode,
        session: str,
        task: str | None,
        workspace: Path,
        home: Path,
        timeout: float = 240.0,
        args: list[str] | None = None,
    ) -> HarnessRun:
        """Prepare HOME, then run the harness's one-shot prompt in `workspace` (inside the namespace)."""
        workspace.mkdir(parents=True, exist_ok=True)
        prepared = harness.prepare(self.hookup(mode, session, task), home)
        argv = [*harness.command(prompt, bin_dir=self.bin_dir), *(args or [])]
        marker = uuid.uuid4().hex  # every process of this run carries it (children.kill_marked)
        env = {
            **base_environment(extra_path=[self.bin_dir]),
            **prepared.env,
            children.HARNESS_RUN_ENV: marker,
        }
        started = time.monotonic()
        # Its own process group: on a timeout the harness's helpers (Codex's native binary under its Node
        # launcher, Gemini's relaunched child) go down with it and cannot hold our pipes open.
        proc = subprocess.Popen(
            self.netns.wrap(argv) if self.netns else argv,
            cwd=workspace,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            children.kill_group(proc.pid)
            out, err = proc.communicate()
            code, err = -9, err + f"\n[timed out after {timeout:.0f}s]"
        children.kill_group(
            proc.pid
        )  # helpers it left behind (a one-shot run owns nothing that should outlive it)
        children.kill_marked(marker)  # and those that left its process group (Cline's hub daemon)
        return HarnessRun(
            argv=argv,
            returncode=code,
            stdout=out,
            stderr=err,
            wall_s=time.monotonic() - started,
            session=session,
            workspace=workspace,
        )

    def records(self, session: str) -> list[dict[str, Any]]:
        """This session's records (compacted shards and the live journal), in call order."""
        from polar_mitm.storage.session_records import read_live_session

        rows = read_live_session(self.gateway.out_dir, session).to_pylist()
        return sorted(rows, key=lambda r: r["seq"])
