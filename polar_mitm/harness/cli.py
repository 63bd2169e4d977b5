"""`polar-mitm harness …`: list the presets, print a harness's environment, or run it through the gateway.

polar-mitm harness env codex --session s1 --task t1 --mode proxy --gateway-proxy http://127.0.0.1:8080
eval "$(polar-mitm harness env claude-code --session s1 --mode base-url --gateway-url http://127.0.0.1:8081)"
polar-mitm harness run gemini "Write hello into out.txt" --session s1 --mode proxy
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from polar_mitm.harness import HARNESSES, MODES, HarnessError, Hookup, Prepared, base_environment, get_harness
from polar_mitm.harness.base import REPO_ROOT

harness_app = typer.Typer(
    help="Real agent CLIs (unmodified) through the gateway: HOME, environment, command.", no_args_is_help=True
)

NameArg = Annotated[str, typer.Argument(help=f"One of: {', '.join(HARNESSES)}.")]
SessionOpt = Annotated[str, typer.Option(help="Session id (recorded with every model call).")]
TaskOpt = Annotated[str | None, typer.Option(help="Task id (optional).")]
ModeOpt = Annotated[
    str, typer.Option(help="proxy (HTTPS_PROXY + mitmproxy CA) | base-url (provider base URL).")
]
ProxyOpt = Annotated[
    str, typer.Option("--gateway-proxy", help="The gateway's regular (HTTPS_PROXY) listener.")
]
UrlOpt = Annotated[str, typer.Option("--gateway-url", help="The gateway's reverse (base-URL) listener.")]
HomeOpt = Annotated[
    Path | None, typer.Option(help="HOME for the harness (default: a new temporary directory).")
]
ConfdirOpt = Annotated[Path, typer.Option(help="The gateway's mitmproxy confdir (its CA, for proxy mode).")]


def prepare(
    name: str,
    session: str,
    task: str | None,
    mode: str,
    gateway_proxy: str,
    gateway_url: str,
    home: Path | None,
    confdir: Path,
) -> Prepared:
    """Build the hook-up (and, in proxy mode, the CA bundle in HOME) and prepare the harness."""
    if mode not in MODES:
        raise typer.BadParameter(f"--mode must be one of {', '.join(MODES)}")
    harness = get_harness(name)
    home = (home or Path(tempfile.mkdtemp(prefix=f"polar-{name}-"))).resolve()
    home.mkdir(parents=True, exist_ok=True)
    bundle = None
    if mode == "proxy":
        from polar_mitm.gateway.processes import write_ca_bundle

        ca_cert = confdir.expanduser() / "mitmproxy-ca-cert.pem"
        if not ca_cert.exists():
            raise typer.BadParameter(f"{ca_cert} not found: start the gateway once, or pass its --confdir")
        bundle = write_ca_bundle(ca_cert, home / "ca-bundle.pem")
    hookup = Hookup(
        mode,
        session=session,
        task=task,
        gateway_proxy=gateway_proxy,  # type: ignore[arg-type]
        gateway_url=gateway_url,
        ca_bundle=bundle,
    )
    return harness.prepare(hookup, home)


@harness_app.command("list")
def list_command() -> None:
    """The presets: pinned package and installed version, runtime, provider API (proxy mode, then base-URL mode
    where it differs) and shell tool."""
    for harness in HARNESSES.values():
        version = harness.installed_version() or "not installed"
        tools = ", ".join(t.name for t in harness.shell_tools) or "-"
        api = harness.api + (f" (base URL: {harness.base_url_api})" if harness.base_url_api else "")
        typer.echo(
            f"{harness.name:15} {harness.package + '@' + version:38} {harness.runtime:6} {api:40} {tools}"
        )


@harness_app.command("env")
def env_command(
    name: NameArg,
    session: SessionOpt,
    task: TaskOpt = None,
    mode: ModeOpt = "proxy",
    gateway_proxy: ProxyOpt = "http://127.0.0.1:8080",
    gateway_url: UrlOpt = "http://127.0.0.1:8081",
    home: HomeOpt = None,
    confdir: ConfdirOpt = Path("~/.mitmproxy"),
) -> None:
    """Write the harness's config files into HOME and print its environment as `export` lines."""
    try:
        prepared = prepare(name, session, task, mode, gateway_proxy, gateway_url, home, confdir)
        command = get_harness(name).command("PROMPT")
    except HarnessError as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(prepared.exports())
    for path in prepared.files:
        typer.echo(f"# wrote {path}")
    typer.echo(f"# one-shot prompt: {' '.join(command)}")


@harness_app.command("run")
def run_command(
    name: NameArg,
    prompt: Annotated[str, typer.Argument(help="The task for the agent.")],
    session: SessionOpt,
    task: TaskOpt = None,
    mode: ModeOpt = "proxy",
    gateway_proxy: ProxyOpt = "http://127.0.0.1:8080",
    gateway_url: UrlOpt = "http://127.0.0.1:8081",
    home: HomeOpt = None,
    confdir: ConfdirOpt = Path("~/.mitmproxy"),
    workspace: Annotated[Path, typer.Option(help="Where the agent works.")] = Path("."),
    sandbox: Annotated[
        str, typer.Option(help="none | bwrap | podman | docker: where it runs (recipes/sandboxes.md).")
    ] = "bwrap",
    image: Annotated[str | None, typer.Option(help="The container image of --sandbox podman|docker.")] = None,
) -> None:
    """Run a one-shot prompt with the harness, hooked to the gateway (in its sandbox; with --sandbox none it
    replaces this process)."""
    from polar_mitm.sandbox import UNCONFINED_WARNING, SessionBox, get_sandbox
    from polar_mitm.sandbox.run import run_confined
    from polar_mitm.sandbox.tunnel import gateway_ports

    confined = get_sandbox(
        sandbox, image
    )  # one that cannot run here: a one-line error before anything starts
    try:
        prepared = prepare(name, session, task, mode, gateway_proxy, gateway_url, home, confdir)
        argv = get_harness(name).command(prompt)
    except HarnessError as exc:
        raise typer.BadParameter(str(exc)) from exc
    env = {**base_environment(extra_path=[REPO_ROOT / "node_modules" / ".bin"]), **prepared.env}
    if not confined.confines:
        typer.echo(UNCONFINED_WARNING, err=True)
        os.chdir(workspace)
        os.execvpe(argv[0], argv, env)
    workspace = workspace.resolve()
    ports = gateway_ports(gateway_url, gateway_proxy)
    box = SessionBox(workspace, home=prepared.home, ports=ports)
    raise typer.Exit(run_confined(confined, box, argv, env, workspace))
