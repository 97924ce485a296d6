"""Sharded checkpoints through torch.distributed.checkpoint (DCP), compressed by nvcomp-checkpoint.

``dcp.save(state, storage_writer=NvcompWriter(path))`` and
``dcp.load(state, storage_reader=NvcompReader(path))``; ``dcp_report(path)`` is a committed checkpoint's
``SaveReport``. The directory layout is in ``docs/dcp.md``.
"""

from __future__ import annotations

from .convert import compress_directory, decompress_directory
from .layout import StoredItem
from .reader import NvcompReader, is_compressed_dcp_checkpoint, read_stored_metadata
from .report import DcpFiles, RankFile, dcp_report, read_dcp_files
from .writer import FqnPolicy, NvcompWriter, fqn_component

__all__ = [
    "NvcompWriter",
    "NvcompReader",
    "FqnPolicy",
    "StoredItem",
    "fqn_component",
    "is_compressed_dcp_checkpoint",
    "read_stored_metadata",
    "dcp_report",
    "read_dcp_files",
    "DcpFiles",
    "RankFile",
    "compress_directory",
    "decompress_directory",
]
