"""Every ```python and ```bash snippet of README.md and docs/**/*.md runs, unmodified, in a temp dir.

The README and the docs site (its quickstarts and how-to pages) cannot drift from the code: each
snippet runs in a fresh process, as a user pastes it. An HTML comment on the line before a snippet
tells the harness what the snippet assumes:

- ``<!-- snippet: setup=NAME -->``: :data:`SETUPS` ``[NAME]`` runs first in the same process and
  defines the names the snippet uses but does not define (``model``, ``opt``, ``accelerator``
  ...), or prepares files; :data:`CHECKS` ``[NAME]`` then checks what the snippet did.
- ``<!-- snippet: needs=gpu (why) -->`` / ``needs=network (why)``: skipped where that is missing
  (a network always: tests do not reach one), with the text in parentheses as the reason.
- ``<!-- snippet: file=NAME -->`` on a python snippet: the page tells the user to save it as NAME
  and run it with the next bash snippet of the page; it is written to NAME in that snippet's
  folder, and runs there, through the command the page gives (a launcher such as ``torchrun``).

A snippet without a comment runs as it is. An unknown setup or option fails the test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

import fresh_process
import nvcomp_checkpoint as nc
from conftest import assert_tree_equal, start_moto_server

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```(python|bash)\s*$")
_MARK = re.compile(r"^<!--\s*snippet:\s*(.*?)\s*-->$")
_OPTION = re.compile(r"(\w+)=([\w.-]+)(?:\s+\(([^)]*)\))?")
#: Printed by the setups' epilogues, followed by a JSON object for the checks.
_RESULT = "README-SNIPPET-RESULT "


@dataclass(frozen=True)
class Snippet:
    doc: str
    line: int  # of the first line of code, 1-based
    lang: str
    code: str
    section: str
    options: dict[str, tuple[str, str]]  # name -> (value, reason)
    files: tuple[tuple[str, str], ...] = ()  # (name, code): the file= snippets a bash snippet runs

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")
        return f"{self.doc}:{self.line}-{slug}"


def extract(path: Path) -> list[Snippet]:
    """The python and bash snippets of one Markdown file, with the options of their comment.

    A ``file=NAME`` python snippet is not a test of its own: it goes with the next bash snippet.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    doc = str(path.relative_to(ROOT))
    out: list[Snippet] = []
    files: list[tuple[str, str]] = []
    section, i = "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        fence = _FENCE.match(line)
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARK.match(before.strip())
        options = {}
        if mark:
            for name, value, reason in _OPTION.findall(mark.group(1)):
                options[name] = (value, reason)
        code = "\n".join(lines[i + 1 : end]) + "\n"
        if fence.group(1) == "python" and "file" in options:
            files.append((options["file"][0], code))
        else:
            taken = tuple(files) if fence.group(1) == "bash" else ()
            files = files if fence.group(1) == "python" else []
            out.append(Snippet(doc, i + 2, fence.group(1), code, section, options, taken))
        i = end + 1
    assert not files, f"{doc}: a file= snippet ({files[0][0]}) with no bash snippet after it to run it"
    return out


SNIPPETS = [s for path in DOCS for s in extract(path)]


# -- what the snippets assume ----------------------------------------------------------------

# `nc` as the README's first Python snippet imports it; later snippets go on from there.
_TINY_MODEL = """
import torch
import nvcomp_checkpoint as nc
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(4, 32)).sum().backward()
opt.step()
state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
"""

# A LightningModule that logs "loss" and brings its data; README_CRASH_AT_STEP kills the process
# (as a preemption would) when training reaches that step.
_LIGHTNING_MODULE = """
import os
import torch
import lightning as L
from torch.utils.data import DataLoader, TensorDataset

class MyModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        if self.global_step == int(os.environ.get("README_CRASH_AT_STEP", -1)):
            os._exit(17)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)

torch.manual_seed(0)
model = MyModule()
"""

