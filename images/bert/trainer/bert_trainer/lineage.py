"""What a model went through, carried in every checkpoint as ``lineage``: one record per
phase it was trained in (data, sequence length, batch, steps, final loss, the image), after
where it started (public weights, or nothing).  A phase started from a trainer checkpoint
takes that checkpoint's lineage; the export's model card (``modelcard``) is written from it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

Record = dict[str, Any]


def dataset_summary(input_dir: Path) -> Record | None:
    """What ``python -m bert_trainer.dataset prepare`` recorded of the data (its
    ``summary.json``, in the folder above ``phase<N>/``): documents, tokens, instances."""
    for folder in (input_dir, input_dir.parent):
        path = folder / "summary.json"
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(summary, dict):
            continue
        phase = (summary.get("phases") or {}).get(input_dir.name.removeprefix("phase"), {})
        return {"documents": summary.get("documents"), "tokens": summary.get("tokens"),
                "instances": phase.get("instances") if isinstance(phase, dict) else None}
    return None


def earlier(payload: dict[str, Any] | None, source: str | None, layout: str | None,
            kind: str | None) -> list[Record]:
    """The lineage a phase starts with: a trainer checkpoint's own (``payload``), else a
    record of the public weights it starts from (``source``), else none."""
    if payload is not None and "lineage" in payload:
        return list(payload["lineage"])
    if payload is not None:  # a checkpoint written before lineage was recorded
        return [{key: payload.get(key) for key in ("phase", "step", "loss", "image",
                                                   "image_digest")}]
    if source is not None:
        return [{"from": source, "layout": layout, "kind": kind}]
    return []


def phase_record(phase: int, input_dir: Path, shards: int, max_seq_length: int,
                 max_predictions: int, global_batch: int, learning_rate: float,
                 max_steps: int, init_checkpoint: str | None, image: str | None,
                 image_digest: str | None) -> Record:
    """This phase's record, before its steps and loss are known."""
    return {"phase": phase, "input_dir": str(input_dir), "shards": shards,
            "data": dataset_summary(input_dir), "max_seq_length": max_seq_length,
            "max_predictions_per_seq": max_predictions, "global_batch": global_batch,
            "learning_rate": learning_rate, "max_steps": max_steps,
            "init_checkpoint": init_checkpoint, "image": image, "image_digest": image_digest}
