"""The README's and the docs pages' relative links reach files of the checkout; the docstrings' examples run and
print what they show."""

import doctest
import glob
import importlib
import os
import pkgutil
import re

import pytest

import poecaps

ROOT = os.path.join(os.path.dirname(__file__), "..")
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
LINK = re.compile(r"\]\(([^)\s]+)\)")          # [text](target)


def relative_links(text):
    """The targets of Markdown links that are paths (no scheme), without their #anchors."""
    return [link.split("#")[0] for link in LINK.findall(text) if not re.match(r"[a-z]+:", link) and link[0] != "#"]


def test_relative_links_are_read_as_paths():
    text = "[a](docs/x.md) [b](https://x.org/y) [c](#top) [d](results/r/#part) ![e](fig.png) [f](mailto:a@b)"
    assert relative_links(text) == ["docs/x.md", "results/r/", "fig.png"]


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_reaches_a_file(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as handle:
        links = relative_links(handle.read())
    folder = os.path.dirname(os.path.join(ROOT, page))
    missing = [link for link in links if not os.path.exists(os.path.join(folder, link))]
    assert not missing, f"{page} links to {missing}"


def test_the_docs_index_lists_every_page():
    with open(os.path.join(ROOT, "docs", "README.md"), encoding="utf-8") as handle:
        listed = set(relative_links(handle.read()))
    pages = {os.path.basename(p) for p in PAGES if p.startswith("docs") and not p.endswith("README.md")}
    assert pages <= listed, f"not in docs/README.md: {sorted(pages - listed)}"


def _modules_with_examples():
    """The library's modules whose docstrings hold `>>>` examples, in a fixed order."""
    names = sorted(info.name for info in pkgutil.walk_packages(poecaps.__path__, "poecaps."))
    finder = doctest.DocTestFinder()
    return [name for name in names if any(test.examples for test in finder.find(importlib.import_module(name)))]


MODULES_WITH_EXAMPLES = _modules_with_examples()


def test_the_library_has_docstring_examples_to_run():
    """The examples below are found at all (a finder that found none would let every example go unchecked)."""
    assert {"poecaps.layers.capsule_dense", "poecaps.routing.dynamic"} <= set(MODULES_WITH_EXAMPLES)


@pytest.mark.parametrize("name", MODULES_WITH_EXAMPLES)
def test_docstring_examples_print_what_they_show(name):
    """Every `>>>` example in the library runs and prints its shown output (before, the shapes were shown as
    tuples while the examples printed TensorShape)."""
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, report=True)
    assert result.attempted > 0 and result.failed == 0, f"{result.failed} of {result.attempted} examples failed"
