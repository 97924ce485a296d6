"""Lightning's ``DeepSpeedStrategy`` with every file of its checkpoints written compressed.

``DeepSpeedStrategy`` saves and loads through ``deepspeed_engine.save_checkpoint`` /
``load_checkpoint`` and never calls the ``CheckpointIO``; :class:`NvcompDeepSpeedStrategy` attaches
:func:`nvcomp_checkpoint.deepspeed.attach`'s checkpoint engine to the DeepSpeed engine as soon as the
strategy has created it, so the same checkpoint folders (``latest``, ``checkpoint/``) hold our files.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from nvcomp_checkpoint import SaveReport
from nvcomp_checkpoint.entrypoint.support import check_options
from nvcomp_checkpoint.errors import CheckpointError
from nvcomp_checkpoint.version import install_hint

try:
    from lightning.pytorch.strategies import DeepSpeedStrategy
except ImportError as exc:  # pragma: no cover
    raise ImportError(f"nvcomp_checkpoint.lightning needs Lightning: {install_hint('lightning')}") from exc

from .lightning_sharded import StrategyOptions, nvcomp_plugin

__all__ = ["NvcompDeepSpeedStrategy", "check_deepspeed_checkpoint_io"]


class NvcompDeepSpeedStrategy(StrategyOptions, DeepSpeedStrategy):
    """``DeepSpeedStrategy`` whose checkpoints are compressed; takes its arguments, plus ``policy`` and ``workers``.

    Each ``trainer.save_checkpoint(path)`` (and ``ModelCheckpoint``'s saves) writes DeepSpeed's folder
    at ``path`` with every file compressed under DeepSpeed's own names; ``latest`` names the tag only
    once every rank's files are durable. ``fit(ckpt_path=...)`` loads ours and plain DeepSpeed
    folders. The policy is ``policy``, else that of an ``NvcompCheckpointIO`` passed as a plugin.
    Like ``DeepSpeedStrategy``, it runs on CUDA GPUs only (Lightning refuses other accelerators in
    ``setup_environment``).

    Attributes:
        last_reports: This rank's :class:`SaveReport` per file of the last committed checkpoint.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last_reports: list[SaveReport] = []

    @override
    def init_deepspeed(self) -> None:
        super().init_deepspeed()
        # The engine exists from here on; Lightning restores a checkpoint only after setup
        # (restore_checkpoint_after_setup), so a resume already reads through our engine.
        from nvcomp_checkpoint.entrypoint.deepspeed_engine import attach_once  # noqa: PLC0415

        attach_once(self.deepspeed_engine, policy=self.policy, workers=self.workers, on_commit=self._committed)

    def _committed(self, save_dir: str, tag: str, reports: list[SaveReport]) -> None:
        self.last_reports = list(reports)


def check_deepspeed_checkpoint_io(strategy: Any) -> None:
    """Refuse Lightning's stock ``DeepSpeedStrategy`` given an ``NvcompCheckpointIO`` (it never calls the
    plugin), and the plugin options :class:`NvcompDeepSpeedStrategy` cannot honour.

    Raises:
        CheckpointError: naming :class:`NvcompDeepSpeedStrategy`, or the option to drop.
    """
    if not isinstance(strategy, DeepSpeedStrategy):
        return
    plugin = nvcomp_plugin(strategy)
    if plugin is None:
        return
    if isinstance(strategy, NvcompDeepSpeedStrategy):
        check_options(
            "Lightning + DeepSpeed",
            "NvcompCheckpointIO",
            async_save=getattr(plugin, "async_save", False),
            tiers=getattr(plugin, "tiers", None),
            incremental=getattr(plugin, "incremental", None) is not None,
            leader_load=getattr(plugin, "leader_load", False),
        )
        return
    raise CheckpointError(
        f"NvcompCheckpointIO was given to Lightning's {type(strategy).__name__}, which saves through the DeepSpeed "
        "engine and never calls the CheckpointIO: its checkpoints would be written uncompressed. Use "
        "strategy=nvcomp_checkpoint.lightning.NvcompDeepSpeedStrategy(...) with the same arguments (it takes the "
        "plugin's policy), or drop the plugin."
    )
