"""`serve-rollouts --ray` (issue 40 §1): the rollout service's sessions on a Ray cluster's rollout nodes, one gateway
per node recording to `OUT/flows/node-NAME/`, each session's traces merged on its node. A real one-node cluster
(`--ray local`), the SDK agent through the node's gateway, the service answered over HTTP.
"""

from __future__ import annotations

import pyarrow.compute as pc
import pytest

from polar_mitm.processes import ports
from polar_mitm.reconstruct.merge import merge_table
from polar_mitm.service.client import Client
from polar_mitm.storage.merged import sequences_in
from polar_mitm.storage.records import read_all
from polar_mitm.storage.service_layout import FLOWS_DIR
from tests.service.test_service import TOKEN, demo_request, start_service, stop

pytestmark = pytest.mark.slow


def test_sessions_on_ray_nodes_come_back_as_the_merge_of_their_node_records(tmp_path):
    port = ports.free_port()
    out = tmp_path / "out"
    proc = start_service(out, port, "--ray", "local", "--max-sessions", "2")
    try:
        with Client(f"http://127.0.0.1:{port}", token=TOKEN) as client:
            assert client.health()["gateways"] == 1  # one node, one gateway of its own
            client.submit(demo_request("on-ray", 2))
            status = client.wait("on-ray", timeout=240)
            again = client.submit(demo_request("on-ray-again", 1))
            assert again.task_id == "on-ray-again"
            second = client.wait("on-ray-again", timeout=240)
    finally:
        stop(proc)
    assert (status.status, status.completed_sessions) == ("completed", 2), status
    assert second.status == "completed" and second.completed_sessions == 1
    nodes = sorted(p.name for p in (out / FLOWS_DIR).glob("node-*"))
    assert len(nodes) == 1, nodes
    records = read_all(out / FLOWS_DIR / nodes[0])
    for result in status.results + second.results:
        assert result.status == "COMPLETED", result.error
        mine = records.filter(pc.equal(records["session_id"], result.session_id))
        assert mine.num_rows > 0
        merged, _ = merge_table(mine, eot_token_id=151645)
        [expected] = list(sequences_in(merged, "merge"))
        [trace] = result.trajectory.traces
        assert trace.prompt_ids + trace.response_ids == expected.input_ids
        assert trace.loss_mask == expected.loss_mask[expected.prompt_len :]
        assert trace.reward == result.trajectory.metadata["reward"] in (0.0, 1.0)
