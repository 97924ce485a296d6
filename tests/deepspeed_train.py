"""A 2-rank DeepSpeed training run on the CPU (gloo) for tests/test_deepspeed.py and benchmarks/bench_deepspeed.py.

``python -m torch.distributed.run --nproc_per_node 2 tests/deepspeed_train.py MODE STAGE ROOT``:

* ``first``: train 3 steps; save tag ``t3`` with stock DeepSpeed (``ROOT/plain``), then attach and save
  it compressed (``ROOT/ours``); train 2 more steps (their losses: ``ROOT/ref.json``); then save ``t5``,
  during which a rank is killed with SIGKILL (stage 2: rank 1 in the middle of writing its file;
  stage 3: rank 0 when every rank's files are durable and the manifest is about to be written).
* ``matrix``: ZeRO 0 (fp32, bf16, and fp32 with a DeepSpeed MoE layer of 2 experts, one per rank), 1 and
  2 (bf16): save, resume in a new engine, next losses (``ROOT/matrix.json``).
* ``latest_outside`` (one rank): save a tag ``g4`` in ``ROOT/other_run``, then ``load_checkpoint(ROOT/run)``
  whose ``latest`` names it by ``../other_run/g4`` and by its absolute path (``ROOT/latest_outside.json``).
* ``resume``: fresh processes attach, ``load_checkpoint`` each folder (``latest``) and train 2 steps
  (losses: ``ROOT/resumed.json``); the engine resumed from ``ours`` saves incrementally (``ROOT/sync``:
  t5 full, t6 a delta, t7 full), then a tag t8 whose file fails on rank 1 (each rank's error:
  ``ROOT/failed-RANK.json``); the one from ``plain`` saves with the raw engine's every option
  (``attach(async_save=True, tiers=[...], incremental=True)``, ``ROOT/async``: t5 full, t6 a delta),
  copying to an S3 tier when ``NVCKPT_DS_S3`` names a moto endpoint, else to a local folder tier that
  keeps one step. The async folder is then moved away (a fresh node) and a fresh engine resumes from
  the tier's delta tag through its base. Each rank's ``on_saved`` calls: ``ROOT/on_saved-RANK.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import nvcomp_checkpoint as nc  # noqa: E402
from nvcomp_checkpoint.deepspeed import MANIFEST_NAME, attach  # noqa: E402
from nvcomp_checkpoint.storage import LocalStorage  # noqa: E402

VOCAB, HIDDEN, LAYERS, SEQ, BATCH = 128, 64, 2, 16, 2


class Block(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.attn, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn(self.ln1(x)).chunk(3, -1)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        a = torch.softmax((q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~mask, -1e9), -1) @ v
        x = x + self.proj(a)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """GPT-2's shape (token + position embeddings, pre-LN blocks, tied-free head), tiny."""

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN, layers: int = LAYERS, seq: int = SEQ) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


