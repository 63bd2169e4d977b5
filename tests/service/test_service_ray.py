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
from polar_mitm.storage import service_layout as layout
from polar_mitm.storage.judgments import read_judgments
from polar_mitm.storage.merged import sequences_in
from polar_mitm.storage.records import read_all
from polar_mitm.storage.service_layout import FLOWS_DIR
from tests.service.test_service import TOKEN, demo_request, start_service, stop
from tests.service.test_service_judges import (  # noqa: F401  (judge_url: the scripted judge, a fixture)
    RUBRIC_SCORE,
    judge_url,
    judged_request,
    outcome,
)

pytestmark = pytest.mark.slow


def test_sessions_on_ray_nodes_come_back_as_the_merge_of_their_node_records(judge_url, tmp_path):  # noqa: F811
    """…and a judged task (rubric) is judged from its node's records and harness log."""
    port = ports.free_port()
    out = tmp_path / "out"
    judge = ["--judge-url", judge_url[0], "--judge-model", "scripted"]
    proc = start_service(out, port, "--ray", "local", "--max-sessions", "2", *judge)
    try:
        with Client(f"http://127.0.0.1:{port}", token=TOKEN) as client:
            assert client.health()["gateways"] == 1  # one node, one gateway of its own
            client.submit(demo_request("on-ray", 2))
            status = client.wait("on-ray", timeout=240)
            again = client.submit(demo_request("on-ray-again", 1))
            assert again.task_id == "on-ray-again"
            second = client.wait("on-ray-again", timeout=240)
            rubric = {"mode": "rubric", "rubric": "out.txt holds hello"}
            client.submit(judged_request("on-ray-judged", 1, rubric))
            judged = client.wait("on-ray-judged", timeout=240)
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
    [result] = judged.results
    assert judged.status == "completed" and result.status == "COMPLETED", result.error
    kept = read_judgments(layout.judgments_dir(layout.task_dir(out, "on-ray-judged")))
    assert kept[result.session_id].status == "judged", kept  # read from the node's records
    [trace] = result.trajectory.traces
    assert trace.reward == pytest.approx(outcome(result) + 0.2 * RUBRIC_SCORE[outcome(result)] / 5)
