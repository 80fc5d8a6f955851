"""Writes ``unbuildable.json``: every mapping pair that fails today, with the reason (a family's representative
pair: memopt's check; every other pair: the tiny build).

Run after a transformers upgrade or a memopt fix: ``python -m tests.zoo.make_unbuildable`` (``--shard I/N`` runs
every N-th pair into ``unbuildable.I.jsonl`` for N processes; ``--merge`` then writes the list from the shards;
``--recheck`` runs only the listed pairs again, after a fix).
The zoo's tests fail while the list is out of date (a pair newly failing, or a listed pair that left the
mappings or passes).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

from tests.zoo.mapping_zoo import TORCHVISION_REASON, UNBUILDABLE, failure, mapping_pairs, representatives


def _reason(pair: str, full: set[str]) -> str | None:
    return failure(pair, full=pair in full)


def _shard(index: int, count: int) -> Path:
    full = representatives()
    out = UNBUILDABLE.with_name(f"unbuildable.{index}.jsonl")
    with out.open("w") as f:
        for pair in mapping_pairs()[index::count]:
            f.write(json.dumps({"pair": pair, "reason": _reason(pair, full)}) + "\n")
            f.flush()
    return out


def _write(results: dict[str, str | None]) -> None:
    import transformers

    pairs = {p: r for p, r in sorted(results.items()) if r is not None}
    doc = {"transformers": transformers.__version__, "torchvision": TORCHVISION_REASON, "pairs": pairs}
    UNBUILDABLE.write_text(json.dumps(doc, indent=1) + "\n")


def main(argv: list[str]) -> None:
    warnings.filterwarnings("ignore")
    if argv[:1] == ["--shard"]:
        index, count = (int(x) for x in argv[1].split("/"))
        _shard(index, count)
    elif argv[:1] == ["--recheck"]:  # after a fix: only the listed pairs run again
        full = representatives()
        old = json.loads(UNBUILDABLE.read_text())["pairs"]
        _write({pair: _reason(pair, full) for pair in old if pair in set(mapping_pairs())})
    elif argv[:1] == ["--merge"]:
        results: dict[str, str | None] = {}
        for part in sorted(UNBUILDABLE.parent.glob("unbuildable.*.jsonl")):
            for line in part.read_text().splitlines():
                row = json.loads(line)
                results[row["pair"]] = row["reason"]
            part.unlink()
        missing = set(mapping_pairs()) - set(results)
        if missing:
            raise SystemExit(f"the shards miss {len(missing)} pairs, e.g. {sorted(missing)[:3]}: run every shard")
        _write(results)
    else:
        full = representatives()
        _write({pair: _reason(pair, full) for pair in mapping_pairs()})


if __name__ == "__main__":
    main(sys.argv[1:])
