"""User JSONL files read line by line: each non-blank line must be one JSON object, and a line
that is not is an error naming `path:line` and what was expected (no TensorFlow imported)."""

from __future__ import annotations

import json
from collections.abc import Iterator


def json_objects(path: str, prefix: str = "") -> Iterator[tuple[int, dict]]:
    """(line number, object) of every non-blank line of `path`; `prefix` starts the errors."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{prefix}{path}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: expected a JSON object, got invalid JSON ({e.msg}, "
                                 f"column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got a JSON "
                                 f"{type(row).__name__}: {line.strip()[:60]!r}")
            yield n, row
