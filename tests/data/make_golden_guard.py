"""Writes ``golden_v1_guard.nvc``: ``golden_v1.nvc``'s tree, policy and metadata, by a writer that
starts every file with the guard (docs/format.md "The guard"). Tests decode it forever after.

Run once: ``python tests/data/make_golden_guard.py``. Never regenerate a committed golden file.
Its digests are ``golden_v1.expected.json``'s (same tree, same metadata); the tests also pin that
it is ``golden_v1.nvc`` with the guard in front and every offset moved by the guard's length.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

_spec = importlib.util.spec_from_file_location("make_golden", HERE / "make_golden.py")
assert _spec is not None and _spec.loader is not None
make_golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_golden)


def main() -> None:
    sys.path.insert(0, str(HERE.parents[1] / "src"))
    import nvcomp_checkpoint as nc
    from nvcomp_checkpoint.format.layout import GUARD

    target = HERE / "golden_v1_guard.nvc"
    if target.exists() and "--force" not in sys.argv:
        raise SystemExit(f"{target} exists; golden files are written once (pass --force to overwrite)")
    with nc.open(HERE / "golden_v1.nvc") as reader:
        metadata = reader.metadata  # in the golden file's key order: the index JSON keeps it
    nc.save(make_golden.golden_tree(), target, make_golden.golden_policy(), metadata=metadata, workers=1)
    assert target.read_bytes().startswith(GUARD)
    print(f"wrote {target} ({target.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