# A tiny GPT-2 from a config (no download); every forward pass is counted, and
# README_CRASH_AT_FORWARD kills the process at that forward pass.
_HF_MODEL = """
import os
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(0))
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}

class CountedGPT2(GPT2LMHeadModel):
    forwards = 0
    def forward(self, input_ids=None, labels=None, **kwargs):  # the Trainer keeps the columns forward names
        CountedGPT2.forwards += 1
        if CountedGPT2.forwards == int(os.environ.get("README_CRASH_AT_FORWARD", -1)):
            os._exit(17)
        return super().forward(input_ids=input_ids, labels=labels, **kwargs)

torch.manual_seed(0)
model = CountedGPT2(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32))
ds = Tokens()
args = TrainingArguments(output_dir="out", max_steps=4, save_steps=2, per_device_train_batch_size=8,
                         logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="steps")
"""

_CLI_FILES = """
import json, os
import torch
import safetensors.torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).to(torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(8, 128, dtype=torch.bfloat16)).float().sum().backward()
opt.step()
torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, "ckpt.pt")
os.makedirs("checkpoint-500")
safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, "checkpoint-500/model.safetensors")
torch.save(opt.state_dict(), "checkpoint-500/optimizer.pt")
with open("checkpoint-500/trainer_state.json", "w") as f:
    json.dump({"global_step": 500}, f)
"""

# `step` comes from README_STEP, and the weights are seeded with it: a run that resumes ends with
# the weights of the run before it, not with its own.
_TIERS = """
import os
import torch
import nvcomp_checkpoint as nc
step = int(os.environ.get("README_STEP", "100"))
torch.manual_seed(step)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(4, 32)).sum().backward()
opt.step()
"""

# What a run of the Storage tiers snippet leaves after steps 100, 200 and 300: the newest two on
# nvme/run1, all three on fsx/run1, and 200 (a multiple of every_steps) and 300 (the newest, copied at
# close) on S3 (the endpoint comes from AWS_ENDPOINT_URL).
_TIERS_CLI = (
    _TINY_MODEL
    + """
tiers = [nc.Tier("nvme/run1", keep=2, name="local"), nc.Tier("fsx/run1", name="shared"),
         nc.Tier("s3://bucket/run1", every_steps=200, name="object")]
with nc.CheckpointManager(tiers) as mgr:
    for step in (100, 200, 300):
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict()})
        mgr.wait()
assert [mgr.steps(i) for i in range(3)] == [[200, 300], [100, 200, 300], [200, 300]], [mgr.steps(i) for i in range(3)]
"""
)

_TIERS_LOOP = (
    _TIERS
    + """
steps = 1001

def train_step(step):
    opt.zero_grad()
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
"""
)

# A run directory, the state of the run (``state.pt``: what step-1040 saved) and a training step
# that changes the model and optimizer in place.
_INCREMENTAL = (
    _TINY_MODEL
    + """
import os
os.makedirs("run", exist_ok=True)
torch.save(state, "state.pt")

def train_step():
    opt.zero_grad()
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
"""
)

_TIERS_DCP = (
    _TINY_MODEL
    + """
mgr = nc.CheckpointManager([nc.Tier("nvme/run1", keep=2, name="local"), nc.Tier("fsx/run1", name="shared")])
step, rank = 100, 0
"""
)

#: Python run before a snippet (python: in its process; bash: as a script of its own, first).
SETUPS: dict[str, str] = {
    "model": _TINY_MODEL,
    "lightning_resume": _LIGHTNING_MODULE,
    "lightning_async": _LIGHTNING_MODULE,
    "lightning_tiers": _LIGHTNING_MODULE,
    "accelerate": _TINY_MODEL
    + """
import torch
from accelerate import Accelerator
accelerator = Accelerator(cpu=True)
optimizer = opt
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
""",
    "hf_trainer_resume": _HF_MODEL,
    "cli_files": _CLI_FILES,
    "tiers": _TIERS,
    "tiers_cli": _TIERS_CLI,
    "tiers_loop": _TIERS_LOOP,
    "tiers_dcp": _TIERS_DCP,
    "incremental": _INCREMENTAL,
    # One process, its own process group (a HashStore: no port to pick); gloo, no JIT-built allreduce.
    "deepspeed": """
import os
os.environ["DS_ACCELERATOR"] = "cpu"
import torch, torch.distributed as dist
import deepspeed, deepspeed.ops
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
optimizer = torch.optim.AdamW(model.parameters())
ds_config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
""",
    # The page's own command line (torchrun, DS_ACCELERATOR=cpu) runs train.py: nothing to prepare.
    "deepspeed_cpu": "",
}

