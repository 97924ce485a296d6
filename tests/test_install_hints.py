"""Every message that says what to install gives a command that works today (the package is not on PyPI)."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.version import __version__, install_hint

SRC = Path(__file__).resolve().parents[1] / "src" / "nvcomp_checkpoint"


def test_install_hint_gives_the_clone_and_the_wheel_form() -> None:
    text = install_hint("s3")
    assert "pip install -e '.[s3]' in a clone of the nvcomp-checkpoint repository" in text
    assert f'pip install "$(ls dist/nvcomp_checkpoint-{__version__}-*.whl)[s3]"' in text
    assert "pip install 'nvcomp-checkpoint" not in text and "pip install nvcomp-checkpoint" not in text


def test_no_message_tells_to_pip_install_the_package_by_its_pypi_name() -> None:
    # One wording, version.install_hint: `pip install nvcomp-checkpoint[...]` fails until it is on PyPI.
    found = []
    for path in SRC.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"install\s+['\"`]?nvcomp-checkpoint|`nvcomp-checkpoint\[", line) and path.name != "version.py":
                found.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert found == [], "\n".join(found)


def test_an_s3_url_without_s3fs_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # s3fs is installed here: it is made unimportable, and fsspec's cache of imported back ends forgets it.
    registry = importlib.import_module("fsspec.registry")  # the module: `fsspec.registry` is its mapping

    monkeypatch.setitem(sys.modules, "s3fs", None)
    monkeypatch.delitem(registry._registry, "s3", raising=False)
    with pytest.raises(nc.CheckpointError) as info:
        nc.save({"w": torch.ones(4)}, "s3://bucket/ckpt.nvc")
    assert f"install the s3 extra: {install_hint('s3')}" in str(info.value), str(info.value)
