"""The ABI guard of the binding: the library reports its ABI version and struct sizes, _lib checks them against its
ctypes structs when it loads the library, and refuses a mismatched library with an ImportError naming the path and
both versions (faked here by changing what the binding expects). Also the version: one number, the header's, for the
library, megamoe.__version__ and an installed wheel's metadata."""

import ctypes
import importlib.metadata
import os
import pathlib
import re
import types

import pytest

import megamoe
from megamoe import _lib

HEADER = pathlib.Path(__file__).resolve().parents[2] / "include" / "megamoe" / "megamoe.h"


def test_library_reports_the_abi_the_binding_declares():
    lib = _lib.library()
    assert lib.megamoe_abi_version() == _lib.ABI_VERSION
    for kind, struct in _lib.ABI_STRUCTS.items():
        assert lib.megamoe_struct_size(kind) == ctypes.sizeof(struct), struct.__name__
    assert lib.megamoe_struct_size(99) == 0


@pytest.fixture
def reload(monkeypatch):
    """Loads the library afresh (the loaded one is restored afterwards); returns the path it loads."""
    path = _lib.library_path()
    monkeypatch.setattr(_lib, "_LIB", None)
    return path


def test_mismatched_abi_version_is_refused(reload, monkeypatch):
    monkeypatch.setattr(_lib, "ABI_VERSION", _lib.ABI_VERSION + 41)
    with pytest.raises(ImportError) as info:
        _lib.library()
    message = str(info.value)
    assert str(reload) in message
    assert f"has ABI version {_lib.ABI_VERSION - 41}" in message
    assert f"this binding expects ABI version {_lib.ABI_VERSION}" in message
    assert _lib._LIB is None  # nothing half-loaded is kept


def test_mismatched_struct_size_is_refused(reload, monkeypatch):
    class ShortGroupedForwardParams(ctypes.Structure):  # a binding that forgot the stream field
        _fields_ = _lib.GroupedForwardParams._fields_[:-1]

    monkeypatch.setattr(_lib, "ABI_STRUCTS", {**_lib.ABI_STRUCTS, 3: ShortGroupedForwardParams})
    with pytest.raises(ImportError) as info:
        _lib.library()
    message = str(info.value)
    assert str(reload) in message and f"ABI version {_lib.ABI_VERSION}" in message
    have, want = ctypes.sizeof(_lib.GroupedForwardParams), ctypes.sizeof(ShortGroupedForwardParams)
    assert f"'ShortGroupedForwardParams': {have}" in message and f"'ShortGroupedForwardParams': {want}" in message


def test_library_without_the_abi_functions_is_refused():
    old_library = types.SimpleNamespace(megamoe_version=lambda: 200)  # what a library from before the guard exports
    expected = f"/old/libmegamoe.so has no ABI version .* expects ABI version {_lib.ABI_VERSION}"
    with pytest.raises(ImportError, match=expected):
        _lib.check_abi(old_library, "/old/libmegamoe.so")


def test_the_guarded_library_still_runs(reload):
    import torch

    import megamoe

    x = torch.randn(3, 8, dtype=torch.float64)
    w13, w2 = torch.randn(2, 8, 8, dtype=torch.float64), torch.randn(2, 8, 4, dtype=torch.float64)
    out = megamoe.grouped_moe(x, torch.tensor([1, 2]), w13, w2)
    assert out.shape == (3, 8) and _lib._LIB is not None


def test_version_is_the_headers():
    defines = dict(re.findall(r"#define MEGAMOE_VERSION_(MAJOR|MINOR|PATCH) (\d+)", HEADER.read_text()))
    assert megamoe.__version__ == f"{defines['MAJOR']}.{defines['MINOR']}.{defines['PATCH']}"


def test_an_installed_package_carries_its_library_and_version():
    """Installed from a wheel: the package loads its own lib/libmegamoe.so and its metadata has the library's
    version."""
    package = pathlib.Path(megamoe.__file__).resolve().parent
    try:
        distribution = importlib.metadata.distribution("megamoe")
    except importlib.metadata.PackageNotFoundError:
        distribution = None
    if distribution is None or pathlib.Path(distribution.locate_file("megamoe")).resolve() != package:
        pytest.skip(f"megamoe is imported from {package}, not from an installed distribution")
    assert distribution.version == megamoe.__version__
    if not os.environ.get("MEGAMOE_LIBRARY"):
        assert pathlib.Path(_lib.library()._name) == package / "lib" / "libmegamoe.so"
