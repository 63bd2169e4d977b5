"""`polar-mitm report RUN_DIR...`: one self-contained static HTML page for a loop, rollout, merge or train directory,
or for several folders of one hand-run pipeline (records, merged, grpo).

`collect` reads what a run left on disk (loop.json, each iteration's rewards, merge summary, training metrics and
merged sequences), `inputs` puts several folders together into one run, `sessions` sums up the records per session,
`charts` draws the curves as inline SVG with matplotlib, `trajectories` decodes a few merged sequences for the token
viewer, and `render` fills one Jinja2 template with inline CSS and JS — no server, no network, nothing fetched when
the page opens. `live.refresh_report` is the loop's: it rewrites RUN/report.html after every iteration.
"""

from polar_mitm.report.live import refresh_report
from polar_mitm.report.render import write_report

__all__ = ["refresh_report", "write_report"]
