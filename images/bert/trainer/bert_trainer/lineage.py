"""What a model went through, carried in every checkpoint as ``lineage``: one record per
phase it was trained in (data, sequence length, batch, steps, final loss, the image), after
where it started (public weights, or nothing).  A phase started from a trainer checkpoint
takes that checkpoint's lineage; the export's model card (``modelcard``) is written from it.

A phase resumed at another global batch (more ranks, another --train_batch_size) keeps the
batch each run of steps had: its ``global_batch`` is then None and ``batches`` lists
``{"from_step": N, "global_batch": B}``, each run lasting to the next one's start, the last
to the record's ``step``.
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


def resumed(record: Record, previous: Record | None, step: int) -> Record:
    """This phase's ``record`` for a run resuming after ``step``, whose checkpoint recorded the
    phase as ``previous``: the steps already run keep the global batch they ran at (None
    where a checkpoint from before lineage did not say)."""
    if step < 1:
        return record
    before = previous or {}
    batches = list(before.get("batches") or
                   [{"from_step": 1, "global_batch": before.get("global_batch")}])
    if batches[-1]["global_batch"] != record["global_batch"]:
        batches.append({"from_step": step + 1, "global_batch": record["global_batch"]})
    return _batches(record, batches)


def finished(record: Record, step: int, loss: float | None) -> Record:
    """The record a checkpoint at ``step`` carries: a batch no step has run at yet (a run
    resumed and stopped before its first step) is left out."""
    done = {**record, "step": step, "loss": loss}
    batches = [b for b in record.get("batches") or [] if b["from_step"] <= step]
    return _batches(done, batches) if batches else done


def _batches(record: Record, batches: list[Record]) -> Record:
    if len(batches) > 1:
        return {**record, "global_batch": None, "batches": batches}
    kept = {key: value for key, value in record.items() if key != "batches"}
    return {**kept, "global_batch": batches[0]["global_batch"]} if batches else kept
