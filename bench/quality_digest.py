"""A digest of every selection `bench/quality.py` makes, to show a refactor changes none.

Runs quality.py's cases (all of them, both trims and the ablations' `choose_indices`) and
records each result: the messages sent, kept/dropped/shortened indices, counts, notes, the
decision. Prints the summary table and one sha256 over all records; writes the records, one
JSON line each, to OUT. Run it on two source trees and compare (identical = same selections):

    PYTHONPATH=/tmp/before/src python bench/quality_digest.py locomo - /tmp/before.jsonl > /tmp/before.json
    PYTHONPATH=src python bench/quality_digest.py locomo - /tmp/after.jsonl > /tmp/after.json
    cmp /tmp/before.json /tmp/after.json

SHAPE is locomo or reshaped; EMBED a sentence-transformers folder or `-` (see bench/README.md).
"""

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # noqa: E402

records = []
_trim, _choose = quality.trim_messages, quality.choose_indices


def trim(*a, **k):
    r = _trim(*a, **k)
    records.append(
        [
            "trim",
            k.get("max_tokens"),
            k.get("embed") is not None,
            r.messages,
            list(r.kept),
            list(r.dropped),
            list(r.shortened),
            r.tokens_before,
            r.tokens_after,
            r.budget,
            r.count_mode,
            r.over_budget,
            list(r.notes),
            r.reused,
            list(r.recalled),
            r.stable_prefix,
            r.decision.to_json() if r.decision else None,
        ]
    )
    return r


def choose(*a, **k):
    r = _choose(*a, **k)
    records.append(["choose", sorted(r)])
    return r


quality.trim_messages, quality.choose_indices = trim, choose
shape = sys.argv[1]
embed = None if sys.argv[2] == "-" else sys.argv[2]
quality.seed_tiktoken_cache()
out = quality.run(Path(quality.DEFAULT_DATA), False, shape, embed)
table = quality.summarize(out["hits"], out["methods"])
text = "\n".join(json.dumps(r, sort_keys=True) for r in records)
print(
    json.dumps(
        {
            "shape": shape,
            "embedder": bool(embed),
            "cases": out["cases"],
            "records": len(records),
            "selections_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "table": table,
        },
        sort_keys=True,
        indent=1,
    )
)
Path(sys.argv[3]).write_text(text)
