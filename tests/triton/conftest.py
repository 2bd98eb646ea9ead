"""Triton kernel tests: each kernel against the C++ CPU kernel and the reference, run on this
machine in Triton's interpreter (``production/triton/_runtime.py`` sets ``TRITON_INTERPRET=1`` where
there is no GPU). The Triton implementations are called directly (``epkit.triton.<module>``),
the C++ kernels through ``torch.ops.epkit`` (this process keeps ``EPKIT_KERNELS=cpp``)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def cpp():
    """The C++ kernels (``torch.ops.epkit``), loaded."""
    import torch

    import epkit.ops  # noqa: F401  (loads the library)
    from epkit import triton as registry

    # under EPKIT_KERNELS=triton torch.ops.epkit on CPU would be the Triton kernels themselves,
    # and every comparison here a kernel against itself
    assert "CPU" not in registry.registered_keys(), (
        "tests/triton compare the Triton kernels with the C++ ones: run them without "
        "EPKIT_KERNELS=triton")
    return torch.ops.epkit


@pytest.fixture(autouse=True)
def race_checked():
    """Every launch of every test here runs under the race checker (``race.py``): a launch whose
    programs write one byte twice, or read what another program writes, fails the test.
    ``EPKIT_RACE_CHECK=0`` turns it off (to time its cost)."""
    if os.environ.get("EPKIT_RACE_CHECK", "1") == "0":
        yield
        return
    import race
    from epkit.triton import _runtime

    _runtime.LAUNCH_HOOKS.append(race.check_races)
    try:
        yield
    finally:
        _runtime.LAUNCH_HOOKS.remove(race.check_races)


@pytest.fixture(autouse=True, scope="session")
def tile_sizes():
    """``EPKIT_TILES=gpu``: every test runs its kernels interpreted at the tile sizes and
    program counts of a GPU launch (``_runtime.gpu_tiles``), so the race checker sees the
    programs a GPU would run (slower: many small programs)."""
    if os.environ.get("EPKIT_TILES", "") != "gpu":
        yield "interpreter"
        return
    from epkit.triton import _runtime

    with _runtime.gpu_tiles():
        yield "gpu"


@pytest.fixture(autouse=True, scope="session")
def recorded_launches():
    """``EPKIT_RECORD_LAUNCHES=PATH``: every launch of an epkit kernel in this session is
    recorded (``_runtime.record_launches``) and the distinct forms written to PATH as JSON at
    the end (what ``epkit kernels --record`` runs)."""
    path = os.environ.get("EPKIT_RECORD_LAUNCHES")
    if not path:
        yield None
        return
    import json

    from epkit.triton import _runtime

    with _runtime.record_launches(lambda k: _runtime.kernel_name(k).startswith("epkit.")) as rec:
        yield rec
    with open(path, "w") as f:
        json.dump({"tiles": _runtime.tiles(), "forms": list(rec.forms.values())}, f)


@pytest.fixture(autouse=True, scope="session")
def launches_recorded():
    """Every launch of an epkit kernel here must be one of the forms the compile gate compiles
    (``production/triton/launched.py``, written by ``epkit kernels --record``): a launch site
    with another tile size, launch option or argument type fails its test. At the interpreter's
    tiles the tile sizes are left out of the comparison (the record holds a GPU's).
    ``EPKIT_LAUNCH_CHECK=0`` turns it off (as --record does)."""
    if os.environ.get("EPKIT_LAUNCH_CHECK", "1") == "0":
        yield
        return
    from epkit.triton import _runtime, launched

    hook = _runtime.check_recorded(launched.FORMS)
    _runtime.LAUNCH_HOOKS.append(hook)
    try:
        yield
    finally:
        _runtime.LAUNCH_HOOKS.remove(hook)
