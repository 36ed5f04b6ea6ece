"""What the caption command says at its end besides the statistics: where the captions went,
which files failed, the graphs' reasons in the command's words, a demo's captions."""

import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from encoder_graphs.app.errors import printable

if TYPE_CHECKING:
    from encoder_graphs.app.plan import Plan
    from encoder_graphs.engine.statistics import GraphStats


def said_by_flag(graph_stats: "GraphStats") -> "GraphStats":
    """The graphs' statistics with their "turned off" reason (the API's `enabled=False`) said as
    the flag that turned them off here, --no-graphs (a key of the miss reasons too)."""
    return type(graph_stats).from_json(_said_by_flag(graph_stats.to_json()))


def _said_by_flag(data: object) -> object:
    from encoder_graphs.packing.reasons import EagerReason

    if isinstance(data, dict):
        return {("--no-graphs" if key == EagerReason.TURNED_OFF else key): _said_by_flag(value) for key, value in data.items()}
    return "--no-graphs" if data == EagerReason.TURNED_OFF else data


SHOWN_FAILURES = 5  # failed files the report names


def outcome(plan: "Plan") -> str:
    """Where the captions went, and which files failed (their errors are in their records)."""
    settings = plan.settings
    places = [printable(settings.out)] + ([f"sidecars ({plan.sidecars.ext})"] if plan.sidecars.enabled else [])
    lines = ["captions: " + ", ".join(places) + (", metadata files (below)" if settings.hf_metadata else "")]
    failed = [f.path for f in plan.files if plan.results.is_failed(f.path)]
    if failed:
        more = f" and {len(failed) - SHOWN_FAILURES} more" if len(failed) > SHOWN_FAILURES else ""
        names = ", ".join(printable(p) for p in failed[:SHOWN_FAILURES])
        lines.append(f"failed, by their latest record: {len(failed)} ({names}{more}); each record's \"error\" says "
                     "why, and --retry-failed tries them again")
    return "\n".join(lines)


def show_samples(plan: "Plan") -> None:
    """`--samples` without `--out`: the demo's captions printed, its temporary folder removed."""
    from encoder_graphs.app.outputs import latest_records

    folder = plan.settings.out.parent
    records = latest_records(plan.settings.out) if plan.settings.out.exists() else {}
    for record in sorted(records.values(), key=lambda r: r["path"]):
        print(f"{Path(record['path']).name}: {record.get('text', record.get('error'))}")
    shutil.rmtree(folder, ignore_errors=True)
    print("encoder-graphs: a demo's records are not kept; give --out FILE to keep them", file=sys.stderr)
