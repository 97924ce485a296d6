"""The package's imports run one way: no cycles, no upward imports, no private names across modules.

Every import counts, also those inside functions. Layers, lowest first (a module may import its own
layer and those below):

    base        errors, version, tensors, workers, codecs/*, filters/*, metrics, failures, safepaths, deadline, credentials, boundedjson, progressbar
    format      format/*, policy, planechoice, storage, report, filetype, pending, filedigest, dirstore, delta
    pipeline    writer, reader, snapshot, saveoptions
    api         api, async_save, savegroup, entrypoint/* (base, session, options, loading, commit, reports, support,
                deepspeed_engine), dirconvert, tiers/*,
                incremental, dcp/*, broadcast, deepspeed_layout, torchload, the package __init__
    adapters    cli/*, integrations/*, the short-name shims lightning/accelerate/transformers/deepspeed

Inside the ``tiers`` package the modules run one way too (TIERS, lowest first), and nothing outside
it imports its modules, only the package (``nvcomp_checkpoint.tiers``) and its public names.

The core never imports Lightning, Accelerate, Transformers or DeepSpeed; an integration imports its own
framework only, never another integration.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "nvcomp_checkpoint"
ROOT = Path(__file__).resolve().parents[1] / "src" / PACKAGE

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base",
        (
            "errors",
            "version",
            "tensors",
            "workers",
            "codecs",
            "filters",
            "metrics",
            "failures",
            "safepaths",
            "deadline",
            "credentials",
            "boundedjson",
            "progressbar",
        ),
    ),
    (
        "format",
        ("format", "policy", "planechoice", "storage", "report", "filetype", "pending", "filedigest", "dirstore", "delta"),
    ),
    ("pipeline", ("writer", "reader", "snapshot", "saveoptions")),
    (
        "api",
        (
            "api",
            "async_save",
            "savegroup",
            "entrypoint",
            "dirconvert",
            "tiers",
            "incremental",
            "dcp",
            "broadcast",
            "deepspeed_layout",
            "torchload",
            "",
        ),
    ),
    ("adapters", ("cli", "integrations", "lightning", "accelerate", "transformers", "deepspeed")),
]
# The tiers package, one module per job, lowest first: a module imports only those before it.
TIERS = (
    "schedule",
    "units",
    "cleaning",
    "transfer",
    "chains",
    "retention",
    "light",
    "restore",
    "tier0",
    "copier",
    "saving",
    "manager",
    "tiercopies",
)
FRAMEWORKS = {
    "lightning": ("lightning", "pytorch_lightning", "lightning_fabric"),
    "accelerate": ("accelerate",),
    "transformers": ("transformers", "safetensors"),
    "deepspeed": ("deepspeed",),
}
ADAPTERS = ("cli", "integrations", "lightning", "accelerate", "transformers", "deepspeed")


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    target: str  # imported module, dotted (ours or foreign)
    names: tuple[str, ...]  # names taken from it (from-imports)
    line: int


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(name: str) -> bool:
    return (ROOT.parent / Path(*name.split(".")) / "__init__.py").is_file()


def _resolve(source: str, is_pkg: bool, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = source.split(".") if is_pkg else source.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports() -> list[Import]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        source = _module_name(path)
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.append(Import(source, alias.name, (), node.lineno))
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(source, is_pkg, node.module, node.level)
                names = tuple(a.name for a in node.names)
                # `from . import errors` imports a module; `from .api import save` a name.
                modules = [
                    f"{target}.{n}"
                    for n in names
                    if _is_package(f"{target}.{n}")
                    or (ROOT.parent / Path(*f"{target}.{n}".split("."))).with_suffix(".py").is_file()
                ]
                if modules:
                    found.extend(Import(source, m, (), node.lineno) for m in modules)
                    rest = tuple(n for n in names if f"{target}.{n}" not in modules)
                    if rest:
                        found.append(Import(source, target, rest, node.lineno))
                else:
                    found.append(Import(source, target, names, node.lineno))
    return found


IMPORTS = _imports()
OURS = [i for i in IMPORTS if i.target == PACKAGE or i.target.startswith(PACKAGE + ".")]


def _top(name: str) -> str:
    """The first component below the package: ``writer``, ``cli``, ``integrations`` ('' for the package)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(name: str) -> int:
    top = _top(name)
    for rank, (_, members) in enumerate(LAYERS):
        if top in members:
            return rank
    raise AssertionError(f"{name}: in no layer of tests/test_import_graph.py; add it to LAYERS")


def test_every_module_is_in_a_layer() -> None:
    for path in ROOT.rglob("*.py"):
        _layer(_module_name(path))


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {}
    for i in OURS:
        if i.target != i.source:
            graph.setdefault(i.source, set()).add(i.target)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_imports_run_down_the_layers() -> None:
    upward = [
        f"{i.source}:{i.line} imports {i.target} ({LAYERS[_layer(i.target)][0]} above {LAYERS[_layer(i.source)][0]})"
        for i in OURS
        if _layer(i.target) > _layer(i.source)
    ]
    assert not upward, "\n".join(upward)


def test_no_private_names_across_modules() -> None:
    bad = []
    for i in OURS:
        same_package = i.source.rsplit(".", 1)[0] == i.target.rsplit(".", 1)[0] or i.target == i.source.rsplit(".", 1)[0]
        private_module = any(part.startswith("_") and part != "__init__" for part in i.target.split(".")[1:])
        if private_module and not same_package:
            bad.append(f"{i.source}:{i.line} imports the private module {i.target}")
        for name in i.names:
            if name.startswith("_") and name != "__version__":
                bad.append(f"{i.source}:{i.line} imports the private name {name} from {i.target}")
    assert not bad, "\n".join(bad)


