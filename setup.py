"""The one compiled part: the byte-plane split/join in one pass (src/nvcomp_checkpoint/filters/_planes.c).

Everything else is declared in pyproject.toml. The extension is optional: without a C compiler the
install still succeeds and the numpy code in filters/byteplane.py does the same work, about 3x slower
on load (``nvckpt bench`` and ``nvcomp_checkpoint.filters.KERNELS`` say which one runs).
"""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "nvcomp_checkpoint.filters._planes",
            ["src/nvcomp_checkpoint/filters/_planes.c"],
            extra_compile_args=[] if sys.platform == "win32" else ["-O3"],
            optional=True,
        )
    ]
)
