"""A run directory's ``metrics.jsonl`` as the tests read it, also while the run still writes it."""
import json
from pathlib import Path


def records(run_dir, kind=None):
    """The records of ``kind`` (None: all), in the order written; [] before the file exists. A last line with no
    newline yet is one rank 0 is writing at this moment, so it is left for the next read; any other line that is not
    JSON fails the test."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
    return [r for r in map(json.loads, lines) if kind is None or r.get("kind") == kind]
