"""DeepSpeed's own checkpoint tests, stock and with ``attach`` on every engine, side by side.

    python scripts/deepspeed_upstream_tests.py DEEPSPEED_CHECKOUT [--out DIR] [-k EXPR] [FILES...]

``DEEPSPEED_CHECKOUT`` is a DeepSpeed source tree (its ``tests/`` folder; the installed DeepSpeed
runs them). The script runs ``tests/unit/checkpoint`` (or the FILES given, relative to it) twice on
CPU ranks (``DS_ACCELERATOR=cpu``, gloo): once stock, once with a ``sitecustomize`` that makes every
``deepspeed.initialize`` return an engine with ``nvcomp_checkpoint.deepspeed.attach`` applied (so every
checkpoint the tests save is ours, and every load reads ours) and runs DeepSpeed's tools the tests call
directly (``zero_to_fp32``'s functions, ``ds_to_universal``) inside ``deepspeed_torch_load()``, as
``docs/deepspeed.md`` tells users to. It writes each run's JUnit XML and a
table of the tests whose outcome differs (``DIR/differences.md``); ``docs/deepspeed.md`` records the
last run and why each difference is expected. Takes hours for the whole folder on 2 cores; pass
FILES or ``-k`` for a part.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

#: Imported at start by every interpreter of the run (pytest, DeepSpeed's forkserver and its ranks).
SITECUSTOMIZE = """
import os

if os.environ.get("NVCKPT_UPSTREAM_MODE"):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    # The CPU accelerator JIT-builds a shared-memory allreduce otherwise (minutes of C++); gloo it is.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if os.environ["NVCKPT_UPSTREAM_MODE"] == "attach":
        from nvcomp_checkpoint.deepspeed import attach_once, is_deepspeed_engine

        _initialize = deepspeed.initialize

        def initialize(*args, **kwargs):
            out = _initialize(*args, **kwargs)
            if is_deepspeed_engine(out[0]):
                attach_once(out[0])
            return out

        initialize.__wrapped__ = _initialize
        deepspeed.initialize = initialize

        # DeepSpeed's tools, called directly by the tests, as docs/deepspeed.md tells users to call them
        # on our folders: inside deepspeed_torch_load(). (Patched before any test imports them by name.)
        import functools

        import deepspeed.checkpoint.ds_to_universal as universal
        import deepspeed.utils.zero_to_fp32 as zero_to_fp32
        from nvcomp_checkpoint.deepspeed import deepspeed_torch_load

        def hooked(fn):
            @functools.wraps(fn)
            def inner(*args, **kwargs):
                with deepspeed_torch_load():
                    return fn(*args, **kwargs)

            return inner

        universal.main = hooked(universal.main)
        for name in (
            "get_fp32_state_dict_from_zero_checkpoint",
            "convert_zero_checkpoint_to_fp32_state_dict",
            "load_state_dict_from_zero_checkpoint",
        ):
            setattr(zero_to_fp32, name, hooked(getattr(zero_to_fp32, name)))
"""


def outcomes(junit: Path) -> dict[str, str]:
    """``{test id: passed | failed | error | skipped}`` from a JUnit XML file."""
    found: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        state = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                state = {"failure": "failed"}.get(child.tag, child.tag)
        found[name] = state
    return found


def first_line(junit: Path, test: str) -> str:
    for case in ET.parse(junit).getroot().iter("testcase"):
        if f"{case.get('classname')}::{case.get('name')}" == test:
            for child in case:
                if child.tag in ("failure", "error"):
                    text = (child.get("message") or child.text or "").strip().splitlines()
                    return text[0][:200] if text else ""
    return ""


def run(mode: str, tests: Path, selection: list[str], keyword: str | None, out: Path, site: Path) -> Path:
    junit = out / f"{mode}.xml"
    env = dict(os.environ, NVCKPT_UPSTREAM_MODE=mode, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # DeepSpeed's CPU accelerator counts NUMA nodes as devices unless LOCAL_SIZE says otherwise, and its
    # tests skip a world larger than the device count: up to 4 CPU ranks.
    env.setdefault("LOCAL_SIZE", "4")
    src = Path(__file__).resolve().parents[1] / "src"
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(src), str(tests), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}", *selection]
    if keyword:
        argv += ["-k", keyword]
    with open(out / f"{mode}.log", "w") as log:
        subprocess.run(argv, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    return junit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path, help="a DeepSpeed source tree (holds tests/unit/checkpoint)")
    parser.add_argument("files", nargs="*", help="test files or ids under tests/unit/checkpoint (default: all)")
    parser.add_argument("--out", type=Path, default=Path("deepspeed-upstream"), help="where the logs and the table go")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    args = parser.parse_intermixed_args()
    tests = args.checkout.resolve() / "tests"
    if not (tests / "unit" / "checkpoint").is_dir():
        parser.error(f"{args.checkout}: no tests/unit/checkpoint in it; give a DeepSpeed source tree")
    selection = [f"unit/checkpoint/{f}" for f in args.files] or ["unit/checkpoint"]
    args.out = args.out.resolve()  # pytest runs in the checkout's tests/ folder
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nvckpt-upstream-") as site:
        Path(site, "sitecustomize.py").write_text(SITECUSTOMIZE)
        stock = run("stock", tests, selection, args.keyword, args.out, Path(site))
        ours = run("attach", tests, selection, args.keyword, args.out, Path(site))
    before, after = outcomes(stock), outcomes(ours)
    rows = ["| test | stock | attach | first line of the error (attach) |", "|---|---|---|---|"]
    differ = sorted(t for t in before.keys() | after.keys() if before.get(t) != after.get(t))
    for test in differ:
        rows.append(f"| `{test}` | {before.get(test, '-')} | {after.get(test, '-')} | {first_line(ours, test)} |")
    counts = {
        mode: {s: list(o.values()).count(s) for s in ("passed", "failed", "error", "skipped")}
        for mode, o in (("stock", before), ("attach", after))
    }
    summary = f"{len(before)} tests; stock {counts['stock']}; attach {counts['attach']}; {len(differ)} differ"
    (args.out / "differences.md").write_text(summary + "\n\n" + "\n".join(rows) + "\n")
    print(summary)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
