"""DeepSpeed's own checkpoint tests, stock and with ``attach`` on every engine, side by side.

    python scripts/deepspeed_upstream_tests.py DEEPSPEED_CHECKOUT [--out DIR] [-k EXPR] [--timeout S]
        [--deepspeed-from-checkout] [--cache DIR] [FILES...]

``DEEPSPEED_CHECKOUT`` is a DeepSpeed source tree (its ``tests/`` folder; the installed DeepSpeed
runs them, or with ``--deepspeed-from-checkout`` the checkout's own DeepSpeed: see below). The script runs ``tests/unit/checkpoint`` (or the FILES given, relative to it) twice on
CPU ranks (``DS_ACCELERATOR=cpu``, gloo): once stock, once with a ``sitecustomize`` that makes every
``deepspeed.initialize`` return an engine with ``nvcomp_checkpoint.deepspeed.attach`` applied (so every
checkpoint the tests save is ours, and every load reads ours) and runs DeepSpeed's tools the tests call
directly (``zero_to_fp32``'s functions, ``ds_to_universal``) inside ``deepspeed_torch_load()``, as
``docs/deepspeed.md`` tells users to. It writes each run's JUnit XML and a
table of the tests whose outcome differs (``DIR/differences.md``); ``docs/deepspeed.md`` records the
last run and why each difference is expected. Takes hours for the whole folder on 2 cores; pass
FILES or ``-k`` for a part.

The suite runs under the pytest its checkout asks for (``requirements/requirements-dev.txt``; DeepSpeed
pins ``pytest<8.4``): its ``DistributedFixture`` marks a class as a fixture with a
``_pytestfixturefunction`` attribute, which pytest 8.4 and later no longer read (they take only
``FixtureFunctionDefinition`` objects), so every test that uses one stops at setup with "fixture
'...' not found". When the installed pytest does not fit the pin, the script installs the newest one
that does with ``pip install --no-deps --target`` into ``--cache`` (once; default under the temporary
folder) and puts that folder first on the runs' ``PYTHONPATH``; the installed DeepSpeed, torch and this
package stay as they are.

A checkout's tests follow its own DeepSpeed: ``tests/unit/checkpoint/common.py`` compares engine
attributes a later release drops (``sparse_tensor_module_names``, gone in 0.19.8), so with another
release installed every ``checkpoint_correctness_verification`` fails stock and attached alike, before it
compares a weight. ``--deepspeed-from-checkout`` installs the checkout's DeepSpeed (``DS_BUILD_OPS=0``,
``--no-deps``, into ``--cache``) and runs both modes on it, with ``TORCH_EXTENSIONS_DIR`` in ``--cache``
so that its JIT-built ops (the CPU Adam, minutes on 2 cores, once) do not replace the installed
DeepSpeed's in the shared torch extensions cache.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
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


def pytest_pin(checkout: Path) -> str | None:
    """The ``pytest`` requirement of the checkout's test suite (``"pytest>=7.2.0,<8.4.0"``), if it names one."""
    from packaging.requirements import InvalidRequirement, Requirement

    dev = checkout / "requirements" / "requirements-dev.txt"
    if not dev.is_file():
        return None
    for line in dev.read_text().splitlines():
        try:
            requirement = Requirement(line.split("#")[0].strip())
        except InvalidRequirement:
            continue
        if requirement.name == "pytest":
            return str(requirement)
    return None


def pytest_path(checkout: Path, where: Path) -> Path | None:
    """A folder to put first on ``PYTHONPATH`` so that the runs get the pytest the checkout pins; None if ours fits."""
    from importlib.metadata import version

    from packaging.requirements import Requirement

    pin = pytest_pin(checkout)
    if pin is None:
        print(
            f"{checkout}: no requirements/requirements-dev.txt naming pytest; the runs use pytest {version('pytest')}", flush=True
        )
        return None
    if Requirement(pin).specifier.contains(version("pytest"), prereleases=True):
        return None
    spelled = str(Requirement(pin).specifier).translate(
        {ord("<"): "lt", ord(">"): "gt", ord("="): "eq", ord("!"): "ne", ord(","): "_"}
    )
    target = where / f"pytest_{spelled}"  # one folder per pin
    if not (target / "pytest").is_dir():
        print(f"installing {pin} into {target} (this interpreter has pytest {version('pytest')})", flush=True)
        # --no-deps: pluggy, iniconfig and packaging come from this environment, as they do for its own pytest.
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "-q",
                "--no-deps",
                "--target",
                str(target),
                pin,
            ],
            check=True,
        )
    found = subprocess.run(
        [sys.executable, "-c", "import pytest; print(pytest.__version__)"],
        env=dict(os.environ, PYTHONPATH=str(target)),
        capture_output=True,
        text=True,
        check=False,
    )
    if found.returncode or not Requirement(pin).specifier.contains(found.stdout.strip(), prereleases=True):
        raise SystemExit(
            f"{target}: no pytest fitting {pin!r} imports from it ({found.stdout.strip() or found.stderr.strip()}); remove the folder and run again"
        )
    return target


