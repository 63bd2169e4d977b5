"""`polar-mitm dashboard RUN_DIR`: a local, read-only web app over a run directory, finished or still running.

A request enters at `routes.py` (Starlette, served by uvicorn from `cli.py`), which asks the queries for JSON:
`run_files` finds what the run holds (iterations, evaluations, a rollout service's tasks), `sessions` keeps one
small per-session table built from the records' small columns (paged, sorted and filtered server-side, so 100k
calls open fast), `calls` reads one session's model calls and merged sequences for the token viewer (the report's
decoding, `report/trajectories.py`) and a judge's word, `figures` reads the iterations, discarded rollouts and
evaluations, and `timeline` the engines' calls and every weight push. `live` polls the run's files' mtimes and tells open pages over server-sent events what changed. The
page is hand-written HTML/JS/CSS in `assets/` (no build step, nothing fetched from the network); it builds its DOM
with `textContent` only, since prompts are hostile.
"""

from polar_mitm.dashboard.routes import dashboard_app

__all__ = ["dashboard_app"]
