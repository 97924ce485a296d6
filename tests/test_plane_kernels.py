"""The compiled byte-plane split/join (filters/_planes.c) against the numpy code it replaces.

Same bytes for every width, rotation, length and alignment; every length checked before a byte is
touched (a forged index must not make the kernel read or write out of bounds); the numpy fallback
chosen by the environment variable; and the kernel built wherever a C compiler is at hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nvcomp_checkpoint as nc
from nvcomp_checkpoint.filters import KERNELS, ByteplaneFilter, RotatedByteplaneFilter, byteplane
from nvcomp_checkpoint.format.layout import FOOTER

kernel = byteplane._planes
needs_kernel = pytest.mark.skipif(kernel is None, reason="the compiled byte-plane kernel is not built here (numpy fallback)")


def _filters() -> list[ByteplaneFilter]:
    rotated = [RotatedByteplaneFilter(w, r) for w in (2, 4) for r in range(1, 8 * w)]
    return [ByteplaneFilter(w) for w in (2, 4, 8)] + rotated


def test_kernel_is_built_where_a_c_compiler_is() -> None:
    if os.environ.get(byteplane.PURE_PYTHON_ENV, "") not in ("", "0"):
        pytest.skip(f"{byteplane.PURE_PYTHON_ENV} asks for the numpy code")
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the install falls back to numpy, as documented")
    assert KERNELS == "compiled", (
        "the byte-plane kernel was not built although a C compiler is here: "
        "run `pip install -e .` (or `python setup.py build_ext --inplace`) in the checkout"
    )


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=4099), offset=st.integers(0, 7), pick=st.integers(0, 10_000))
def test_split_and_join_equal_numpy_for_every_width_rotation_and_alignment(data: bytes, offset: int, pick: int) -> None:
    filt = _filters()[pick % len(_filters())]
    w = filt.width
    raw = np.frombuffer(data[: len(data) // w * w], dtype=np.uint8)
    # An element buffer that starts `offset` bytes into an allocation: unaligned words too.
    held = np.zeros(raw.size + 8, dtype=np.uint8)
    src = held[offset : offset + raw.size]
    src[:] = raw
    want = filt._split_numpy(src.copy())
    got = filt.split(src)
    assert [p.tobytes() for p in got] == [p.tobytes() for p in want]
    out_held = np.zeros(raw.size + 8, dtype=np.uint8)
    out = out_held[offset : offset + raw.size]
    filt.join(out, got)
    assert out.tobytes() == raw.tobytes()
    assert not out_held[:offset].any() and not out_held[offset + raw.size :].any(), "wrote outside its output"


@needs_kernel
@pytest.mark.parametrize("width,rotate", [(2, 1), (4, 1), (4, 0), (8, 0)])
def test_large_runs_and_bytes_planes_join_like_numpy(width: int, rotate: int) -> None:
    n = (1 << 18) + 3
    data = np.random.default_rng(width).integers(0, 256, n * width, dtype=np.uint8)
    filt = RotatedByteplaneFilter(width, rotate) if rotate else ByteplaneFilter(width)
    planes = filt.split(data)
    assert [p.tobytes() for p in planes] == [p.tobytes() for p in filt._split_numpy(data)]
    out = np.empty_like(data)
    filt.join(out, [p.tobytes() for p in planes])  # planes as bytes objects, as a reader may hand them
    assert np.array_equal(out, data)


@needs_kernel
def test_forged_lengths_raise_before_any_byte_is_written() -> None:
    assert kernel is not None
    out = np.full(16, 0xAA, dtype=np.uint8)
    planes = [np.ones(4, dtype=np.uint8) for _ in range(4)]
    short = planes[:3] + [np.ones(3, dtype=np.uint8)]
    long = planes[:3] + [np.ones(5, dtype=np.uint8)]
    for bad in (short, long):
        with pytest.raises(ValueError, match="plane 3 holds"):
            kernel.join(out, bad, 0)
        assert (out == 0xAA).all()
    with pytest.raises(ValueError, match="not a whole number"):
        kernel.join(out[:15], [np.ones(4, dtype=np.uint8)] * 4, 0)
    with pytest.raises(ValueError, match="takes 2, 4 or 8 planes"):
        kernel.join(out, planes[:3], 0)
    with pytest.raises(ValueError, match="rotation 32"):
        kernel.join(out, planes, 32)
    with pytest.raises(ValueError, match="rotation 1"):
        kernel.join(out, [np.ones(2, dtype=np.uint8)] * 8, 1)
    with pytest.raises(TypeError):
        kernel.join(b"\x00" * 16, planes, 0)  # a read-only output
    with pytest.raises(ValueError, match="plane 0 holds"):
        kernel.split(np.zeros(16, dtype=np.uint8), [np.empty(3, dtype=np.uint8)] * 4, 0)
    with pytest.raises(BufferError):
        kernel.split(np.zeros(16, dtype=np.uint8), [b"\x00" * 4] * 4, 0)  # read-only planes
    assert (out == 0xAA).all()
    # ByteplaneFilter.join keeps its own message for a wrong plane count, whichever code runs.
    with pytest.raises(ValueError, match="needs 4 planes, got 3"):
        ByteplaneFilter(4).join(out, planes[:3])


def test_numpy_fallback_chosen_by_the_environment_writes_the_same_file(tmp_path) -> None:
    import torch

    state = {
        "w": torch.randn(3000, dtype=torch.bfloat16),
        "m": torch.randn(5000) * 1e-3,
        "d": torch.randn(700, dtype=torch.float64),
    }
    torch.save(state, tmp_path / "state.pt")
    nc.save(state, tmp_path / "here.nvc")
    script = (
        "import sys, torch, nvcomp_checkpoint as nc\n"
        "from nvcomp_checkpoint.filters import KERNELS\n"
        "d = sys.argv[1]\n"
        "state = torch.load(d + '/state.pt')\n"
        "nc.save(state, d + '/fallback.nvc')\n"
        "back = nc.load(d + '/here.nvc')\n"
        "assert all(torch.equal(back[k].view(torch.uint8), state[k].view(torch.uint8)) for k in state)\n"
        "print(KERNELS)\n"
    )
    env = dict(os.environ, **{byteplane.PURE_PYTHON_ENV: "1"})
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "numpy"
    # Every frame the same: the bytes before the index (the index differs by its "created" time).
    here, fallback = (tmp_path / "here.nvc").read_bytes(), (tmp_path / "fallback.nvc").read_bytes()
    frames_end = FOOTER.unpack(here[-FOOTER.size :])[0]
    assert FOOTER.unpack(fallback[-FOOTER.size :])[0] == frames_end
    assert fallback[:frames_end] == here[:frames_end]
