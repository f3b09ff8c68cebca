"""The parse of the shipped rule files that rule loading uses in place of PyYAML when a file's
bytes match (agent/engine/rulefile.py ``shipped_parsed``): ``rules/parsed.jsonl``, a line per
file, ``SHA-256 NAME JSON``. After editing a file under rules/, regenerate it:

    .venv/bin/python -m tests.support.rule_twin
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import yaml

RULES = Path(__file__).resolve().parents[2] / "rules"


def twin_text(folder: Path = RULES) -> str:
    """The twin of every ``*.yml``/``*.yaml`` file of ``folder``, sorted by name."""
    lines = []
    for p in sorted(folder.iterdir()):
        if p.suffix in (".yml", ".yaml") and p.is_file():
            raw = p.read_bytes()
            data = yaml.safe_load(raw.decode("utf-8"))
            lines.append(f"{hashlib.sha256(raw).hexdigest()} {p.name} "
                         f"{json.dumps(data, ensure_ascii=False, separators=(',', ':'), allow_nan=False)}\n")
    return "".join(lines)


def main() -> int:
    (RULES / "parsed.jsonl").write_text(twin_text(), "utf-8")
    print(f"wrote {RULES / 'parsed.jsonl'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
