"""`polar-mitm harness env`: isolated HOME, offline environment, CA trust per runtime, and ids the gateway reads."""

from __future__ import annotations

import base64
import shlex
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polar_mitm.cli import app
from polar_mitm.gateway import identity
from polar_mitm.harness import HARNESSES, Hookup, get_harness, rollout_launch
from polar_mitm.harness.base import DEAD_PROXY, HarnessError

CA = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def exports(text: str) -> dict[str, str]:
    env = {}
    for line in text.splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export ") :].partition("=")
            env[key] = shlex.split(value)[0] if value else ""
    return env


@pytest.fixture
def confdir(tmp_path) -> Path:
    path = tmp_path / "mitm"
    path.mkdir()
    (path / "mitmproxy-ca-cert.pem").write_text(CA)
    return path


@pytest.mark.parametrize("name", list(HARNESSES))
@pytest.mark.parametrize("mode", ["proxy", "base-url"])
def test_env_prints_exports_and_writes_config_into_the_home(name, mode, tmp_path, confdir):
    home = tmp_path / "home"
    result = CliRunner().invoke(
        app,
        [
            "harness",
            "env",
            name,
            "--session",
            "s1",
            "--task",
            "t1",
            "--mode",
            mode,
            "--gateway-proxy",
            "http://127.0.0.1:18080",
            "--gateway-url",
            "http://127.0.0.1:18081",
            "--home",
            str(home),
            "--confdir",
            str(confdir),
        ],
    )
    assert result.exit_code == 0, result.output
    env = exports(result.output)
    assert env["HOME"] == str(home.resolve()) and env["XDG_CONFIG_HOME"].startswith(str(home.resolve()))
    assert "# one-shot prompt:" in result.output
    written = [
        line.removeprefix("# wrote ") for line in result.output.splitlines() if line.startswith("# wrote ")
    ]
    assert written and all(Path(p).is_relative_to(home.resolve()) and Path(p).exists() for p in written)
    runtime = HARNESSES[name].runtime
    if mode == "proxy":
        assert env["HTTPS_PROXY"] == "http://t1%2Fs1:x@127.0.0.1:18080" and env["NO_PROXY"] == ""
        bundle = Path(env["SSL_CERT_FILE"] if runtime in ("rust", "python") else env["NODE_EXTRA_CA_CERTS"])
        assert bundle.read_text().endswith(CA) and len(bundle.read_text()) > len(CA)  # system CAs + ours
        assert ("SSL_CERT_FILE" in env) == (runtime in ("rust", "bun", "python"))
        assert ("REQUESTS_CA_BUNDLE" in env) == (runtime == "python")
        assert ("NODE_EXTRA_CA_CERTS" in env) == (runtime in ("node", "bun"))
    else:
        assert env["HTTPS_PROXY"] == DEAD_PROXY and "127.0.0.1" in env["NO_PROXY"].split(",")
        config = result.output + "".join(Path(p).read_text() for p in written)
        assert "http://127.0.0.1:18081/t/t1/s/s1" in config  # the base URL carries the ids (env or config)
        assert "SSL_CERT_FILE" not in env and "NODE_EXTRA_CA_CERTS" not in env


def test_proxy_mode_without_the_gateway_ca_is_refused(tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "harness",
            "env",
            "codex",
            "--session",
            "s",
            "--mode",
            "proxy",
            "--home",
            str(tmp_path / "h"),
            "--confdir",
            str(tmp_path / "none"),
        ],
    )
    assert result.exit_code == 2 and "confdir" in result.output


