"""The package's public names load on first use (PEP 562) and are the objects their modules define."""

from __future__ import annotations

import importlib
import types

import kernels
import kernels.attention  # a submodule named like its op, imported first: `kernels.attention` stays the op


def test_every_public_name_is_its_module_s_object():
    assert sorted(kernels.__all__) == sorted(kernels._HOMES)
    for name in kernels.__all__:
        assert getattr(kernels, name) is getattr(importlib.import_module(kernels._HOMES[name]), name), name


def test_ops_named_like_their_modules_are_the_ops():
    for name in ("attention", "grouped_matmul", "linear_scan"):
        importlib.import_module(f"kernels.{name}")
        assert callable(getattr(kernels, name)) and not isinstance(getattr(kernels, name), types.ModuleType), name


def test_an_unknown_name_is_an_attribute_error():
    assert not hasattr(kernels, "flash_attention")
