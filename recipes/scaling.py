"""BERT pre-training hyper-parameters for a cluster shape, keeping the global batch fixed.

The published recipe (see FACTS.md): phase 1 at sequence length 128, global
batch 65536, LAMB at 6e-3, warm-up 0.2843 of 7038 steps; phase 2 at 512,
global batch 32768, 4e-3, warm-up 0.128 of 1563 steps.  As the cluster grows
the global batch stays, so the per-GPU batch is global / GPUs, and the
accumulation steps are per-GPU batch / micro-batch, where the micro-batch is
what one GPU's memory holds at that sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from imgpipe.recipes.errors import ShapeError
from imgpipe.recipes.profiles import Profile


class PhaseRecipe(TypedDict):
    seq_len: int
    max_pred: int
    global_batch: int
    lr: float
    warmup: float
    steps: int


PHASES: dict[int, PhaseRecipe] = {
    1: {"seq_len": 128, "max_pred": 20, "global_batch": 65536, "lr": 6e-3, "warmup": 0.2843,
        "steps": 7038},
    2: {"seq_len": 512, "max_pred": 80, "global_batch": 32768, "lr": 4e-3, "warmup": 0.128,
        "steps": 1563},
}
# Sequences one GPU holds per micro-step, by GPU memory (GB) and phase, for BERT-Large
# in mixed precision: 16 GB holds 16 at 128 and 4 at 512, 32 GB 64 and 8 (FACTS.md);
# 80 GB measured recipes run 256 and 32.  CPU profiles (0 GB) use small micro-batches.
MICRO_BATCH = {0: (8, 4), 16: (16, 4), 32: (64, 8), 40: (128, 16), 80: (256, 32)}


@dataclass(frozen=True)
class Shape:
    profile: str
    nodes: int
    gpus_per_node: int
    phase: int
    seq_len: int
    max_pred: int
    global_batch: int
    per_gpu_batch: int  # after accumulation: BATCHSIZE in NVIDIA's recipes
    micro_batch: int
    accumulation: int  # GRADIENT_STEPS
    learning_rate: float
    warmup_proportion: float
    max_steps: int
    precision: str

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def config_name(self) -> str:
        return (f"config_{self.nodes}x{self.gpus_per_node}x{self.per_gpu_batch}x"
                f"{self.accumulation}.sh")


def micro_batch_for(profile: Profile, phase: int) -> int:
    memory = max(k for k in MICRO_BATCH if k <= profile.gpu.memory_gb)
    return MICRO_BATCH[memory][phase - 1]


def shape_for(profile: Profile, nodes: int, phase: int, adjust_global_batch: bool = False
              ) -> Shape:
    """The hyper-parameters for ``nodes`` nodes of ``profile``; ShapeError when impossible.

    A GPU count that does not divide the global batch (3, 12 or 24 nodes) is refused
    unless ``adjust_global_batch``: the global batch is then the largest multiple of the
    GPU count below the recipe's (65536 on 24 GPUs: 65520), with the same learning rate.
    """
    if phase not in PHASES:
        raise ShapeError(f"phase must be 1 or 2, not {phase}")
    if nodes < 1:
        raise ShapeError(f"nodes must be at least 1, not {nodes}")
    recipe = PHASES[phase]
    global_batch = recipe["global_batch"]
    max_steps = recipe["steps"]
    if profile.bert.global_batch:
        global_batch = profile.bert.global_batch[phase - 1]
    if profile.bert.max_steps:
        max_steps = profile.bert.max_steps[phase - 1]
    gpus = nodes * profile.gpus_per_node
    if gpus > global_batch:
        raise ShapeError(f"{gpus} GPUs exceed the global batch {global_batch} of phase {phase}")
    if global_batch % gpus and adjust_global_batch:
        global_batch -= global_batch % gpus
    elif global_batch % gpus:
        raise ShapeError(
            f"{nodes} node(s) of {profile.name} give {gpus} GPUs, which do not divide the "
            f"global batch {global_batch} of phase {phase}",
            hint="use a node count whose GPU count divides it (a power of two), or "
            "--adjust-global-batch to round the batch down to a multiple of it")
    per_gpu = global_batch // gpus
    micro = min(micro_batch_for(profile, phase), per_gpu)
    while per_gpu % micro:  # the largest micro-batch that divides the per-GPU batch
        micro -= 1
    return Shape(profile.name, nodes, profile.gpus_per_node, phase, recipe["seq_len"],
                 recipe["max_pred"], global_batch, per_gpu, micro, per_gpu // micro,
                 recipe["lr"], recipe["warmup"], max_steps, profile.gpu.precision)


def table(profile: Profile, max_nodes: int, phases: tuple[int, ...] = (1, 2)) -> list[Shape]:
    """Every shape from 1 to ``max_nodes`` nodes (powers of two) that keeps the global batch."""
    shapes = []
    nodes = 1
    while nodes <= max_nodes:
        for phase in phases:
            try:
                shapes.append(shape_for(profile, nodes, phase))
            except ShapeError:
                pass
        nodes *= 2
    return shapes