#: Python run after a python snippet, in its process: prints what the checks look at.
EPILOGUES: dict[str, str] = {
    "lightning_resume": f"""
import json, torch
torch.save(trainer.lightning_module.state_dict(), "final.pt")
print({_RESULT!r} + json.dumps({{"ckpt_path": trainer.ckpt_path, "global_step": trainer.global_step,
                                 "loaded": type(model).__name__, "best": checkpoints.best_model_path}}))
""",
    "lightning_tiers": f"""
import json, os, torch
torch.save(trainer.lightning_module.state_dict(), f"final-{{os.environ['README_RUN']}}.pt")
print({_RESULT!r} + json.dumps({{"ckpt_path": trainer.ckpt_path, "global_step": trainer.global_step}}))
""",
    "hf_trainer_resume": f"""
import json
print({_RESULT!r} + json.dumps({{"global_step": trainer.state.global_step, "forwards": CountedGPT2.forwards}}))
""",
    "tiers": f"""
import json, torch
torch.save({{"model": model.state_dict(), "optimizer": opt.state_dict()}}, f"state-{{step}}.pt")
print({_RESULT!r} + json.dumps({{
    "restored": None if r is None else {{"step": r.step, "tier": r.tier_name, "light": r.light}},
    "steps": {{name: mgr.steps(i) for i, name in enumerate(mgr.names)}},
}}))
""",
    # The unit restored again from the shared tier alone, into a model whose weights were zeroed.
    "tiers_dcp": f"""
import json, shutil, torch
mgr.close()
shutil.rmtree("nvme/run1")
expected = {{k: v.clone() for k, v in model.state_dict().items()}}
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
again = mgr.restore(loader=load_dcp)
print({_RESULT!r} + json.dumps({{
    "restored": [again.step, again.tier_name, again.light],
    "equal": all(torch.equal(again.state["model"][k], expected[k]) for k in expected),
    "files": [f.path for f in mgr.manifest(step, 1).files],
}}))
""",
}
EPILOGUES["tiers_loop"] = EPILOGUES["tiers"]
EPILOGUES["incremental"] = f"""
import json
torch.save(state, "loaded.pt")
torch.save({{"model": model.state_dict(), "optimizer": opt.state_dict()}}, "live.pt")
torch.save(nc.load("run/step-1040.nvc"), "loaded-1040.pt")
def _base(p):
    with nc.open(p) as r:
        b = r.index.base
        return None if b is None else [b.path, b.depth]
print({_RESULT!r} + json.dumps({{p: _base(f"run/{{p}}") for p in ("step-1000.nvc", "step-1040.nvc", "step-1080.nvc")}}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, MPLBACKEND="Agg", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **extra)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # nvckpt
    return env


def run_snippet(s: Snippet, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run one snippet in ``cwd`` in a fresh process, after its setup; the snippet text is not changed.

    Python runs in a process forked from a server that has only imported the libraries
    (tests/fresh_process.py): fresh as a user's ``python``, without paying for the imports again.
    A bash snippet runs in bash, its commands (``nvckpt``) as they are.
    """
    setup = s.options.get("setup", ("", ""))[0]
    if s.lang == "python":
        # Padded so that a traceback names the snippet's line in the Markdown file.
        script = (
            SETUPS.get(setup, "")
            + f"\n__snippet__ = {s.code!r}\n"
            + f"exec(compile('\\n' * {s.line - 1} + __snippet__, {s.doc!r}, 'exec'))\n"
            + EPILOGUES.get(setup, "")
        )
        return fresh_process.run(["-c", script], cwd=cwd, env=_env(**env), timeout=600)
    if SETUPS.get(setup):
        prep = fresh_process.run(["-c", SETUPS[setup]], cwd=cwd, env=_env(**env), timeout=300)
        assert prep.returncode == 0, prep.stderr
    for name, code in s.files:
        (cwd / name).write_text(code)
    (cwd / "snippet.sh").write_text(s.code)
    cmd = ["bash", "-e", "-o", "pipefail", "snippet.sh"]
    return subprocess.run(cmd, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=600)


