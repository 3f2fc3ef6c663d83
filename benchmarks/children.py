"""What the benchmarks that run each contender in a fresh process of its own share: reading the JSON line a child
prints, and merging a rerun's rows into a results file's."""

import json
from datetime import date


def child_result(done) -> dict:
    """The last JSON line the child (a ``subprocess.CompletedProcess``) printed, or {"error": ...} when it died
    without one (killed for memory, say), naming why."""
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    if done.returncode < 0:
        return {"error": f"killed by signal {-done.returncode}" + (" (out of memory?)" if done.returncode == -9 else "")}
    last = [line for line in done.stderr.splitlines() if line.strip()]
    return {"error": f"exit {done.returncode}: {last[-1][:200] if last else 'no output'}"}


def merged_rows(old: list, new: list, order: list) -> list:
    """``old``'s rows with ``new``'s in place of those of the same name, in ``order`` (each row keeps its date)."""
    today = date.today().isoformat()
    by_name = {row["name"]: row for row in old} | {row["name"]: {**row, "measured": today} for row in new}
    return sorted(by_name.values(), key=lambda row: list(order).index(row["name"]))
