"""The examples in the docstrings run and show what they say: they are the API's documentation."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import contextwarden

MODULES = ["contextwarden", *sorted(m.name for m in pkgutil.walk_packages(contextwarden.__path__, "contextwarden."))]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    failures, _ = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert failures == 0, f"{failures} docstring example(s) of {name} failed (printed above)"