def test_no_private_attributes_of_our_modules() -> None:
    # `nc._x`, `writer._pos`-style reads through a name bound to one of our modules.
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith(PACKAGE)}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                bad.append(f"{_module_name(path)}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_frameworks_are_imported_by_their_own_integration_only(framework: str) -> None:
    owners = {f"{PACKAGE}.integrations.{framework}", f"{PACKAGE}.{framework}"}
    bad = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in IMPORTS
        if i.target.split(".")[0] in FRAMEWORKS[framework]
        and i.source not in owners
        and not i.source.startswith(f"{PACKAGE}.integrations.{framework}_")  # e.g. lightning_sharded
        and not (framework == "transformers" and i.target.split(".")[0] == "safetensors" and _top(i.source) == "cli")
    ]
    assert not bad, "\n".join(bad)


def _integration_framework(module: str) -> str:
    # integrations.lightning and integrations.lightning_sharded both belong to lightning.
    return module.split(".")[2].split("_")[0] if module.count(".") >= 2 else ""


# No integration builds on another: Accelerate, the Trainer and Lightning attach DeepSpeed's checkpoint
# engine through the core's DeepSpeed backend (entrypoint.deepspeed_engine), and the Trainer's FSDP state
# goes through the core's FSDP functions (dcp.fsdp_functions), as Accelerate's does.
BUILT_ON: set[tuple[str, str]] = set()


def test_integrations_do_not_import_each_other() -> None:
    # Modules of one framework's integration may import each other; never another framework's.
    bad = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in OURS
        if _top(i.source) == "integrations"
        and _top(i.target) == "integrations"
        and _integration_framework(i.source) != _integration_framework(i.target)
        and (i.source, i.target) not in BUILT_ON
    ]
    assert not bad, "\n".join(bad)


def test_adapters_use_the_public_api_only() -> None:
    # The CLI and the integrations build on what users may import: the package and the modules
    # with a public __all__ below it, never the writer, the reader or the snapshot.
    internal = {"writer", "reader", "snapshot", "pending", "workers"}
    bad = [f"{i.source}:{i.line} imports {i.target}" for i in OURS if _top(i.source) in ADAPTERS and _top(i.target) in internal]
    assert not bad, "\n".join(bad)


def _text_decisions(source: str) -> list[int]:
    """Lines of ``"..." in str(x)`` (or ``not in``) not marked as a decision on torch's own text."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)):
            continue
        right = node.comparators[0]
        if (
            isinstance(node.left, ast.Constant)
            and isinstance(right, ast.Call)
            and isinstance(right.func, ast.Name)
            and right.func.id == "str"
        ):
            above = "\n".join(lines[max(0, node.lineno - 4) : node.lineno])
            if "torch's own text" not in above:
                found.append(node.lineno)
    return found


def test_no_decisions_on_our_own_error_text() -> None:
    # A reworded message must not change behaviour: our errors are told apart by type. Only another
    # library's text, where it has no types (torch's weights-only refusal), may be read, and says so.
    bad = [
        f"{_module_name(path)}:{line} decides on an error's text; give the case its own exception type"
        for path in sorted(ROOT.rglob("*.py"))
        for line in _text_decisions(path.read_text())
    ]
    assert not bad, "\n".join(bad)
    assert _text_decisions('if "save_state failed" in str(exc):\n    pass\n') == [1]  # the rule sees one


def _private_state_of_the_base() -> set[str]:
    """The private attributes ``CheckpointSession`` sets on itself (``self._saves = ...``)."""
    tree = ast.parse((ROOT / "entrypoint" / "session.py").read_text())
    return {
        target.attr
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
        and target.attr.startswith("_")
        and not target.attr.startswith("__")
    }


def test_integrations_use_the_public_interface_of_the_session_only() -> None:
    # The session's sequence of saves is its own: the integrations call its public methods.
    private = _private_state_of_the_base()
    assert "_saves" in private  # the rule sees what it guards
    bad = []
    for path in sorted((ROOT / "integrations").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in private:
                bad.append(f"{_module_name(path)}:{node.lineno} reads {node.attr} of CheckpointSession; use its public methods")
    assert not bad, "\n".join(bad)


def _exists(module: str) -> bool:
    return _is_package(module) or (ROOT.parent / Path(*module.split("."))).with_suffix(".py").is_file()


def test_every_import_of_ours_resolves() -> None:
    # An import inside a function fails only when it runs (a moved module's `from .dcp import ...`),
    # and may be caught there as any other error: check every one here.
    missing = [f"{i.source}:{i.line} imports {i.target}, which does not exist" for i in OURS if not _exists(i.target)]
    assert not missing, "\n".join(missing)


def _tiers_module(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "tiers" else None


def test_every_tiers_module_is_in_the_order() -> None:
    found = {p.stem for p in (ROOT / "tiers").glob("*.py") if p.stem != "__init__"}
    assert found == set(TIERS), f"add {sorted(found - set(TIERS))} to TIERS (or remove {sorted(set(TIERS) - found)})"


def test_tiers_modules_import_down() -> None:
    bad = [
        f"{i.source}:{i.line} imports {i.target} (later in TIERS)"
        for i in OURS
        if _tiers_module(i.source)
        and _tiers_module(i.target)
        and TIERS.index(_tiers_module(i.target)) >= TIERS.index(_tiers_module(i.source))
    ]
    assert not bad, "\n".join(bad)


def test_only_the_tiers_package_imports_its_modules() -> None:
    # Everything else takes the package's public names, so the modules inside can be split or merged freely.
    bad = [f"{i.source}:{i.line} imports {i.target}" for i in OURS if _tiers_module(i.target) and _top(i.source) != "tiers"]
    assert not bad, "\n".join(bad)