def _ok(proc: subprocess.CompletedProcess[str], s: Snippet) -> str:
    assert proc.returncode == 0, f"{s.id} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def _result(stdout: str) -> dict:
    line = next(ln for ln in stdout.splitlines() if ln.startswith(_RESULT))
    return json.loads(line[len(_RESULT) :])


@contextmanager
def s3_endpoint(bucket: str = "bucket") -> Iterator[tuple[dict[str, str], Any]]:
    """moto's standalone S3 server in its own process, with ``bucket``.

    Yields the environment a user's shell would have for an S3-compatible store (dummy
    credentials, ``AWS_ENDPOINT_URL``: s3fs and ``nvckpt`` read it through botocore) and a
    boto3 client to look at what the snippet stored.
    """
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    dummies = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with tempfile.TemporaryDirectory() as logs:  # not in the snippet's folder, which checks look at
        proc, port = start_moto_server(_env(**dummies), Path(logs) / "moto_server.log")
        endpoint = f"http://127.0.0.1:{port}"
        env = {**dummies, "AWS_ENDPOINT_URL": endpoint}
        try:
            client = boto3.client(
                "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing"
            )
            client.create_bucket(Bucket=bucket)
            yield env, client
        finally:
            proc.kill()
            proc.wait()


def _keys(client: Any, bucket: str, prefix: str) -> list[str]:
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def _unit_keys(prefix: str, steps: list[int]) -> list[str]:
    return sorted(f"{prefix}step-{s:010d}{ext}" for s in steps for ext in (".nvc", ".manifest.json"))


# -- what each snippet must have done ---------------------------------------------------------


def check_model(s: Snippet, tmp_path: Path) -> None:
    _ok(run_snippet(s, tmp_path), s)
    assert list(tmp_path.rglob("*.nvc")), "the snippet saved nothing"


