"""What each integration supports of the shared options, declared once and checked in one place.

Every entry point (a framework on one kind of checkpoint) is a :class:`Stack`: the kind of files it
writes (its :class:`Backend`) and what the framework around it adds. :func:`check_options` refuses,
with one message format, an option a stack declares it cannot honour; :func:`support_matrix` renders
the same declarations as the table in docs/orchestration.md (a test keeps the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from ..errors import UnsupportedOptionError

__all__ = ["OPTIONS", "Backend", "Stack", "STACKS", "stack", "check_options", "support_matrix"]

#: The options every entry point takes, in the order of the matrix's columns.
OPTIONS = ("async_save", "tiers", "incremental", "leader_load", "compress_weights")

_DOCS = "docs/orchestration.md (what each stack supports)"


def _frozen(refuses: Mapping[str, str]) -> Mapping[str, str]:
    unknown = set(refuses) - set(OPTIONS)
    if unknown:
        raise ValueError(f"not an option of OPTIONS: {sorted(unknown)}")
    return MappingProxyType(dict(refuses))


@dataclass(frozen=True)
class Backend:
    """A kind of checkpoint files and the options it cannot honour whatever framework writes it.

    Attributes:
        name: What it writes, as the docs' table names it.
        refuses: Option -> why it cannot be honoured and what to do instead.
    """

    name: str
    refuses: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "refuses", _frozen(self.refuses))


@dataclass(frozen=True)
class Stack:
    """One entry point on one backend: a row of the support matrix.

    Attributes:
        name: The framework and its checkpoint kind ("Accelerate + DeepSpeed").
        entry: What the user calls (``register_nvcomp_hooks``, ``NvcompCheckpointIO`` ...).
        backend: The files it writes.
        refuses: What the framework adds to the backend's refusals (option -> why, and the fix).
    """

    name: str
    entry: str
    backend: Backend
    refuses: Mapping[str, str] = field(default_factory=dict)
    applies: frozenset[str] = frozenset(OPTIONS)

    def __post_init__(self) -> None:
        object.__setattr__(self, "refuses", _frozen(self.refuses))

    def refused(self) -> Mapping[str, str]:
        """Every option this stack refuses, with its reason (the stack's own reason first)."""
        return {**self.backend.refuses, **self.refuses}


ONE_FILE = Backend("one compressed file per state tree")
#: Rank files are saved in full: with Accelerate's ``incremental=True`` only the folder's other files
#: are deltas.
DCP_RANK_FILES = Backend("DCP rank files (sharded state)")
DEEPSPEED_PARTITIONS = Backend(
    "DeepSpeed ZeRO partition files",
    {
        "leader_load": "DeepSpeed's ZeRO ranks each load their own optimizer partition file "
        "(zero_pp_rank_N_...), so no file is read by every rank for one to broadcast; drop leader_load",
    },
)
TRAINER_FOLDER = Backend("a Trainer's checkpoint-N folder, converted in place")

_DS_FRAMEWORK = (
    "each rank writes its ZeRO partition compressed through the DeepSpeed engine, synchronously and in full, "
    "and this integration does not pass {option} on to it yet. Drop it, or attach the engine yourself: "
    "nvcomp_checkpoint.deepspeed.attach(engine, async_save=True, tiers=[...], incremental=True) supports all three"
)


def _ds(*options: str) -> dict[str, str]:
    return {o: _DS_FRAMEWORK.format(option=o) for o in options}


#: Every entry point, as the docs' matrix lists them.
STACKS: tuple[Stack, ...] = (
    Stack("Lightning", "NvcompCheckpointIO", ONE_FILE, applies=frozenset(OPTIONS) - {"compress_weights"}),
    Stack(
        "Lightning sharded (ModelParallel / FSDP)",
        "NvcompModelParallelStrategy, NvcompFSDPStrategy",
        DCP_RANK_FILES,
        {
            "incremental": "its sharded checkpoints are directories of rank files written through "
            "torch.distributed.checkpoint, saved in full: a rank file stored as a delta of the same rank's file "
            "in the previous checkpoint measured 94% of the full file 10 AdamW steps apart (85% one step apart; "
            "an 8.4M-parameter fp32 MLP, 2 ranks) and more than the full file on a tiny model, too little to be "
            "worth a chain every resume reads back. Drop incremental=True (tiers=... still copies each "
            "checkpoint), or save one-file checkpoints",
        },
        applies=frozenset(OPTIONS) - {"compress_weights"},
    ),
    Stack(
        "Lightning + DeepSpeed",
        "NvcompDeepSpeedStrategy",
        DEEPSPEED_PARTITIONS,
        applies=frozenset(OPTIONS) - {"compress_weights"},
    ),
    Stack("Accelerate", "register_nvcomp_hooks", ONE_FILE, applies=frozenset(OPTIONS) - {"compress_weights"}),
    Stack("Accelerate + FSDP", "register_nvcomp_hooks", DCP_RANK_FILES, applies=frozenset(OPTIONS) - {"compress_weights"}),
    Stack(
        "Accelerate + DeepSpeed",
        "register_nvcomp_hooks",
        DEEPSPEED_PARTITIONS,
        applies=frozenset(OPTIONS) - {"compress_weights"},
    ),
    Stack(
        "HF Trainer",
        "NvcompTrainerCallback, NvcompTrainer",
        TRAINER_FOLDER,
        {
            "incremental": "is not supported: the Trainer deletes old checkpoint-N folders itself (save_total_limit, "
            "best-model rotation) without asking, which would delete bases that kept deltas need. Save in full here, "
            "or use nc.CheckpointManager(tiers, incremental=True) or the Lightning / Accelerate integrations' "
            "incremental=True",
        },
    ),
    Stack(
        "HF Trainer + DeepSpeed",
        "NvcompTrainer + NvcompTrainerCallback",
        DEEPSPEED_PARTITIONS,
        {
            "compress_weights": "model.safetensors stays the plain export from_pretrained reads under DeepSpeed; "
            "drop compress_weights",
        },
    ),
    Stack(
        "HF Trainer + DeepSpeed, stock Trainer",
        "NvcompTrainerCallback",
        DEEPSPEED_PARTITIONS,
        {
            "incremental": "is not supported with a stock Trainer that rotates: it deletes old checkpoint-N folders "
            "itself (save_total_limit), which would delete bases that kept deltas need. Use "
            "nvcomp_checkpoint.transformers.NvcompTrainer (its rotation keeps the folders kept deltas need), or "
            "save_total_limit=None",
            "compress_weights": "model.safetensors stays the plain export from_pretrained reads under DeepSpeed; "
            "drop compress_weights",
        },
    ),
    Stack(
        "DeepSpeed", "nvcomp_checkpoint.deepspeed.attach", DEEPSPEED_PARTITIONS, applies=frozenset(OPTIONS) - {"compress_weights"}
    ),
)


def stack(name: str) -> Stack:
    """The stack of :data:`STACKS` called ``name``."""
    for s in STACKS:
        if s.name == name:
            return s
    raise KeyError(f"no stack {name!r}; known: {', '.join(s.name for s in STACKS)}")


def check_options(name: str, where: str, **options: object) -> None:
    """Refuse the options (those set: not ``None``, ``False`` or empty) that stack ``name`` cannot honour.

    Args:
        name: A stack of :data:`STACKS`.
        where: What the user called, named in the message (``register_nvcomp_hooks``, a folder ...).
        options: The options as the user gave them.

    Raises:
        UnsupportedOptionError: naming every refused option, the stack, why, and what to do.
    """
    s = stack(name)
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise ValueError(f"check_options: not an option of OPTIONS: {sorted(unknown)}")
    refused = s.refused()
    hit = [o for o in OPTIONS if o in options and bool(options[o]) and o in refused]
    if hit:
        reasons = " ".join(f"{o}: {refused[o]}." for o in hit)
        raise UnsupportedOptionError(
            f"{where}({', '.join(f'{o}=...' for o in hit)}) with {s.name}: {reasons} What each stack supports: {_DOCS}."
        )


def support_matrix() -> str:
    """The markdown table of :data:`STACKS` x :data:`OPTIONS` that docs/orchestration.md holds."""
    head = "| stack | entry point | files | " + " | ".join(f"`{o}`" for o in OPTIONS) + " |"
    rule = "|" + "---|" * (3 + len(OPTIONS))
    rows = [head, rule]
    for s in STACKS:
        refused = s.refused()
        cells = ["n/a" if o not in s.applies else ("refused" if o in refused else "yes") for o in OPTIONS]
        rows.append(f"| {s.name} | `{s.entry}` | {s.backend.name} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m nvcomp_checkpoint.entrypoint.support: the table for the docs
    print(support_matrix(), end="")
