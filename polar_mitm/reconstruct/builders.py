"""The names of the merge builders, declared once: `polar-mitm merge --builder`, `polar-mitm loop --builder` and
`LoopConfig.builder` all take a `BuilderName` (the builders themselves are `reconstruct/prefix_merging.py` and
`reconstruct/per_request.py`, registered by these names in `reconstruct/merge.py`)."""

from __future__ import annotations

from enum import StrEnum


class BuilderName(StrEnum):
    """How records become sequences."""

    prefix_merging = "prefix_merging"
    per_request = "per_request"
