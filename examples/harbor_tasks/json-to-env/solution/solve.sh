#!/bin/bash
python3 - <<'PY'
import json


def leaves(value, path):
    if isinstance(value, dict):
        for name, inner in value.items():
            yield from leaves(inner, [*path, name])
    else:
        text = str(value).lower() if isinstance(value, bool) else str(value)
        yield "_".join(path).upper(), text


config = json.load(open("/app/config.json"))
with open("/app/config.env", "w") as out:
    for key, text in sorted(leaves(config, [])):
        out.write(f"{key}={text}\n")
PY
