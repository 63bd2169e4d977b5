"""Where records and merged shards live: local paths and pyarrow filesystem URIs alike.

- `location`: a path or URI as a pyarrow filesystem and path; the Parquet files under a folder (the one folder walk).
- `journal`: how the records store is written: the durable journal, its compaction into shards, the quarantine.
- `records`: how the records store is read: shards plus the live journal, by one reader.
- `merged`: the merged store: merged shards written and read.

The data contracts themselves are elsewhere: the record in `polar_mitm/records.py`, the merged sequence in
`polar_mitm/reconstruct/schema.py`.
"""
