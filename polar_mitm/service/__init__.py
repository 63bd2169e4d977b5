"""The rollout service: trainers outside polar-mitm (verl, slime, NeMo-RL, SkyRL, a Polar client) submit tasks over
HTTP in Polar's wire format and get token-exact trajectories back, captured from real harnesses by our gateways.

    models.py         the wire format (TaskRequest, TaskStatus, SessionResult, Trajectory, Trace)
    task_requests.py  a task-file line ↔ a TaskRequest
    traces.py         a finished session's records → its traces (the merge's builders)
    jobs.py           scheduling, the staged runner per task, durable results, events, weight-version waits
    callbacks.py      each finished session POSTed to its callback_url, retried, noted once acknowledged
    server.py         the HTTP routes (Starlette), bearer-token auth
    client.py         `Client`: submit, status, wait, cancel, results, to_tensors
    cli.py            `polar-mitm serve-rollouts`
"""

TOKEN_ENV = "POLAR_SERVICE_TOKEN"  # the bearer token every client sends and `serve-rollouts` requires
# Finished tasks' trace tokens whose results stay in memory for GET /rollout/task/ID (~76 bytes a token there: ~300
# MB); beyond it the oldest finished tasks' results are read back from their results file. A service runs for days.
RESULTS_IN_MEMORY_TOKENS = 4_000_000
