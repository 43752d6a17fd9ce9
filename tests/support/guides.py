"""README.md and the guides under docs/guide/, read as one text.

The tests take the commands, code, tables and console lines a user reads from here:
README first, then each guide in the site's order (docs/mkdocs.yml's nav), so a block
moved from one page to another is still found, and still run.
"""

import os
import re

from tests.support.commands import REPO

GUIDES = os.path.join(REPO, "docs", "guide")
# README's command that builds the site, run as written by tests/test_docs.py.
BUILD = "python3 -m mkdocs build --strict -f docs/mkdocs.yml"


def pages() -> list[str]:
    """README.md, then the guides' pages in the site's navigation order."""
    with open(os.path.join(REPO, "docs", "mkdocs.yml")) as f:
        listed = re.findall(r"^\s*- (?:[^:\n]+: )?(\S+\.md)$", f.read(), re.M)
    return [os.path.join(REPO, "README.md"), *(os.path.join(GUIDES, name) for name in listed)]


def text() -> str:
    """Every page's markdown, one after another."""
    parts = []
    for path in pages():
        with open(path) as f:
            parts.append(f.read())
    return "\n".join(parts)


def code_blocks(lang: str) -> list[str]:
    """The body of each fenced block of ``lang`` (``python``, ``sh``, ``gin``), in order."""
    return re.findall(rf"```{lang}\n(.*?)```", text(), flags=re.S)


def lines() -> list[str]:
    """Every page's lines, one after another."""
    return text().splitlines()
