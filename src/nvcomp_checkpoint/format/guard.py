"""The refusal behind the guard that starts every file (``docs/format.md``, "The guard").

A stock ``torch.load`` of one of our files unpickles the guard, whose one GLOBAL is
``MODULE``.``NAME``: the weights-only unpickler refuses it and prints that name, the hint; a full
unpickler imports this module and asks it for ``NAME``, and the module's ``__getattr__`` raises.
"""

from __future__ import annotations

from typing import NoReturn

from ..errors import FormatError

__all__ = ["MODULE", "NAME", "MESSAGE", "refuse_stock_loader"]

#: This module's import path: the GLOBAL's module, part of the format.
MODULE = "nvcomp_checkpoint.format.guard"
#: The GLOBAL's name, part of the format. No spaces: torch's weights-only error quotes it
#: whole only when it matches ``\S+``.
NAME = (
    "compressed_by_nvcomp-checkpoint:load_it_with_nvcomp_checkpoint.load(path)"
    "_or_Lightning_Trainer(plugins=[NvcompCheckpointIO()])"
)
MESSAGE = (
    "this file is a checkpoint compressed by nvcomp-checkpoint, not torch.save data, so torch.load "
    "cannot read it. Load it with nvcomp_checkpoint.load(path); in "
    "Lightning, with Trainer(plugins=[NvcompCheckpointIO()]) or NvcompCheckpointIO().load_checkpoint(path), "
    "and nvcomp_checkpoint.lightning.load_from_checkpoint(Model, path) for Model.load_from_checkpoint(path); "
    "or write a plain torch.save copy with `nvckpt decompress FILE OUT`"
)


def refuse_stock_loader() -> NoReturn:
    """Stops a full unpickler at the guard with the loaders to use (the file's path is not known here)."""
    raise FormatError(MESSAGE)


def __getattr__(name: str) -> NoReturn:
    # The first dotted part too: an unpickler that resolves dotted names (Python 3.14 for every
    # protocol) asks for that first. Other names stay ordinary missing attributes.
    if name in (NAME, NAME.split(".")[0]):
        refuse_stock_loader()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