@pytest.mark.parametrize(
    ("task", "session"), [("t1", "s1"), (None, "only-session"), ("a b", "x%y"), ("suite/task.v2", "run-7")]
)
def test_every_id_carrier_resolves_to_the_same_session_and_task(task, session):
    hookup = Hookup("base-url", session=session, task=task)
    _, user_part = hookup.proxy_url.split("://", 1)
    user = user_part.split(":x@", 1)[0]
    header = "Basic " + base64.b64encode(f"{user}:x".encode()).decode()
    via_proxy = identity.resolve(
        {}, "/v1/messages", {}, proxy_user_name=identity.proxy_user(header), connection_id="c"
    )[0]
    via_path, rest = identity.resolve(
        {}, hookup.path_prefix + "/v1/messages", {}, proxy_user_name=None, connection_id="c"
    )
    via_key = identity.resolve(
        {"x-api-key": hookup.api_key}, "/v1/messages", {}, proxy_user_name=None, connection_id="c"
    )[0]
    assert rest == "/v1/messages"
    assert (via_path.session_id, via_path.task_id) == (session, task)
    assert (via_proxy.session_id, via_proxy.task_id) == (session, task)
    assert (via_key.session_id, via_key.task_id) == (session, task)


def test_a_slash_in_the_session_id_is_refused():
    """TASK/SESSION splits at the last slash (proxy user name, API key): a session id cannot contain one."""
    with pytest.raises(HarnessError):
        Hookup("base-url", session="a/b")


def test_codex_config_is_valid_toml_with_our_provider_only_in_base_url_mode(tmp_path):
    codex = get_harness("codex")
    for mode, bundle in (("base-url", None), ("proxy", tmp_path / "ca.pem")):
        prepared = codex.prepare(Hookup(mode, session="s", task="t", ca_bundle=bundle), tmp_path / mode)
        config = tomllib.loads((tmp_path / mode / ".codex" / "config.toml").read_text())
        assert config["features"]["responses_websockets"] is False and config["analytics"]["enabled"] is False
        assert ("model_providers" in config) == (mode == "base-url")
        assert prepared.env["CODEX_HOME"] == str((tmp_path / mode / ".codex").resolve())


def test_rollout_launch_gives_argv_and_env_for_the_rollout_runner(tmp_path):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    argv, env = rollout_launch(
        "pi", prompt="do it", session="s", task="t", workspace=workspace, reverse_url="http://127.0.0.1:18081"
    )
    assert argv[0].endswith("pi") and argv[-1] == "do it"
    assert env["HOME"] == str((tmp_path / "ws.home").resolve()) and env["HTTPS_PROXY"] == DEAD_PROXY
    with pytest.raises(HarnessError):
        rollout_launch(
            "nope", prompt="x", session="s", task=None, workspace=workspace, reverse_url="http://x"
        )


@pytest.mark.parametrize("name", ["hermes", "mini-swe-agent", "openhands", "codex", "pi", "claude-code"])
def test_a_relative_ca_bundle_reaches_the_harness_as_an_absolute_path(name, tmp_path, monkeypatch):
    """`polar-mitm rollout` with its default work dir (runs/rollout) hands over a relative bundle path; the harness
    runs in its workspace, where that path names nothing (Hermes then stops: "SSL_CERT_FILE points to a missing CA
    bundle")."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ws").mkdir()
    bundle = Path("runs/rollout/mitmproxy/ca-bundle.pem")
    _, env = rollout_launch(
        name,
        prompt="x",
        session="s",
        task="t",
        workspace=tmp_path / "ws",
        reverse_url="http://127.0.0.1:18081",
        proxy_url="http://127.0.0.1:18080",
        ca_bundle=bundle,
    )
    ca_vars = {
        k: v for k, v in env.items() if k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS")
    }
    assert ca_vars and set(ca_vars.values()) == {str(tmp_path / bundle)}


def test_each_preset_declares_the_provider_api_its_recorded_flow_speaks():
    """`harness list` shows `api`: the provider of every call in the preset's recorded proxy-mode capture."""
    import pyarrow.parquet as pq

    flows = Path(__file__).resolve().parents[2] / "sample_flows" / "harness"
    for name, harness in HARNESSES.items():
        providers = set(
            pq.read_table(flows / f"{name}.parquet", columns=["provider"])["provider"].to_pylist()
        )
        assert providers == {harness.api}, name
    listed = CliRunner().invoke(app, ["harness", "list"]).output
    for name, harness in HARNESSES.items():
        [line] = [line for line in listed.splitlines() if line.startswith(name + " ")]
        assert harness.api in line and (harness.base_url_api or "") in line, line
