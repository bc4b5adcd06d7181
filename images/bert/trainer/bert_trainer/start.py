"""Where a run starts: the checkpoint of its own phase when it resumes, else
``--init_checkpoint`` (any layout ``weights`` reads, checked against the run's config), else
fresh weights; with what the log says about it and the lineage its checkpoints carry on."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from bert_trainer.checkpoint import CheckpointError
from bert_trainer.config import BertConfig
from bert_trainer.lineage import Record, earlier
from bert_trainer.weights import load_initial, load_into


@dataclass
class Start:
    init_checkpoint: str | None  # what the weights came from, as the start line says it
    history: list[Record] = field(default_factory=list)  # the lineage before this phase
    lines: list[tuple[str, str]] = field(default_factory=list)  # (event, message) to log


def config_name(config_file: Path | None) -> str:
    """The run's config, as messages name it."""
    if config_file is None:
        return "the default config (BERT-Large: no --config_file)"
    return f"--config_file {config_file}"


def starting_point(init: Path | None, trust: bool, config: BertConfig, run: str, phase: int,
                   model: nn.Module, saved: dict | None, resume: Path | None) -> Start:
    """Load ``init`` into ``model`` unless the run resumes (``saved``, read from ``resume``);
    CheckpointError (one line) where the run cannot start from it."""
    if saved is not None:  # a requeued or continued run: its checkpoint has it all
        started = saved.get("init_checkpoint")
        lines = []
        if init is not None:
            lines.append(("warning", f"--init_checkpoint {init} not read: resuming from "
                          f"{resume}, which started from {started or 'fresh weights'}"))
        return Start(started, list(saved.get("lineage", []))[:-1], lines)
    if init is None:
        if phase == 2:
            raise CheckpointError("phase 2 starts from a phase 1 checkpoint: pass "
                                  "--init_checkpoint")
        return Start(None)
    if phase == 2 and not init.exists():  # phase 1 has not run (yet)
        raise CheckpointError(f"--init_checkpoint {init}: no ckpt_<step>.pt there or in its "
                              "phase1/ folder (run phase 1 first)")
    initial = load_initial(init, config, run, trust=trust)
    load_into(model, initial)
    own = initial.source.payload if initial.source.is_trainer_checkpoint else None
    started = str(initial.source.files[0]) if own is not None else initial.describe()
    history = earlier(own, None if own is not None else started, initial.layout, initial.kind)
    warnings = [line for line in (initial.unchecked, initial.fresh_line()) if line]
    return Start(started, history, [("note", f"{started}: {note}") for note in initial.notes]
                 + [("warning", line) for line in warnings])
