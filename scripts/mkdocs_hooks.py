"""mkdocs hook (mkdocs.yml, ``hooks:``): the docstrings' Sphinx roles shown as plain code.

The docstrings are Google style with Sphinx cross-reference roles (``:class:`~pkg.Name```), which
mkdocstrings leaves as text: ":class:" before the code, and the full dotted path where ``~`` asks
for the last name. Rewriting the rendered HTML keeps src/ untouched.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|func|meth|data|mod|attr|exc|obj|py:\w+):(?=<code>)")
_TILDE = re.compile(r"<code>~(?:[\w]+\.)*([\w]+)</code>")


def on_page_content(html: str, **kwargs: Any) -> str:
    return _TILDE.sub(r"<code>\1</code>", _ROLE.sub("", html))
