"""Every on-disk contract, and where it lives: local paths and pyarrow filesystem URIs alike.

Each contract keeps its schema, typed row, validation, writer and reader together; the other packages
(gateway, reconstruct, rollout, train, report) depend on these modules for data, never on each other.

- `location`: a path or URI as a pyarrow filesystem and path; the Parquet files under a folder (the one folder walk).
- `records`: the per-request record (RECORD_SCHEMA, `Record`, strict journal-row conversion) and the one reader of
  the records store (shards plus the live journal).
- `journal`: how records are written: the durable journal, its compaction into shards, the quarantine.
- `compact_child`: the child process the writer compacts journals in while the gateway serves.
- `journal_format`: the journal's frames and file names, shared by the writer and the reader.
- `merged`: the merged sequence (MERGED_SCHEMA, `MergedSequence`, its checks) and the merged store's shards.
- `rewards`: a rollout's rewards file (REWARDS_SCHEMA, `RewardRow`), its writer, and the rewards merge joins.
- `session_ends`: how a session ended (`SessionEnd`: on rewards rows, merged sequences and service traces), how it is
  decided from the runner's status and the recorded calls, and the rules (`EndRules`) that act on each end.
- `engine_info`: `_engine.json`, the description of the engine the records came from.
- `judgments`: what an LLM judge said about a rollout's sessions (per session, per call), and its answer cache.
"""
