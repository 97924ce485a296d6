"""The refusal behind the guard that starts every file (``docs/format.md``, "The guard").

A stock ``torch.load`` of one of our files unpickles the guard, whose one GLOBAL is
``MODULE``.``NAME``: the weights-only unpickler refuses it and prints that name, the hint; a full
unpickler imports this module and asks it for ``NAME``, and the module's ``__getattr__`` raises.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from ..errors import FormatError

__all__ = ["MODULE", "NAME", "MESSAGE", "DEEPSPEED_MESSAGE", "refuse_stock_loader"]

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
    "cannot read it on its own. To let torch.load (and the tools built on it) read it, run "
    "`import nvcomp_checkpoint; nvcomp_checkpoint.enable_torch_load()` first ("
    "weights-only rules kept; docs/other-tools.md). Or load it with nvcomp_checkpoint.load(path); in "
    "Lightning, with Trainer(plugins=[NvcompCheckpointIO()]) or NvcompCheckpointIO().load_checkpoint(path), "
    "and nvcomp_checkpoint.lightning.load_from_checkpoint(Model, path) for Model.load_from_checkpoint(path); "
    "or write a plain torch.save copy with `nvckpt decompress FILE OUT`"
)
#: The refusal when DeepSpeed's own code (its engine, ``zero_to_fp32``, ``ds_to_universal``) loads the file.
DEEPSPEED_MESSAGE = (
    "this file is a DeepSpeed checkpoint file compressed by nvcomp-checkpoint, and DeepSpeed read it "
    "with torch.load outside nvcomp-checkpoint's hook. In a script, attach the engine "
    "(`nvcomp_checkpoint.deepspeed.attach(engine)`: its load_checkpoint reads every form), or wrap "
    "DeepSpeed's call in `with nvcomp_checkpoint.deepspeed.deepspeed_torch_load():` (zero_to_fp32's "
    "functions, ds_to_universal); run DeepSpeed's scripts as `nvckpt run ckpt/zero_to_fp32.py ckpt OUT` or "
    "`nvckpt run -m deepspeed.checkpoint.ds_to_universal ...`; or write plain files with "
    "`nvckpt decompress DIR OUT` (docs/deepspeed.md)"
)

#: DeepSpeed copies zero_to_fp32.py into every checkpoint folder, where it runs as ``__main__``.
_DEEPSPEED_SCRIPTS = ("zero_to_fp32.py", "ds_to_universal.py")


def _called_from_deepspeed() -> bool:
    """Whether DeepSpeed's code is on the stack below the unpickler: its engine, its checkpoint tools, its scripts."""
    frame = sys._getframe(1)
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        top = name.split(".")[0]
        if top == "deepspeed" or os.path.basename(frame.f_code.co_filename) in _DEEPSPEED_SCRIPTS:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def refuse_stock_loader() -> NoReturn:
    """Stops a full unpickler at the guard with the loaders to use (the file's path is not known here)."""
    raise FormatError(DEEPSPEED_MESSAGE if _called_from_deepspeed() else MESSAGE)


def __getattr__(name: str) -> NoReturn:
    # The first dotted part too: an unpickler that resolves dotted names (Python 3.14 for every
    # protocol) asks for that first. Other names stay ordinary missing attributes.
    if name in (NAME, NAME.split(".")[0]):
        refuse_stock_loader()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
