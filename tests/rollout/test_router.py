"""Several engines behind SGLang's router (sglang-router's `smg`, a real binary) and two real embedded engines:
weight pushes reach every worker and are checked; a worker that is down fails the push, named."""

from __future__ import annotations

import pytest

from polar_mitm.engines import processes as engine_processes
from polar_mitm.engines import router as engine_router
from polar_mitm.engines import weights
from polar_mitm.engines.dialects.base import EngineSyncError
from polar_mitm.engines.weights import push_weights
from polar_mitm.processes import children, ports

pytestmark = pytest.mark.slow


def start_engine(tmp_path_factory, name: str) -> tuple:
    return engine_processes.start_engine(
        "tiny", log=tmp_path_factory.mktemp(name) / "engine.log", extra_args=["--threads", "1"]
    )


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory):
    started = [start_engine(tmp_path_factory, f"engine{k}") for k in range(2)]
    yield [url for _, url in started]
    for proc, _ in started:
        children.stop(proc)


@pytest.fixture(scope="module")
def router(two_engines, tmp_path_factory):
    with engine_router.attached(
        ",".join(two_engines), log=tmp_path_factory.mktemp("router") / "router.log"
    ) as found:
        yield found


def test_a_comma_list_gets_a_router_that_lists_both_engines(router, two_engines):
    assert router.router is not None and router.routed
    assert sorted(engine_router.router_workers(router.url)) == sorted(two_engines)
    assert engine_router.engine_workers(router.url) == engine_router.router_workers(router.url)


def test_push_through_the_router_reaches_every_worker_and_is_checked(router, two_engines, tiny_model_dir):
    before = weights.worker_versions(two_engines)
    expected = str(max(int(v) for v in before.values()) + 1)
    assert push_weights(router.url, tiny_model_dir) == expected
    assert weights.worker_versions(two_engines) == {url: expected for url in two_engines}
    assert weights.common_weight_version(router.url) == expected


def test_router_drops_token_ids_so_each_gateway_is_pinned_to_one_worker(router, two_engines):
    # Measured with sglang-router 0.3.2: chat answers through the router carry no token ids. Should a router
    # forward them, this fails and gateways can go through the router again (engine_router.gateway_backends).
    assert not engine_router.forwards_token_ids(router.url)
    assert engine_router.forwards_token_ids(two_engines[0])
    listed = engine_router.router_workers(router.url)
    assert engine_router.gateway_backends(router.url, 3) == [*listed, listed[0]]


def test_push_with_one_engine_down_fails_naming_it(two_engines, tiny_model_dir, tmp_path_factory):
    proc, doomed = start_engine(tmp_path_factory, "doomed")
    try:
        with engine_router.attached(
            f"{two_engines[0]},{doomed}", log=tmp_path_factory.mktemp("router2") / "router.log"
        ) as pair:
            children.stop(proc)  # the engine goes down after the router registered it
            with pytest.raises(EngineSyncError) as failure:
                push_weights(pair.url, tiny_model_dir)
    finally:
        children.stop(proc)
    message = str(failure.value)
    assert f"worker {doomed}" in message and "up to date: " + two_engines[0] in message
    assert two_engines[0] not in message.split("(up to date")[0]


def test_push_to_a_comma_list_with_an_unreachable_engine_names_it(two_engines, tiny_model_dir):
    dead = f"http://127.0.0.1:{ports.free_port()}"
    with pytest.raises(EngineSyncError, match=f"worker {dead} did not take the weights"):
        push_weights(f"{two_engines[1]},{dead}", tiny_model_dir)
