"""Light saves: only the tensors classified ``weights`` (a save that restores a model, not a run)."""

from __future__ import annotations

from typing import Any

from ..policy import Component, classify

__all__ = ["light_tree"]


def light_tree(state: Any) -> tuple[Any, list[str]]:
    """``state`` with only the tensors classified ``weights`` (and every plain value).

    A subtree that held tensors and keeps none (an optimizer, RNG states) is dropped whole, so
    that a light checkpoint never carries a half-empty optimizer state that would load silently.

    Returns:
        The light tree and the keys of the dropped subtrees.
    """
    import torch

    dropped: list[str] = []
    _GONE = object()

    def walk(obj: Any, path: tuple[Any, ...]) -> tuple[Any, bool, bool]:
        # -> (kept object or _GONE, had tensors, kept tensors)
        if isinstance(obj, torch.Tensor):
            keep = classify(path) == Component.WEIGHTS
            return (obj if keep else _GONE), True, keep
        if isinstance(obj, dict):
            out, had, kept = type(obj)() if type(obj) is not dict else {}, False, False
            for k, v in obj.items():
                nv, h, kp = walk(v, path + (k,))
                had, kept = had or h, kept or kp
                if nv is _GONE or (h and not kp):
                    dropped.append("/".join(str(p) for p in path + (k,)))
                    continue
                out[k] = nv
            return out, had, kept
        if isinstance(obj, (list, tuple)):
            items, had, kept = [], False, False
            for i, v in enumerate(obj):
                nv, h, kp = walk(v, path + (i,))
                had, kept = had or h, kept or kp
                items.append(None if nv is _GONE or (h and not kp) else nv)
            return (type(obj)(items) if type(obj) in (list, tuple) else items), had, kept
        return obj, False, False

    tree, _, _ = walk(state, ())
    outer = [d for d in dropped if not any(d.startswith(o + "/") for o in dropped)]
    return tree, outer