def check_lightning_resume(s: Snippet, tmp_path: Path) -> None:
    # A run killed mid-training, then the same snippet again: it must resume from last.ckpt and
    # end with the weights of a run that was never interrupted.
    crashed, fresh = tmp_path / "crashed", tmp_path / "uninterrupted"
    crashed.mkdir(), fresh.mkdir()
    first = run_snippet(s, crashed, README_CRASH_AT_STEP="6")
    assert first.returncode == 17, first.stderr[-3000:]
    assert (crashed / "ckpt" / "last.ckpt").exists(), "ModelCheckpoint wrote no last.ckpt: ckpt_path='last' cannot resume"
    resumed = _result(_ok(run_snippet(s, crashed), s))
    assert resumed["ckpt_path"] and Path(resumed["ckpt_path"]).name == "last.ckpt", resumed
    assert resumed["loaded"] == "MyModule" and resumed["best"]
    assert nc.is_nvcomp_checkpoint(crashed / "ckpt" / "last.ckpt")
    whole = _result(_ok(run_snippet(s, fresh), s))
    assert whole["ckpt_path"] is None and whole["global_step"] == resumed["global_step"] == 12
    a, b = torch.load(crashed / "final.pt"), torch.load(fresh / "final.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def check_lightning_async(s: Snippet, tmp_path: Path) -> None:
    out = _ok(run_snippet(s, tmp_path), s)
    assert "durable:" in out
    logged = [p.read_text() for p in tmp_path.glob("logs/**/metrics.csv")]
    assert any("nvckpt/ratio" in text for text in logged), logged


def check_lightning_tiers(s: Snippet, tmp_path: Path) -> None:
    # A first run copies its first checkpoint (step 4: the first one is due at once, the next only
    # after 30 / 60 minutes) to the folder and to S3, and at its end the newest (step 12: the end of a
    # run has no next due save); the node is then lost, and the same snippet on a fresh node resumes
    # from the shared copy of step 12 and ends with the weights of the first run.
    from nvcomp_checkpoint.tiers import open_tier

    with s3_endpoint() as (env, client):
        first = _result(_ok(run_snippet(s, tmp_path, README_RUN="1", **env), s))
        assert first == {"ckpt_path": None, "global_step": 12}, first
        assert len(list((tmp_path / "nvme" / "ckpt").glob("*.ckpt"))) == 2  # ModelCheckpoint's top-k
        assert open_tier(str(tmp_path / "fsx" / "run1")).steps() == [4, 12]
        assert _keys(client, "bucket", "") == _unit_keys("run1/", [4, 12])
        shutil.rmtree(tmp_path / "nvme")
        second = _result(_ok(run_snippet(s, tmp_path, README_RUN="2", **env), s))
        assert second == {"ckpt_path": "fsx/run1/step-0000000012.nvc", "global_step": 12}, second
        assert open_tier(str(tmp_path / "fsx" / "run1")).steps() == [4, 12]
        assert _keys(client, "bucket", "") == _unit_keys("run1/", [4, 12])
    a, b = torch.load(tmp_path / "final-1.pt"), torch.load(tmp_path / "final-2.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def check_accelerate(s: Snippet, tmp_path: Path) -> None:
    out = _ok(run_snippet(s, tmp_path), s)
    assert (tmp_path / "ckpt" / "model.nvc").exists() and (tmp_path / "ckpt" / "optimizer.nvc").exists()
    assert "total (file)" in out  # hooks.last_report.table()


def check_hf_trainer_resume(s: Snippet, tmp_path: Path) -> None:
    # The snippet as a user first runs it: no output_dir, no checkpoint (transformers' own
    # resume_from_checkpoint=True raises "No valid checkpoint found" there); killed at the third
    # step, after checkpoint-2 was written. Then the same snippet again resumes from checkpoint-2.
    first = run_snippet(s, tmp_path, README_CRASH_AT_FORWARD="3")
    assert first.returncode == 17, first.stderr[-3000:]
    assert (tmp_path / "out" / "checkpoint-2").is_dir()
    result = _result(_ok(run_snippet(s, tmp_path), s))
    # Resumed at step 2: only steps 3 and 4 ran in this process.
    assert result == {"global_step": 4, "forwards": 2}, result
    assert nc.is_nvcomp_checkpoint(tmp_path / "out" / "checkpoint-4" / "optimizer.pt.nvc")


def check_cli_files(s: Snippet, tmp_path: Path) -> None:
    _ok(run_snippet(s, tmp_path), s)
    for made in ("ckpt.nvc", "checkpoint-500.nvc", "restored.pt", "bench.png"):
        assert (tmp_path / made).exists(), made
    a, b = torch.load(tmp_path / "ckpt.pt"), torch.load(tmp_path / "restored.pt")
    assert all(torch.equal(x, y) for x, y in zip(a["model"].values(), b["model"].values()))


def check_tiers(s: Snippet, tmp_path: Path) -> None:
    # A fresh start, then the node lost (tier 0 gone: resume from the shared copy), then a fresh
    # node elsewhere (only the object store left): each run resumes the previous run's state.
    with s3_endpoint() as (env, client):
        first = _result(_ok(run_snippet(s, tmp_path, **env), s))
        assert first == {"restored": None, "steps": {"local": [100], "shared": [100], "object": [100]}}, first
        shutil.rmtree(tmp_path / "nvme")
        second = _result(_ok(run_snippet(s, tmp_path, README_STEP="200", **env), s))
        assert second["restored"] == {"step": 100, "tier": "shared", "light": False}, second
        assert second["steps"] == {"local": [200], "shared": [100, 200], "object": [100, 200]}, second
        shutil.rmtree(tmp_path / "nvme")
        shutil.rmtree(tmp_path / "fsx")
        third = _result(_ok(run_snippet(s, tmp_path, README_STEP="300", **env), s))
        assert third["restored"] == {"step": 200, "tier": "object", "light": False}, third
        assert third["steps"] == {"local": [300], "shared": [300], "object": [100, 200, 300]}, third
        assert _keys(client, "bucket", "") == _unit_keys("run1/", [100, 200, 300])
    # Seeded by step, the runs would differ; resumed, each ends with the state the first one saved.
    saved = torch.load(tmp_path / "state-100.pt")
    assert_tree_equal(torch.load(tmp_path / "state-200.pt"), saved)
    assert_tree_equal(torch.load(tmp_path / "state-300.pt"), saved)


def check_tiers_loop(s: Snippet, tmp_path: Path) -> None:
    # Saves at steps 0, 500 and 1000: the first full (full_every=5) and kept on tier 0 as the
    # newest full step; only the first is due on the other tiers within their minutes, and close()
    # copies the newest (1000, light) to them.
    with s3_endpoint() as (env, client):
        first = _result(_ok(run_snippet(s, tmp_path, **env), s))
        assert first == {"restored": None, "steps": {"local": [0, 500, 1000], "shared": [0, 1000], "object": [0, 1000]}}, first
        # The node lost: the newest full step is 0, on "shared" (1000 is light, abandoned: the save of 500
        # removes it); the resumed run saves 500 (full) and 1000, which close() copies again.
        shutil.rmtree(tmp_path / "nvme")
        second = _result(_ok(run_snippet(s, tmp_path, **env), s))
        assert second["restored"] == {"step": 0, "tier": "shared", "light": False}, second
        assert second["steps"] == {"local": [500, 1000], "shared": [0, 500, 1000], "object": [0, 500, 1000]}, second
        assert _keys(client, "bucket", "") == _unit_keys("run1/", [0, 500, 1000])


def check_tiers_dcp(s: Snippet, tmp_path: Path) -> None:
    result = _result(_ok(run_snippet(s, tmp_path), s))
    assert result["restored"] == [100, "shared", False] and result["equal"], result
    assert ".metadata" in result["files"] and len(result["files"]) > 1, result


def check_tiers_cli(s: Snippet, tmp_path: Path) -> None:
    with s3_endpoint() as (env, client):
        out = _ok(run_snippet(s, tmp_path, **env), s)
        # sync copied step 100, the one S3 lacked; every listed step verified.
        assert _keys(client, "bucket", "") == _unit_keys("run1/", [100, 200, 300])
    assert "nvme/run1: 2 step(s)" in out and "s3://bucket/run1: 2 step(s)" in out, out
    assert "NO:" not in out, out
    assert "storage per tier" in out and all(name in out for name in ("local", "shared", "object")), out


def check_incremental(s: Snippet, tmp_path: Path) -> None:
    result = _result(_ok(run_snippet(s, tmp_path), s))
    # A full file, then a chain of two deltas, each recording its base relative to itself.
    assert result == {"step-1000.nvc": None, "step-1040.nvc": ["step-1000.nvc", 1], "step-1080.nvc": ["step-1040.nvc", 2]}, result
    # Step 1080 is the state after training went on; step 1040, read through the deepcopy kept as
    # base_state, is still what was saved then (a kept state_dict() alone would have moved on).
    assert_tree_equal(torch.load(tmp_path / "loaded.pt"), torch.load(tmp_path / "live.pt"))
    assert_tree_equal(torch.load(tmp_path / "loaded-1040.pt"), torch.load(tmp_path / "state.pt"))
    assert not torch.equal(
        torch.load(tmp_path / "live.pt")["model"]["0.weight"], torch.load(tmp_path / "state.pt")["model"]["0.weight"]
    )


def check_deepspeed(s: Snippet, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'nvcomp-checkpoint[deepspeed]')")
    _ok(run_snippet(s, tmp_path), s)
    assert (tmp_path / "ckpt" / "latest").read_text() == "step1000"
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        assert nc.is_nvcomp_checkpoint(tmp_path / "ckpt" / "step1000" / name)


def check_deepspeed_cpu(s: Snippet, tmp_path: Path) -> None:
    # The quickstart's train.py under the page's torchrun line, as a user runs it: a real launcher
    # and a real interpreter (the first run on a machine JIT-builds DeepSpeed's CPU allreduce).
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'nvcomp-checkpoint[deepspeed]')")
    out = _ok(run_snippet(s, tmp_path), s)
    assert (tmp_path / "ckpt" / "latest").read_text() == "step1"
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        assert nc.is_nvcomp_checkpoint(tmp_path / "ckpt" / "step1" / name)
    assert "step1" in out, out  # nvckpt inspect ckpt


def check_bare(s: Snippet, tmp_path: Path) -> None:
    _ok(run_snippet(s, tmp_path), s)


CHECKS: dict[str, Callable[[Snippet, Path], None]] = {
    "model": check_model,
    "lightning_resume": check_lightning_resume,
    "lightning_async": check_lightning_async,
    "lightning_tiers": check_lightning_tiers,
    "accelerate": check_accelerate,
    "hf_trainer_resume": check_hf_trainer_resume,
    "cli_files": check_cli_files,
    "tiers": check_tiers,
    "tiers_cli": check_tiers_cli,
    "tiers_loop": check_tiers_loop,
    "tiers_dcp": check_tiers_dcp,
    "incremental": check_incremental,
    "deepspeed": check_deepspeed,
    "deepspeed_cpu": check_deepspeed_cpu,
}


# -- the tests ---------------------------------------------------------------------------------


def test_the_readme_and_each_quickstart_have_snippets_and_every_comment_is_understood() -> None:
    readme = [s for s in SNIPPETS if s.doc == "README.md"]
    assert {s.lang for s in readme} == {"python", "bash"}
    quickstarts = sorted((ROOT / "docs" / "quickstart").glob("*.md"))
    assert len(quickstarts) >= 6
    for page in quickstarts:
        assert any(s.doc == str(page.relative_to(ROOT)) for s in SNIPPETS), f"{page}: a quickstart without a tested snippet"
    for s in SNIPPETS:
        assert set(s.options) <= {"setup", "needs", "file"}, (s.id, s.options)
        if "setup" in s.options:
            assert s.options["setup"][0] in SETUPS, (s.id, s.options)
        if "needs" in s.options:
            value, reason = s.options["needs"]
            assert value in ("gpu", "network") and reason, (s.id, "needs=gpu|network (reason)")
    assert set(SETUPS) == {s.options["setup"][0] for s in SNIPPETS if "setup" in s.options}, "a setup no snippet uses"


def test_the_readmes_links_name_files_and_headings_that_exist() -> None:
    # mkdocs build --strict checks the links of docs/ (scripts/test.sh); the README is outside it.
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    headings = {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        if path:
            assert (ROOT / path).exists(), f"README.md links to {link}: no such file"
        else:
            assert anchor in headings, f"README.md links to {link}: no such heading"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_snippet_runs(snippet: Snippet, tmp_path: Path) -> None:
    needs, reason = snippet.options.get("needs", ("", ""))
    if needs == "network":
        pytest.skip(f"needs a network: {reason}")
    if needs == "gpu" and not (torch.cuda.is_available() and nc.gpu_available()):
        pytest.skip(f"needs a CUDA GPU with nvCOMP: {reason}")
    CHECKS.get(snippet.options.get("setup", ("", ""))[0], check_bare)(snippet, tmp_path)
