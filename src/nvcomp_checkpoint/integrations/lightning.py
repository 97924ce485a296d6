"""Lightning integration: a ``CheckpointIO`` plugin that writes compressed checkpoints.

``Trainer(plugins=[NvcompCheckpointIO()])`` and ``Fabric(plugins=[NvcompCheckpointIO()])`` save
every checkpoint with :func:`nvcomp_checkpoint.save` and load with :func:`nvcomp_checkpoint.load`.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import os
import sys
from typing import Any, Mapping, Optional

import torch
from typing_extensions import override

import nvcomp_checkpoint as nc
from nvcomp_checkpoint import CodecPolicy, SaveReport
from nvcomp_checkpoint.errors import UnsafeCheckpointError

try:  # the unified package: `lightning.pytorch.Trainer` and `lightning.fabric.Fabric`
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.utilities.cloud_io import get_filesystem
except ImportError:  # pragma: no cover - only the standalone packages are installed
    try:
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
        from lightning_fabric.utilities.cloud_io import get_filesystem
    except ImportError as exc:
        raise ImportError(
            "nvcomp_checkpoint.lightning needs Lightning: pip install 'nvcomp-checkpoint[lightning]'"
        ) from exc

__all__ = ["NvcompCheckpointIO", "load_from_checkpoint", "STORAGE_OPTION_KEYS"]

_POLICY_FIELDS = tuple(f.name for f in dataclasses.fields(CodecPolicy))
#: Keys accepted in ``storage_options`` of a single save: a whole ``policy``, any
#: :class:`CodecPolicy` field (``exp_avg``, ``overrides`` ...) applied on top of it, and
#: ``metadata`` stored in the file's index.
STORAGE_OPTION_KEYS = ("policy", "metadata", *_POLICY_FIELDS)

# torch.load(weights_only=None) means weights-only from torch 2.6 on.
_TORCH_WEIGHTS_ONLY_DEFAULT = torch.torch_version.TorchVersion(torch.__version__) >= "2.6"
_TRUE = ("1", "y", "yes", "true")

_LIGHTNING_HINT = (
    " With Lightning, pass weights_only=False to trainer.fit/validate/test(ckpt_path=...), "
    "fabric.load(...) or load_from_checkpoint(...)."
)


def _storage_as_loaded(storage: Any, location: str) -> Any:
    """Lightning's default ``map_location`` for plain files: every tensor stays where
    ``torch.load`` put it, on the CPU (so a file saved on a GPU loads on a CPU-only machine)."""
    return storage


def _resolve_weights_only(weights_only: Optional[bool]) -> bool:
    """What ``torch.load(weights_only=weights_only)`` does, which is what Lightning's loader does.

    Lightning passes ``None`` through to ``torch.load``, whose default is weights-only from
    torch 2.6 on; ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` and ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
    are honoured as ``torch.load`` honours them.
    """
    if os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE:
        return True
    if weights_only is None:
        if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE:
            return False
        return _TORCH_WEIGHTS_ONLY_DEFAULT
    return bool(weights_only)


class NvcompCheckpointIO(CheckpointIO):
    """Saves Lightning checkpoints compressed, per component (weights, optimizer moments ...).

    One class serves both ``Trainer(plugins=[...])`` and ``Fabric(plugins=[...])``, and can be
    wrapped in Lightning's ``AsyncCheckpointIO``. It loads plain ``torch.save`` checkpoints
    too, so a run that adds the plugin resumes from its old ``.ckpt`` files.

    Args:
        policy: Codec settings per component (a :class:`CodecPolicy` or its dict form); the
            default is portable (zstd over byte planes), loadable without a GPU.
        workers: Compression threads per save (default: every core).
        fsspec_options: Options for fsspec when paths are URLs (credentials, endpoint ...).

    Attributes:
        last_report: The :class:`SaveReport` of the most recent save (``None`` before one);
            ``plugin.last_report.table()`` prints what each component took.

    Example:
        >>> trainer = Trainer(plugins=[NvcompCheckpointIO(policy=CodecPolicy(exp_avg_sq="zstd"))])
        >>> trainer.save_checkpoint("x.ckpt", storage_options={"weights": {"codec": "zstd", "level": 3}})
    """

    def __init__(
        self,
        policy: CodecPolicy | Mapping[str, Any] | None = None,
        *,
        workers: int | None = None,
        fsspec_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        _register_with_standalone_packages()
        if policy is None:
            policy = CodecPolicy()
        elif isinstance(policy, Mapping):
            policy = CodecPolicy.from_dict(policy)
        elif not isinstance(policy, CodecPolicy):
            raise TypeError(f"NvcompCheckpointIO(policy=...) takes a CodecPolicy or a dict, got {type(policy).__name__}")
        self.policy: CodecPolicy = policy
        self.workers = workers
        self.fsspec_options = dict(fsspec_options or {})
        self.last_report: SaveReport | None = None

    def policy_for(self, storage_options: Optional[Any]) -> tuple[CodecPolicy, dict[str, Any] | None]:
        """The policy and index metadata of one save, given Lightning's ``storage_options``.

        Raises:
            TypeError: ``storage_options`` is not a dict.
            ValueError: it has keys this plugin does not know, or invalid values.
        """
        if storage_options is None:
            return self.policy, None
        if not isinstance(storage_options, Mapping):
            raise TypeError(
                f"NvcompCheckpointIO: storage_options must be a dict such as {{'policy': CodecPolicy(...)}} "
                f"or {{'exp_avg': 'zstd'}}, got {type(storage_options).__name__}"
            )
        unknown = sorted(set(storage_options) - set(STORAGE_OPTION_KEYS), key=str)
        if unknown:
            raise ValueError(
                f"NvcompCheckpointIO: unknown storage_options key(s) {unknown}; accepted: 'policy' (a CodecPolicy), "
                f"'metadata' (a JSON-safe dict) and the CodecPolicy fields {', '.join(_POLICY_FIELDS)}"
            )
        options = dict(storage_options)
        policy = options.pop("policy", None)
        metadata = options.pop("metadata", None)
        if policy is None:
            policy = self.policy
        elif isinstance(policy, Mapping):
            policy = CodecPolicy.from_dict(policy)
        elif not isinstance(policy, CodecPolicy):
            raise TypeError(f"NvcompCheckpointIO: storage_options['policy'] must be a CodecPolicy or a dict, got {type(policy).__name__}")
        if options:
            policy = policy.with_overrides(**options)
        if metadata is not None and not isinstance(metadata, Mapping):
            raise TypeError(f"NvcompCheckpointIO: storage_options['metadata'] must be a dict, got {type(metadata).__name__}")
        return policy, (dict(metadata) if metadata is not None else None)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` to ``path``, compressed; the file appears only once complete.

        Args:
            checkpoint: The checkpoint dict Lightning built (or the state given to ``fabric.save``).
            path: Local path or fsspec URL.
            storage_options: Per-save settings: ``{"policy": CodecPolicy(...)}``, any
                :class:`CodecPolicy` field (``{"exp_avg": "zstd"}``), ``{"metadata": {...}}``.

        Raises:
            ValueError: ``storage_options`` has an unknown key.
            nvcomp_checkpoint.errors.CheckpointWriteError: the write failed (disk full ...);
                any previous file at ``path`` is untouched.
        """
        policy, metadata = self.policy_for(storage_options)
        info = {}
        if isinstance(checkpoint, Mapping):  # Lightning's counters, readable with `nvckpt info`
            info = {k: checkpoint[k] for k in ("epoch", "global_step") if isinstance(checkpoint.get(k), int)}
        meta = {"written_by": type(self).__name__, **info, **(metadata or {})}
        self.last_report = nc.save(
            checkpoint, path, policy, metadata=meta, storage_options=self.fsspec_options or None, workers=self.workers
        )

    @override
    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Load a checkpoint written by this plugin, or a plain ``torch.save`` one.

        Args:
            path: Local path or fsspec URL.
            map_location: As for ``torch.load``. ``None``: tensors of a compressed file return
                to the device they were saved from (the CPU where that GPU is absent) and are
                decompressed there; a plain ``torch.save`` file loads onto the CPU, as Lightning's
                ``TorchCheckpointIO`` loads it.
            weights_only: As Lightning passes it: ``None`` is ``torch.load``'s default
                (weights-only from torch 2.6 on), ``False`` is for files you trust.

        Raises:
            FileNotFoundError: nothing at ``path`` (as Lightning's ``TorchCheckpointIO``).
            nvcomp_checkpoint.errors.FormatError: the file is corrupt or truncated (names it).
            nvcomp_checkpoint.errors.UnsafeCheckpointError: the file holds Python objects that
                a weights-only load refuses.
        """
        fs = get_filesystem(path, **self.fsspec_options)
        if not fs.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        if map_location is None and not nc.is_nvcomp_checkpoint(path, storage_options=self.fsspec_options or None):
            map_location = _storage_as_loaded
        try:
            return nc.load(
                path,
                map_location,
                weights_only=_resolve_weights_only(weights_only),
                storage_options=self.fsspec_options or None,
            )
        except UnsafeCheckpointError as exc:
            raise UnsafeCheckpointError(f"{exc}{_LIGHTNING_HINT}") from exc

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (``ModelCheckpoint`` calls this for old top-k files)."""
        fs = get_filesystem(path, **self.fsspec_options)
        if fs.exists(path):
            fs.rm(path, recursive=True)

    @override
    def teardown(self) -> None:
        """Nothing to release: every save finishes (or fails) before ``save_checkpoint`` returns."""


def _register_with_standalone_packages() -> None:
    # `pytorch_lightning.Trainer` and `lightning_fabric.Fabric` check plugins against their own
    # copy of CheckpointIO; registering makes this class acceptable to them too. Only done when
    # the user imported them: importing them here would reroute Lightning's rank-zero logging.
    module = sys.modules.get("lightning_fabric.plugins.io.checkpoint_io")
    standalone = getattr(module, "CheckpointIO", None)
    if standalone is not None and standalone is not CheckpointIO and not issubclass(NvcompCheckpointIO, standalone):
        standalone.register(NvcompCheckpointIO)


_register_with_standalone_packages()


def load_from_checkpoint(
    cls: Any,
    checkpoint_path: str | os.PathLike[str],
    map_location: Any = None,
    hparams_file: str | os.PathLike[str] | None = None,
    strict: bool | None = None,
    *,
    weights_only: bool | None = None,
    fsspec_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for files written by this plugin.

    Lightning's ``LightningModule.load_from_checkpoint`` reads the file with ``torch.load``
    itself, not through the Trainer's ``CheckpointIO``, so it cannot read a compressed file.
    This decompresses the file, then hands the checkpoint to ``cls.load_from_checkpoint``, so
    hyper-parameters, ``strict``, ``hparams_file`` and ``**kwargs`` behave exactly as there.
    Plain ``torch.save`` checkpoints go straight to ``cls.load_from_checkpoint``.

    Args:
        cls: A ``LightningModule`` or ``LightningDataModule`` subclass.
        checkpoint_path: Local path or fsspec URL.
        map_location, hparams_file, strict, weights_only, **kwargs: As for
            ``LightningModule.load_from_checkpoint``.
        fsspec_options: Options for fsspec when the path is a URL.

    Note:
        The decompressed checkpoint is serialized once in memory to hand it over: peak memory
        is about twice the checkpoint.

    Example:
        >>> model = load_from_checkpoint(MyModule, "checkpoints/last.ckpt")
    """
    accepts_weights_only = "weights_only" in inspect.signature(cls.load_from_checkpoint).parameters
    extra = dict(kwargs)
    if not nc.is_nvcomp_checkpoint(checkpoint_path, storage_options=fsspec_options):
        if accepts_weights_only:
            extra["weights_only"] = weights_only
        return cls.load_from_checkpoint(checkpoint_path, map_location=map_location, hparams_file=hparams_file, strict=strict, **extra)
    try:
        checkpoint = nc.load(
            checkpoint_path, map_location, weights_only=_resolve_weights_only(weights_only), storage_options=fsspec_options
        )
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{exc}{_LIGHTNING_HINT}") from exc
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    del checkpoint
    buffer.seek(0)
    if accepts_weights_only:
        # These bytes were just written from a checkpoint that already passed the caller's
        # weights_only check; a second check would only refuse what was already accepted.
        extra["weights_only"] = False
    # map_location was applied while decompressing; Lightning's default keeps devices as they are.
    return cls.load_from_checkpoint(buffer, hparams_file=hparams_file, strict=strict, **extra)
