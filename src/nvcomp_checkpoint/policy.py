"""Per-component codec policy: which part of a checkpoint a tensor is, and how to store it.

A checkpoint is mostly optimizer state; weights, first moments, second moments and gradients
compress differently, so each component gets its own :class:`CodecSpec`.
"""

from __future__ import annotations

import difflib
import fnmatch
import numbers
import os
import re
import sys
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .codecs import CODEC_IDS, check_level, codec_facts
from .codecs.registry import CHUNK_CAP_BYTES, MIN_CHUNK_BYTES
from .filters import FILTER_IDS, exponent_rotation
from .planechoice import ROTATION_CHOICE_MIN_BYTES

if TYPE_CHECKING:
    import torch

__all__ = ["Component", "CodecSpec", "CodecPolicy", "classify", "key_string"]


class Component(str, Enum):
    """The parts of a training checkpoint that are compressed with their own settings."""

    WEIGHTS = "weights"
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"
    GRADIENTS = "gradients"
    OTHER = "other"

    def __str__(self) -> str:
        return self.value


#: Keys under which real code keeps optimizer state (torch, Lightning, Accelerate, HF, DeepSpeed).
_OPTIMIZER_KEYS = {
    "optimizer",
    "optimizers",
    "optimizer_states",
    "optimizer_state",
    "optimizer_state_dict",
    "optim",
    "optim_state",
    "optim_state_dict",
    "opt",
    "opt_state",
}
#: First-moment-like optimizer buffers: Adam/AdamW/Adamax/NAdam/RAdam, SGD momentum, Lion,
#: centered RMSprop's gradient average.
_EXP_AVG_KEYS = {"exp_avg", "momentum_buffer", "momentum", "m", "mu_product_exp_avg", "grad_avg"}
#: Second-moment-like buffers: Adam(W) incl. amsgrad, Adafactor's factored rows/cols (HF names
#: and torch.optim.Adafactor's row_var/col_var/variance), RMSprop, Adagrad, Adadelta, Adamax's
#: infinity norm.
_EXP_AVG_SQ_KEYS = {
    "exp_avg_sq",
    "max_exp_avg_sq",
    "exp_avg_sq_row",
    "exp_avg_sq_col",
    "square_avg",
    "sum",
    "acc_delta",
    "exp_inf",
    "v",
    "row_var",
    "col_var",
    "variance",
}
_GRADIENT_KEYS = {"grad", "grads", "gradient", "gradients"}
#: Subtrees that are never model weights even when they hold float tensors.
_OTHER_KEYS = {
    "rng_state",
    "rng_states",
    "rng",
    "lr_scheduler",
    "lr_schedulers",
    "scheduler",
    "schedulers",
    "loops",
    "callbacks",
    "scaler",
    "grad_scaler",
    "native_amp_scaling_state",
    "hyper_parameters",
}


def key_string(path: Sequence[Any]) -> str:
    """The display key of a tensor: its path in the tree joined with ``/``."""
    return "/".join(str(p) for p in path)


def classify(path: Sequence[Any]) -> Component:
    """Classify a tensor by its path in the checkpoint tree.

    Understands a bare ``state_dict``, ``{"model": ..., "optimizer": ...}``, Lightning's
    checkpoint dict (``state_dict``, ``optimizer_states``, ``loops``, ``callbacks`` ...) and
    ``torch.optim`` state (``state[param_id]["exp_avg"]``).
    """
    keys = [str(p).lower() for p in path]
    if not keys:
        return Component.WEIGHTS
    last = keys[-1]
    in_optimizer = any(k in _OPTIMIZER_KEYS or k.startswith("optimizer") for k in keys[:-1])
    # torch.optim state: ..., "state", <param id>, <buffer name>
    looks_like_optim_state = len(keys) >= 3 and keys[-3] == "state"
    if in_optimizer or looks_like_optim_state:
        if last in _EXP_AVG_KEYS:
            return Component.EXP_AVG
        if last in _EXP_AVG_SQ_KEYS:
            return Component.EXP_AVG_SQ
        if in_optimizer or keys[-2].isdigit():
            # Other optimizer buffers ("step", ...), also in a bare optimizer.state_dict().
            return Component.OTHER
    if any(k in _GRADIENT_KEYS or k.endswith(".grad") for k in keys):
        return Component.GRADIENTS
    if any(k in _OTHER_KEYS for k in keys):
        return Component.OTHER
    return Component.WEIGHTS