class TinyMoE(TinyGPT):
    """TinyGPT whose first block's MLP is a DeepSpeed MoE layer: 2 experts, one per rank (ep_size=2)."""

    def __init__(self) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))
        # No random token selection: the gate must not draw from the RNG, which a checkpoint does not hold.
        self.moe = MoE(hidden_size=HIDDEN, expert=mlp, num_experts=2, ep_size=2, k=1, use_rts=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        h = h + self.moe(h)[0]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def make_engine(stage: int, bf16: bool = False, moe: bool = False, **model_kwargs: int) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    model = TinyMoE() if moe else TinyGPT(**model_kwargs)
    params: object = model.parameters()
    if moe:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "all"})
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def train(engine: deepspeed.DeepSpeedEngine, steps: int, vocab: int = VOCAB, seq: int = SEQ) -> list[float]:
    losses = []
    for _ in range(steps):
        # The batch depends on rank and step only: a resumed run sees what the uninterrupted one saw.
        g = torch.Generator().manual_seed(1000 * engine.global_rank + engine.global_steps)
        x = torch.randint(0, vocab, (BATCH, seq), generator=g)
        loss = nn.functional.cross_entropy(engine(x)[:, :-1].reshape(-1, vocab), x[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def init() -> None:
    # The CPU accelerator JIT-builds a shared-memory allreduce (minutes of C++ on a cold cache); gloo
    # is what these runs exercise.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")


def kill_during_t5(stage: int, rank: int) -> None:
    """Arm the SIGKILL of the t5 save (see the module docstring)."""
    if stage == 2 and rank == 1:
        # The attached engine saves each file with save_with_options (it logs one line per tag, not per file).
        import dataclasses

        import nvcomp_checkpoint.entrypoint.deepspeed_engine as ds_backend

        real_save = ds_backend.save_with_options

        def save(obj, path, options):  # noqa: ANN001, ANN202
            if os.sep + "t5" + os.sep in os.fspath(path):

                def die(n: int, folder: str = os.path.dirname(os.fspath(path))) -> None:
                    # Killed mid-write once rank 0 has a durable t5 file, so the tag is partial
                    # (not empty) however the ranks are scheduled on a loaded machine.
                    deadline = time.monotonic() + 60
                    while time.monotonic() < deadline and not any(
                        name.startswith("mp_rank_") or "zero_pp_rank_0_" in name for name in os.listdir(folder)
                    ):
                        time.sleep(0.05)
                    os.kill(os.getpid(), signal.SIGKILL)

                options = dataclasses.replace(options, progress=die)
            return real_save(obj, path, options)

        ds_backend.save_with_options = save
    if stage == 3 and rank == 0:
        real_write = LocalStorage.write_bytes

        def write_bytes(self, path, data):  # noqa: ANN001, ANN202
            if os.path.basename(path) == "nvckpt_manifest.json" and os.sep + "t5" + os.sep in path:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_write(self, path, data)

        LocalStorage.write_bytes = write_bytes


def fail_t8_on_rank_1(rank: int) -> None:
    """Make rank 1's files of tag t8 fail to write (a full disk, say); rank 0's are written."""
    if rank != 1:
        return
    import nvcomp_checkpoint.entrypoint.deepspeed_engine as ds_backend

    real_save = ds_backend.save_with_options

    def save(obj, path, options):  # noqa: ANN001, ANN202
        if os.sep + "t8" + os.sep in os.fspath(path):
            raise OSError(28, "No space left on device", os.fspath(path))
        return real_save(obj, path, options)

    ds_backend.save_with_options = save


def main() -> None:
    mode, stage, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    init()
    rank = torch.distributed.get_rank()
    engine = make_engine(stage) if mode != "matrix" else None
    if mode == "first":
        train(engine, 3)
        # universal_checkpoint_info: what DeepSpeed's ds_to_universal requires of a checkpoint (Megatron writes it).
        client_state = {"universal_checkpoint_info": {}}
        engine.save_checkpoint(os.path.join(root, "plain"), tag="t3", client_state=client_state)
        attach(engine)
        engine.save_checkpoint(os.path.join(root, "ours"), tag="t3", client_state=client_state)
        engine.save_16bit_model(os.path.join(root, "export"))  # an export for other tools: stays torch.save
        ref = train(engine, 2)
        if rank == 0:
            with open(os.path.join(root, "ref.json"), "w") as f:
                json.dump(ref, f)
        torch.distributed.barrier()
        kill_during_t5(stage, rank)
        engine.save_checkpoint(os.path.join(root, "ours"), tag="t5")
        raise AssertionError("the t5 save should have been killed")
    if mode == "resume":
        resumed = {}
        s3 = os.environ.get("NVCKPT_DS_S3")  # a moto endpoint: the async engine's tags are copied to an S3 tier
        if s3:
            options = {"client_kwargs": {"endpoint_url": s3}, "key": "x", "secret": "y", "skip_instance_cache": True}
            tiers = [nc.Tier(f"s3://tiers/ds-zero{stage}", storage_options=options)]
        else:
            tiers = [nc.Tier(os.path.join(root, "tier"), keep=1)]  # retention must keep the delta's base
        saved: dict[str, list[dict[str, object]]] = {"sync": [], "async": []}

        def on_saved(kind: str):  # noqa: ANN202
            def record(report: nc.SaveReport) -> None:
                # Called once the tag is committed, on every rank: its manifest and `latest` are there.
                latest = os.path.join(os.path.dirname(report.path), "latest")
                saved[kind].append(
                    {
                        "path": report.path,
                        "manifest": os.path.exists(os.path.join(report.path, MANIFEST_NAME)),
                        "latest": open(latest).read() if os.path.exists(latest) else None,
                    }
                )

            return record

        last_reports = {}
        for name in ("ours", "plain"):
            if name == "plain":
                engine = make_engine(stage)
            # The engine resumed from the plain folder saves asynchronously: its tag t5 must hold what
            # the other engine's synchronous t5 holds (both trained from t3 on the same batches). The
            # synchronous one saves incrementally (t5 full, t6 a delta, t7 full: full_every=2).
            if name == "ours":
                ours = attach(engine, incremental=True, full_every=2, on_saved=on_saved("sync"))
            else:
                ours = attach(engine, async_save=True, tiers=tiers, incremental=True, on_saved=on_saved("async"))
            path, _ = engine.load_checkpoint(os.path.join(root, name))
            assert path is not None and os.path.basename(os.path.dirname(path)) == "t3", path
            assert engine.global_steps == 3, engine.global_steps
            resumed[name] = train(engine, 2)
            target = os.path.join(root, "sync" if name == "ours" else "async")
            engine.save_checkpoint(target, tag="t5")
            if name == "ours":
                resumed["before_t6"] = train(engine, 1)
                engine.save_checkpoint(target, tag="t6")
                resumed["after_t6"] = train(engine, 1)
                engine.save_checkpoint(target, tag="t7")
                fail_t8_on_rank_1(rank)
                try:
                    engine.save_checkpoint(target, tag="t8")
                    failed: object = None
                except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
                    failed = {"type": type(exc).__name__, "message": str(exc)}
                with open(os.path.join(root, f"failed-{rank}.json"), "w") as f:
                    json.dump(failed, f)
            if name == "plain":
                # Committed at an optimizer step once every rank's files are durable (or by wait()), not
                # before: `latest` waits for every rank's files.
                assert not os.path.exists(os.path.join(target, "latest"))
                resumed["after_async"] = train(engine, 1)
                ours.wait()
                with open(os.path.join(target, "latest")) as f:
                    assert f.read() == "t5"
                engine.save_checkpoint(target, tag="t6")
                ours.wait()  # the commit, then the copies to the tier
                with open(os.path.join(target, "latest")) as f:
                    assert f.read() == "t6"
                resumed["after_async_t6"] = train(engine, 1)
                engine.destroy()
            last_reports[name] = ours.last_report.path if ours.last_report is not None else None
        with open(os.path.join(root, f"on_saved-{rank}.json"), "w") as f:
            json.dump({"saved": saved, "last_report": last_reports}, f)
        # A fresh node: the async folder (tier 0) is gone; every rank loads the newest copy on the tier,
        # a delta tag (t6) whose base (t5) the tier holds too.
        torch.distributed.barrier()
        if rank == 0:
            os.rename(os.path.join(root, "async"), os.path.join(root, "async-gone"))
        torch.distributed.barrier()
        engine = make_engine(stage)
        found = attach(engine, tiers=tiers).resume_path(os.path.join(root, "restore"))
        assert found is not None
        engine.load_checkpoint(os.path.dirname(found), tag=os.path.basename(found))
        resumed["tier"] = {"path": found, "step": engine.global_steps, "losses": train(engine, 1)}
        torch.distributed.barrier()
        if rank == 0:
            os.rename(os.path.join(root, "async-gone"), os.path.join(root, "async"))
            with open(os.path.join(root, "resumed.json"), "w") as f:
                json.dump(resumed, f)
        torch.distributed.barrier()
        return
    if mode == "matrix":
        # Other ZeRO stages and bf16: save after 2 steps, resume in a new engine, same next losses.
        results = {}
        for stage, bf16, moe in ((0, False, False), (0, True, False), (1, True, False), (2, True, False), (0, False, True)):
            engine = make_engine(stage, bf16, moe)
            train(engine, 2)
            attach(engine)
            folder = os.path.join(root, f"zero{stage}{'-bf16' if bf16 else ''}{'-moe' if moe else ''}")
            engine.save_checkpoint(folder, tag="a")
            ref = train(engine, 2)
            resumed = make_engine(stage, bf16, moe)
            attach(resumed)
            resumed.load_checkpoint(folder)
            results[os.path.basename(folder)] = {
                "ref": ref,
                "resumed": train(resumed, 2),
                "files": sorted(os.listdir(os.path.join(folder, "a"))),
            }
        if rank == 0:
            with open(os.path.join(root, "matrix.json"), "w") as f:
                json.dump(results, f)
        torch.distributed.barrier()
        return
    if mode == "latest_outside":
        # `latest` naming a tag outside the folder it is in: another run's tag, by `..` and by an absolute path.
        assert engine is not None
        attach(engine)
        train(engine, 1)
        other = os.path.join(root, "other_run")
        engine.save_checkpoint(other, tag="g4")
        run = os.path.join(root, "run")
        os.makedirs(run, exist_ok=True)
        outcome = {}
        for name, pointer in (("dotdot", "../other_run/g4"), ("absolute", os.path.join(other, "g4"))):
            with open(os.path.join(run, "latest"), "w") as f:
                f.write(pointer)
            try:
                loaded, _ = engine.load_checkpoint(run)
                outcome[name] = f"loaded {loaded}"
            except Exception as exc:  # noqa: BLE001 - the test reads what happened
                outcome[name] = f"{type(exc).__name__}: {exc}"
        with open(os.path.join(root, "latest_outside.json"), "w") as f:
            json.dump(outcome, f)
        return
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