def checkout_deepspeed(checkout: Path, cache: Path) -> Path:
    """The checkout's DeepSpeed installed (pure Python, no ops built) into a folder of ``cache``; that folder."""
    version = (checkout / "version.txt").read_text().strip() if (checkout / "version.txt").is_file() else "unknown"
    where = hashlib.sha256(str(checkout).encode()).hexdigest()[:8]
    target = cache / f"deepspeed_{version}_{where}"  # one folder per checkout; remove it after changing the checkout
    if not (target / "deepspeed" / "__init__.py").is_file():
        if not (checkout / "setup.py").is_file() or not (checkout / "deepspeed").is_dir():
            raise SystemExit(
                f"{checkout}: no setup.py and deepspeed/ in it; --deepspeed-from-checkout needs the whole source tree"
            )
        print(f"installing the DeepSpeed of {checkout} ({version}) into {target}", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps", "--no-build-isolation"]
            + ["--target", str(target), str(checkout)],
            env=dict(os.environ, DS_BUILD_OPS="0", DS_ACCELERATOR="cpu"),
            check=True,
        )
    return target


def run(
    mode: str,
    tests: Path,
    selection: list[str],
    keyword: str | None,
    out: Path,
    site: Path,
    first: list[Path],
    extra_env: dict[str, str],
    timeout: float | None,
) -> Path:
    junit = out / f"{mode}.xml"
    junit.unlink(missing_ok=True)
    env = dict(os.environ, NVCKPT_UPSTREAM_MODE=mode, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.update(extra_env)
    # DeepSpeed's CPU accelerator counts NUMA nodes as devices unless LOCAL_SIZE says otherwise, and its
    # tests skip a world larger than the device count: up to 4 CPU ranks.
    env.setdefault("LOCAL_SIZE", "4")
    src = Path(__file__).resolve().parents[1] / "src"
    env["PYTHONPATH"] = os.pathsep.join([*map(str, first), str(site), str(src), str(tests), env.get("PYTHONPATH", "")])
    # --basetemp: each run's tmpdirs in DIR, not among the numbered folders other pytest runs share and prune.
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        f"--junitxml={junit}",
        f"--basetemp={out / (mode + '-tmp')}",
    ]
    argv += selection
    if keyword:
        argv += ["-k", keyword]
    with open(out / f"{mode}.log", "w") as log:
        # A session of its own, so that a run past --timeout ends with its ranks and DeepSpeed's forkserver.
        process = subprocess.Popen(argv, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise SystemExit(
                f"the {mode} run passed --timeout {timeout:g} s and was stopped; its output is in {out / f'{mode}.log'}"
            ) from None
    if not junit.is_file():
        raise SystemExit(
            f"the {mode} run wrote no {junit.name} (pytest exit {process.returncode}); its output is in {out / f'{mode}.log'}"
        )
    return junit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path, help="a DeepSpeed source tree (holds tests/unit/checkpoint)")
    parser.add_argument("files", nargs="*", help="test files or ids under tests/unit/checkpoint (default: all)")
    parser.add_argument("--out", type=Path, default=Path("deepspeed-upstream"), help="where the logs and the table go")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path(tempfile.gettempdir(), "nvckpt-deepspeed-upstream"),
        help="where the pytest the checkout pins (when this environment's does not fit) and the checkout's DeepSpeed are installed (default: %(default)s)",
    )
    parser.add_argument(
        "--deepspeed-from-checkout",
        action="store_true",
        help="run the tests on the checkout's own DeepSpeed (installed into --cache) instead of the installed one",
    )
    parser.add_argument("--timeout", type=float, help="seconds each of the two runs may take before it is stopped")
    args = parser.parse_intermixed_args()
    tests = args.checkout.resolve() / "tests"
    if not (tests / "unit" / "checkpoint").is_dir():
        parser.error(f"{args.checkout}: no tests/unit/checkpoint in it; give a DeepSpeed source tree")
    selection = [f"unit/checkpoint/{f}" for f in args.files] or ["unit/checkpoint"]
    args.out = args.out.resolve()  # pytest runs in the checkout's tests/ folder
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.cache.resolve()
    first: list[Path] = []
    extra_env: dict[str, str] = {}
    pytest_dir = pytest_path(args.checkout.resolve(), cache)
    if pytest_dir is not None:
        first.append(pytest_dir)
    if args.deepspeed_from_checkout:
        first.append(checkout_deepspeed(args.checkout.resolve(), cache))
        extra_env["TORCH_EXTENSIONS_DIR"] = str(cache / "torch_extensions")
    with tempfile.TemporaryDirectory(prefix="nvckpt-upstream-") as site:
        Path(site, "sitecustomize.py").write_text(SITECUSTOMIZE)
        stock = run("stock", tests, selection, args.keyword, args.out, Path(site), first, extra_env, args.timeout)
        ours = run("attach", tests, selection, args.keyword, args.out, Path(site), first, extra_env, args.timeout)
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