_NONE_TAKES_NOTHING = "'none' stores the bytes as they are: it takes no level and no filter; write 'none'"


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """`` (did you mean 'X'?)`` for the choice closest to a misspelt ``word`` (``bytplane``), or ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass(frozen=True)
class CodecSpec:
    """How one tensor is stored.

    Attributes:
        codec: Codec id: ``"zstd"`` (portable), ``"none"``, or a GPU-only nvCOMP codec
            (``"ans"``, ``"bitcomp"``, ``"gdeflate"``, ``"cascaded"``).
        level: Compression level for codecs that have one.
        filter: ``"byteplane"`` (bytes of equal significance grouped), ``"rotplane"`` (the
            same, after rotating each bf16 / fp32 element left by one bit so that its whole
            exponent is one plane; other dtypes get plain byte planes; files are format
            version 4, which readers before it refuse) or ``"none"``.
        chunk_bytes: Raw bytes per chunk; chunks compress in parallel and stream to storage.
            0 or None (the default): the codec's default from the facts table (codecs/registry.py),
            4 MiB for all but ``gdeflate``, whose nvCOMP chunks are 64 KiB at most.
        adaptive: ``zstd`` on the CPU only: each frame (byte plane) of 256 KiB or more is
            compressed with whichever of level 1's parameters and ``level``'s compresses a
            32 KiB sample of it smallest. Strong levels gain most on exponent planes and
            nothing on noise planes, so this buys most of ``level``'s ratio for part of its
            time (:meth:`CodecPolicy.max_ratio`). Frames are standard Zstd frames either way;
            the GPU writer ignores it (nvCOMP's Zstd has no levels).
    """

    codec: str = "zstd"
    level: int | None = 1
    filter: str = "byteplane"
    chunk_bytes: int = 0  # 0 (or None): the codec's default, set when the spec is built
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.codec not in CODEC_IDS:
            raise ValueError(
                f"unknown codec {self.codec!r}{did_you_mean(self.codec, CODEC_IDS)}; choose one of {', '.join(CODEC_IDS)}"
            )
        if self.filter not in FILTER_IDS:
            raise ValueError(
                f"unknown filter {self.filter!r}{did_you_mean(self.filter, FILTER_IDS)}; choose one of {', '.join(FILTER_IDS)}"
            )
        facts = codec_facts(self.codec)
        if self.chunk_bytes is None or (self.chunk_bytes == 0 and not isinstance(self.chunk_bytes, bool)):
            object.__setattr__(self, "chunk_bytes", facts.default_chunk_bytes)
        if not isinstance(self.chunk_bytes, int) or isinstance(self.chunk_bytes, bool):
            raise ValueError(f"chunk_bytes must be an int (bytes), got {type(self.chunk_bytes).__name__} {self.chunk_bytes!r}")
        if self.level is not None and (not isinstance(self.level, int) or isinstance(self.level, bool)):
            raise ValueError(f"level must be an int or None, got {type(self.level).__name__} {self.level!r}")
        if not (MIN_CHUNK_BYTES <= self.chunk_bytes <= CHUNK_CAP_BYTES):
            raise ValueError(
                f"chunk_bytes must be between {MIN_CHUNK_BYTES >> 10} KiB and {CHUNK_CAP_BYTES >> 20} MiB, got {self.chunk_bytes}"
            )
        check_level(self.codec, self.level)
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be a bool, got {type(self.adaptive).__name__} {self.adaptive!r}")
        if self.adaptive and self.codec != "zstd":
            raise ValueError(f"adaptive applies to codec 'zstd' only, not {self.codec!r}")
        if self.chunk_bytes > facts.max_chunk_bytes:
            # GPU-only codecs cannot cut a chunk on another device, so their nvCOMP limit is the
            # policy's (ans, bitcomp, cascaded: 16 MiB; gdeflate: 64 KiB; codecs/registry.py).
            raise ValueError(
                f"codec {self.codec!r} takes chunks of at most {facts.max_chunk_bytes} bytes, got {self.chunk_bytes}"
            )

    @classmethod
    def parse(cls, text: str) -> "CodecSpec":
        """A spec from its shorthand ``CODEC[:LEVEL][:FILTER]``: ``zstd``, ``zstd:3``, ``zstd:3:none``, ``ans``, ``none``.

        Raises:
            ValueError: an unknown codec or filter, or a part that is neither a level nor a filter.
        """
        parts = [p.strip() for p in text.strip().split(":")]
        codec, level, filt = parts[0].lower(), None, "byteplane"
        for part in parts[1:]:
            if part.lstrip("-").isdigit():
                level = int(part)
            elif part.lower() in FILTER_IDS:
                filt = part.lower()
            else:
                raise ValueError(
                    f"codec spec {text!r}: {part!r} is neither a level nor a filter ({', '.join(FILTER_IDS)})"
                    f"{did_you_mean(part.lower(), FILTER_IDS)}; write CODEC[:LEVEL][:FILTER], e.g. 'zstd:3'"
                )
        if codec == "none":
            if len(parts) > 1:
                raise ValueError(f"codec spec {text!r}: {_NONE_TAKES_NOTHING}")
            filt, level = "none", None
        elif level is None and codec == "zstd":
            level = 1
        try:
            return cls(codec=codec, level=level, filter=filt)
        except ValueError as exc:
            raise ValueError(f"codec spec {text!r}: {exc}") from exc

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | "CodecSpec" | str) -> "CodecSpec":
        """A spec from a dict (``{"codec": "zstd", "level": 3}``), a shorthand (``"zstd:3"``, see
        :meth:`parse`), or a spec."""
        if isinstance(data, CodecSpec):
            return data
        if isinstance(data, str):
            return cls.parse(data)
        keys = [f.name for f in fields(cls)]
        unknown = sorted(set(map(str, data)) - set(keys))
        if unknown:
            raise ValueError(
                f"unknown codec spec keys {unknown}{did_you_mean(unknown[0], keys)}; the keys are: {', '.join(keys)}"
            )
        if data.get("codec") == "none" and (data.get("level") is not None or data.get("filter", "none") != "none"):
            raise ValueError(f"codec spec {dict(data)!r}: {_NONE_TAKES_NOTHING}")
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_DEFAULT = CodecSpec()
#: Weights and second moments: byte planes of elements rotated so that a bf16 / fp32 exponent is
#: one whole plane (filters/rotate.py). Measured (benchmarks/README.md, "Peer coders"), it pays
#: where the sign is random or constant and the exponent's last bit is not (weights +0.8%,
#: second moments +0.2%); first moments and gradients lose 1-3% (their signs come in runs, which
#: the plain top plane codes, and the rotation moves them into the incompressible low plane).
_ROTATED = CodecSpec(filter="rotplane")
#: libzstd level of :meth:`CodecPolicy.max_ratio` (chosen in benchmarks/README.md, "Peer coders").
MAX_RATIO_LEVEL = 19
_RAW = CodecSpec(codec="none", level=None, filter="none")

#: The type each key of a spec written as a dict must have, and how to say it.
_SPEC_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "codec": ((str,), "a str (a codec id such as 'zstd')"),
    "level": ((int, type(None)), "an int or None"),
    "filter": ((str,), "a str ('byteplane', 'rotplane' or 'none')"),
    "chunk_bytes": ((int, type(None)), "an int (bytes) or None"),
    "adaptive": ((bool,), "a bool"),
}


def _is_int(value: Any) -> bool:
    # bool is an int to Python, but `true` in a JSON policy is a mistake, not 1.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _described(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _spec_field(name: str, value: Any) -> CodecSpec:
    """``value`` (a spec, a dict or a codec id) as a :class:`CodecSpec`; errors name the field."""
    if isinstance(value, Mapping):
        for key, (types, expected) in _SPEC_FIELD_TYPES.items():
            if key in value:
                v = value[key]
                ok = (v is None and type(None) in types) or (_is_int(v) if int in types else isinstance(v, types))
                if not ok:
                    raise ValueError(f"{name}: {key} must be {expected}, got {_described(v)}")
    elif not isinstance(value, (CodecSpec, str)):
        raise ValueError(
            f"{name}: expected a CodecSpec, a dict such as {{'codec': 'zstd', 'level': 3}} or a codec shorthand "
            f"such as 'zstd:3', got {_described(value)}"
        )
    try:
        return CodecSpec.from_dict(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc


def _glob_mapping(name: str, value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a dict of {{glob: {what}}}, got {_described(value)}")
    for key in value:
        if not isinstance(key, str):
            raise ValueError(f"{name}: keys are globs over tensor keys and must be str, got {_described(key)}")
    return dict(value)


@dataclass(frozen=True)
class CodecPolicy:
    """Codec settings for each component, user classification patterns and per-tensor overrides.

    The defaults (zstd level 1 over byte planes for every component, the planes of weights and
    second moments rotated, ``filter="rotplane"``) were measured on real checkpoints (see
    ``benchmarks/README.md``) and are portable: a file written with them loads on any machine,
    with or without a GPU, by a reader of format version 4 (files with rotated planes are version 4).

    Args:
        weights, exp_avg, exp_avg_sq, gradients, other: The :class:`CodecSpec` per component
            (a dict or a codec id are accepted too).
        patterns: ``{glob: component}``: tensors whose key (``"optimizer/state/0/exp_avg"``)
            matches the glob are classified as that component; first match wins.
        overrides: ``{glob: CodecSpec}``: tensors whose key matches get that spec outright.
        min_compress_bytes: Tensors smaller than this are stored raw (compressing them costs
            more than it saves).
        device: Where compression runs: ``"auto"`` (a CUDA tensor on its GPU with nvCOMP, a CPU
            tensor on the CPU), ``"cpu"`` or ``"cuda"``.
        choose_rotation: ``False`` (the default): every tensor keeps its spec's filter. ``True``: a
            bf16 or fp32 tensor of 1 MiB or more whose spec's filter is ``"byteplane"`` or
            ``"rotplane"``, compressed on the CPU, gets whichever of the two stores a 64 KiB sample
            of it smaller; the spec's filter wins ties and small gains (``planechoice.py``). The file
            is format version 4, as any file that may hold rotated planes. Tensors compressed on a
            GPU, smaller ones and those stored against a base keep the spec's filter. Measured
            (benchmarks/README.md, "Rotation per tensor"): first moments 0.02-0.17% smaller, but the
            bf16 gradients of one checkpoint in three 0.05% larger (a sample cannot see the repeats
            far apart that favour plain planes there), and saves take 3-4% more CPU: off by default.

    Raises:
        ValueError: a field has the wrong type or value; the message names the field (as
            ``overrides['head.*']: ...`` for an entry) and what it expects.
    """

    weights: CodecSpec = _ROTATED
    exp_avg: CodecSpec = _DEFAULT
    exp_avg_sq: CodecSpec = _ROTATED
    gradients: CodecSpec = _DEFAULT
    other: CodecSpec = _DEFAULT
    # Typed as __post_init__ leaves them; like the component fields, they accept the other forms too
    # (a component's name, a spec's dict or shorthand), converted there.
    patterns: Mapping[str, Component] = field(default_factory=dict)
    overrides: Mapping[str, CodecSpec] = field(default_factory=dict)
    min_compress_bytes: int = 2048
    device: str = "auto"
    choose_rotation: bool = False

    def __post_init__(self) -> None:
        # Every field is checked here, so a policy read from JSON fails when it is built, with
        # the field named, and never halfway through a save.
        for comp in Component:
            object.__setattr__(self, comp.value, _spec_field(comp.value, getattr(self, comp.value)))
        patterns = _glob_mapping("patterns", self.patterns, "component")
        components = ", ".join(c.value for c in Component)
        for k, v in patterns.items():
            if not isinstance(v, (Component, str)) or v not in tuple(c.value for c in Component):
                raise ValueError(f"patterns[{k!r}]: {v!r} is not a component; choose one of {components}")
        object.__setattr__(self, "patterns", {k: Component(v) for k, v in patterns.items()})
        overrides = _glob_mapping("overrides", self.overrides, "CodecSpec")
        object.__setattr__(self, "overrides", {k: _spec_field(f"overrides[{k!r}]", v) for k, v in overrides.items()})
        if not _is_int(self.min_compress_bytes):
            raise ValueError(f"min_compress_bytes must be an int (bytes), got {_described(self.min_compress_bytes)}")
        if self.min_compress_bytes < 0:
            raise ValueError(f"min_compress_bytes must be 0 or more, got {self.min_compress_bytes}")
        object.__setattr__(self, "min_compress_bytes", int(self.min_compress_bytes))
        if not isinstance(self.device, str):
            raise ValueError(f"device must be a str ('auto', 'cpu' or 'cuda[:N]'), got {_described(self.device)}")
        if self.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", self.device):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if not isinstance(self.choose_rotation, bool):
            raise ValueError(f"choose_rotation must be a bool, got {_described(self.choose_rotation)}")

    @classmethod
    def uniform(cls, spec: CodecSpec | Mapping[str, Any] | str, **kwargs: Any) -> "CodecPolicy":
        """The same spec for every component (a spec, its dict, or a shorthand such as ``"zstd:3"``)."""
        one = _spec_field("policy", spec)
        specs: dict[str, Any] = {c.value: one for c in Component}
        return cls(**specs, **kwargs)

    @classmethod
    def max_ratio(cls, level: int = MAX_RATIO_LEVEL, **kwargs: Any) -> "CodecPolicy":
        """The smallest files this library writes on the CPU, at a cost in save time.

        Every component is ``zstd`` over byte planes with ``adaptive=True`` at ``level``: each
        plane takes libzstd ``level`` where a sample says it saves 1% over level 1. On the
        checkpoints of ``benchmarks/bench_peers.py`` the files are 1.5-2% smaller than the
        default's (gradients 7%), and saves take 15-50x as long (loads are as fast); a lower
        ``level`` trades ratio for time (table in benchmarks/README.md, "Peer coders"). The
        default policy stays level 1, which saves faster than ``torch.save`` + ``zstd -1``.
        Files load anywhere, like the default's. ``choose_rotation`` stays off, as in the default
        (``max_ratio(choose_rotation=True)`` turns it on; the samples are then ranked at ``level``).
        """
        spec = CodecSpec(codec="zstd", level=level, filter="byteplane", adaptive=True)
        specs: dict[str, Any] = {c.value: spec for c in Component}
        for name in ("weights", "exp_avg_sq"):  # as the default: where the rotation pays
            specs[name] = replace(spec, filter=_ROTATED.filter)
        return cls(**specs, **kwargs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CodecPolicy":
        """A policy from its :meth:`to_dict` form (e.g. a JSON file given to ``nvckpt``); missing
        keys keep their defaults, component values may be shorthands (``{"weights": "zstd:3"}``).

        Raises:
            ValueError: a key is not a policy field, or a value is invalid (the field is named).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a policy dict must be a dict of CodecPolicy fields, got {_described(data)}")
        unknown = sorted(set(map(str, data)) - set(_POLICY_FIELDS))
        if unknown:
            raise ValueError(
                f"unknown policy key(s) {unknown}{did_you_mean(unknown[0], _POLICY_FIELDS)}; the fields are: {', '.join(_POLICY_FIELDS)}"
            )
        return cls(**dict(data))

    @classmethod
    def of(cls, policy: "CodecPolicy | Mapping[str, Any] | str | CodecSpec | None", where: str = "policy") -> "CodecPolicy":
        """The one conversion of every ``policy=`` argument (``save``, ``save_async``, the manager,
        the DCP writer, the integrations).

        Args:
            policy: ``None`` (the defaults), a :class:`CodecPolicy`, a dict of its fields
                (``{"weights": "zstd:3", "exp_avg": {"codec": "zstd", "level": 5}}``), or a codec
                shorthand or :class:`CodecSpec` for every component (``"zstd:3"``).
            where: Names the argument in errors (``"CheckpointManager(policy=...)"``).

        Raises:
            TypeError: ``policy`` is none of these forms (the message names ``where`` and the forms).
            ValueError: a value is invalid; the message names ``where``, the field and the accepted forms.
        """
        if policy is None:
            return cls()
        if isinstance(policy, CodecPolicy):
            return policy
        try:
            if isinstance(policy, (str, CodecSpec)):
                return cls.uniform(CodecSpec.from_dict(policy))
            if isinstance(policy, Mapping):
                return cls.from_dict(policy)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        raise TypeError(
            f"{where}: expected a CodecPolicy, a dict of its fields such as {{'weights': 'zstd:3'}}, or a codec "
            f"shorthand such as 'zstd:3' for every component, got {_described(policy)}"
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {c.value: getattr(self, c.value).to_dict() for c in Component}
        out["patterns"] = {k: v.value for k, v in self.patterns.items()}
        out["overrides"] = {k: v.to_dict() for k, v in self.overrides.items()}
        out["min_compress_bytes"] = self.min_compress_bytes
        out["device"] = self.device
        out["choose_rotation"] = self.choose_rotation
        return out

    def with_overrides(self, **changes: Any) -> "CodecPolicy":
        """A copy with some fields replaced (component specs may be dicts or codec ids)."""
        return replace(self, **changes)

    def component_of(self, key: str, path: Sequence[Any]) -> Component:
        """The component of the tensor at ``path`` (user patterns first, then :func:`classify`)."""
        for pattern, comp in self.patterns.items():
            if fnmatch.fnmatchcase(key, pattern):
                return comp
        return classify(path)

    def unmatched_overrides(self, keys: Sequence[str]) -> list[str]:
        """The :attr:`overrides` globs that match none of ``keys`` (a typo, or a model renamed)."""
        return [g for g in self.overrides if not any(fnmatch.fnmatchcase(k, g) for k in keys)]

    def spec_for(self, key: str, component: Component, nbytes: int) -> CodecSpec:
        """The spec used for one tensor."""
        for pattern, spec in self.overrides.items():
            if fnmatch.fnmatchcase(key, pattern):
                return spec
        if nbytes < self.min_compress_bytes:
            return _RAW
        return getattr(self, component.value)

    def rotation_to_choose(self, spec: CodecSpec, dtype: torch.dtype, nbytes: int) -> int:
        """Bits a tensor of ``dtype`` and ``nbytes`` stored with ``spec`` may be rotated by, the writer
        choosing rotated or plain planes from a sample of it (:attr:`choose_rotation`); 0: the
        spec's filter stands."""
        if not self.choose_rotation or spec.codec == "none" or spec.filter not in ("byteplane", "rotplane"):
            return 0
        return exponent_rotation(dtype) if nbytes >= ROTATION_CHOICE_MIN_BYTES else 0


_POLICY_FIELDS = tuple(f.name for f in fields(CodecPolicy))
_WARNED_GLOBS: set[str] = set()


def warn_unmatched_overrides(policy: CodecPolicy, keys: Sequence[str], where: str) -> None:
    """Warn (once per glob in a process) about override globs that matched no tensor of a save."""
    for glob in policy.unmatched_overrides(keys):
        if glob not in _WARNED_GLOBS:
            _WARNED_GLOBS.add(glob)
            shown = ", ".join(repr(k) for k in list(keys)[:3]) or "none: it holds no tensor"
            warnings.warn(
                f"{where}: the policy override {glob!r} matches no tensor key, so it changes nothing "
                f"(the keys of this save look like {shown}; `nvckpt inspect FILE` lists them all)",
                UserWarning,
                stacklevel=_caller_stacklevel(),
            )


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that names the first frame outside this package: the user's line that saved.

    A fixed level named writer.py (the depth differs between entry points); on a background
    thread, where no frame is the user's, the warning names the outermost frame.
    """
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    level, frame = 2, sys._getframe(2)  # 1: the function calling warnings.warn; 2: its caller
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level
