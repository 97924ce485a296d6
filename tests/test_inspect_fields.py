"""``nvckpt inspect`` shows every field read from a file safely, whatever its value.

The index is forged with valid checksums: a creation time no calendar holds, terminal escapes
in keys and metadata, megabytes of text, a codec level that is a nested list.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
import xxhash

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.cli.main import main

FOOTER = struct.Struct("<QQQ8s")


def _forge_index(path, mutate) -> None:
    data = path.read_bytes()
    offset, size, _, magic = FOOTER.unpack(data[-FOOTER.size :])
    index = json.loads(data[offset : offset + size])
    mutate(index)
    raw = json.dumps(index).encode()
    path.write_bytes(data[:offset] + raw + FOOTER.pack(offset, len(raw), xxhash.xxh3_64_intdigest(raw), magic))


@pytest.mark.parametrize("created", [1e300, -1e300, 2**62, True, "yesterday", None])
def test_any_creation_time_is_shown(tmp_path, capsys, created):
    # Was: "unexpected OverflowError ... this is a bug", exit 3, for 1e300.
    path = tmp_path / "t.nvc"
    nc.save({"w": torch.ones(3)}, path)
    _forge_index(path, lambda index: index["metadata"].__setitem__("created", created))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "metadata:" in out and "created=" in out, out


def test_escapes_and_long_values_are_shown_inert_and_bounded(tmp_path, capsys):
    path = tmp_path / "e.nvc"
    nc.save({"w\x1b[31mred": torch.ones(3)}, path, metadata={"note\x1b[2J": "a\x1b]0;title\x07b\n" + "x" * 100_000})
    _forge_index(path, lambda index: index["tensors"][0]["codec"].__setitem__("level", [[1] * 1000] * 50))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out, out[:500]
    assert "\\x1b[31mred" in out and "note\\x1b[2J" in out
    assert max(len(line) for line in out.splitlines()) < 1000
    assert main(["inspect", str(path), "--json"]) == 0  # JSON keeps the values, escaped by JSON itself
    meta = json.loads(capsys.readouterr().out)["metadata"]
    assert meta["note\x1b[2J"].startswith("a\x1b]0;title\x07b\n")
