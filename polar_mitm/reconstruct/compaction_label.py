"""Which new chain counts as a compaction's consequence: one rule for merge and the gateway's token-exact chains.

After a compaction call (record `call_kind == "compaction"`, see gateway/call_kind.py) the label "compaction" is
pending. The next *main* call that opens a new chain — not a retry of a chain tip — takes it: merge counts that
break as "compaction" (reconstruct/prefix_merging.py) and the gateway records it as the `splice_reason`
(gateway/token_chains.py). Side calls (titles, routing classifiers, next-speaker checks) and further compaction
calls (Gemini CLI verifies its summary with a second call carrying its compaction instruction) open chains of their
own, under their own reason, and leave the label pending. A record without `call_kind` (schema v2) takes it like a
main call — such records mark no compaction, so nothing changes for them.
"""

from __future__ import annotations

COMPACTION = "compaction"


def takes_label(call_kind: str | None) -> bool:
    """Whether a call of this kind, opening a new chain, is the one a pending compaction label goes to."""
    return call_kind is None or call_kind == "main"


def new_chain_reason(pending: bool, call_kind: str | None, reason: str) -> str:
    """The reason recorded for a call that opens a new chain (not a retry) for `reason`."""
    return COMPACTION if pending and takes_label(call_kind) else reason


def pending_after(pending: bool, call_kind: str | None, *, opened: bool) -> bool:
    """Whether the label is pending after a call; `opened`: it opened a new chain, not as a retry."""
    if call_kind == COMPACTION:
        return True
    return pending and not (opened and takes_label(call_kind))
