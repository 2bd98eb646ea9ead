"""Every variant is a row in every tier's table, derived from reference/abi.py's codes: what
docs/design.md's recipes ("Adding a payload", "Adding a transport", "Adding an exchange
variant") rely on. A name added in one tier and forgotten in another fails here, naming the
table that lacks it."""

from __future__ import annotations

import importlib

import pytest

from epkit.reference import abi
from epkit.reference import payloads as reference_payloads
from epkit.reference import transports as reference_transports

reference_exchange = importlib.import_module("epkit.reference.exchange")  # the module, not the op


def _missing(names, table) -> list:
    return sorted(set(names) ^ set(table), key=str)


def test_transports_have_a_row_in_every_tier():
    from epkit import transports

    assert not _missing(abi.TRANSPORT_CODES, reference_transports.TABLE), "reference/transports"
    assert not _missing(abi.TRANSPORT_CODES, transports.TABLE), "production/transports/"
    for row in transports.TABLE.values():
        assert row.code == abi.TRANSPORT_CODES[row.name]
        importlib.import_module(f"epkit.{row.module}")  # the module that carries it out


# The facts the ops, their fakes, the count exchange and the return path ask of the row of the
# kernel path they run (the ops get the path's code): a transport must state them as its path
# does, or its own row (validation, static sizes) and the ops would disagree.
PATH_FACTS = ("replans_after_drops", "slot_sections", "slot_cap_field", "rows_hold_many_slots",
              "returns_units", "max_topk", "max_local")


def test_every_transport_states_the_facts_of_its_kernel_path():
    import torch

    from epkit import transports

    for row in transports.TABLE.values():
        path = transports.TABLE_BY_CODE.get(row.path)
        assert path is not None and path.path == path.code, f"{row.name}: path {row.path}"
        for fact in PATH_FACTS:
            assert getattr(row, fact) == getattr(path, fact), f"{row.name}.{fact}"
        for K, R in ((1, 1), (8, 4), (255, 64)):
            assert row.send_map_cols(K, R) == path.send_map_cols(K, R), row.name
            assert row.recv_map_cols(K) == path.recv_map_cols(K), row.name
        for dt in (torch.float32, torch.bfloat16):
            assert row.back_dtype(dt) == path.back_dtype(dt), row.name


def _cpp_members(path: str) -> set:
    """The static members of the one path struct a csrc header declares."""
    import re

    return set(re.findall(r"static (?:constexpr )?[\w:<>*& ]+? \*?(\w+)(?: = |\()",
                          open(path).read()))


def _cpp_passes(path: str, tag: str) -> set:
    """The passes a cpu/<path>.cpp defines, overloaded on its path tag."""
    import re

    return set(re.findall(rf"^\w[\w:<>]* (\w+)\({tag},", open(path).read(), re.M))


def test_kernel_paths_answer_one_interface_in_both_kernel_tiers():
    """The kernels split by transport path (csrc/pairs.h + cpu/pairs.cpp, csrc/dedup.h +
    cpu/dedup.cpp; triton/pairs.py, triton/dedup.py): every one-stage transport has a path in
    both kernel tiers, and the paths of a tier answer the same names (the op files ask them)."""
    import inspect
    import os

    import epkit.triton.transports as triton_transports
    from epkit import transports

    one_stage = {row.path for row in transports.TABLE.values() if row.module == "direct"}
    assert set(triton_transports.PATHS) == one_stage, "epkit.triton.transports.PATHS"
    interface = set(triton_transports.INTERFACE)
    for m in triton_transports.PATHS.values():  # the interface's names, and no other function
        defined = {n for n, v in vars(m).items() if inspect.isfunction(v)
                   and v.__module__ == m.__name__ and not n.startswith("_")}
        assert defined <= interface, f"{m.__name__}: {sorted(defined - interface)}"
        missing = sorted(n for n in interface if not hasattr(m, n))
        assert not missing, f"{m.__name__} lacks {missing}"
    assert {m.CODE for m in triton_transports.PATHS.values()} == one_stage

    csrc = os.path.join(os.path.dirname(os.path.dirname(transports.__file__)), "csrc")
    pairs, dedup = (_cpp_members(os.path.join(csrc, f"{n}.h")) for n in ("pairs", "dedup"))
    assert len(pairs) > 20 and pairs == dedup, f"csrc paths differ: {sorted(pairs ^ dedup)}"
    passes = [_cpp_passes(os.path.join(csrc, "cpu", f"{n.lower()}.cpp"), n)
              for n in ("Pairs", "Dedup")]
    assert passes[0] == passes[1] == {"pack_rows", "index_rows", "gather_into", "check_gather",
                                      "check_units"}, passes


def test_exchanges_have_a_row_in_every_tier():
    from epkit import collectives

    assert not _missing(abi.EXCHANGE_CODES, reference_exchange.OPTIONS), "reference OPTIONS"
    assert not _missing(abi.EXCHANGE_CODES, collectives.EXCHANGES), "epkit.collectives.EXCHANGES"
    assert not _missing(abi.VARIANT_CODES, reference_exchange.VARIANTS), "reference VARIANTS"
    assert not _missing(abi.VARIANT_CODES, collectives.VARIANTS), "epkit.collectives.VARIANTS"


@pytest.mark.parametrize("payload", [p for p in abi.PAYLOAD_CODES if p is not None])
def test_payloads_have_a_row_and_kernels_in_every_tier(payload):
    import torch

    import epkit.ops  # noqa: F401  (loads the C++ library: the op schemas)
    import epkit.payloads
    import epkit.triton

    assert payload in reference_payloads.TABLE, "reference/payloads.py"
    assert payload in epkit.payloads.TABLE, "epkit.payloads.TABLE"
    assert abi.PAYLOAD_BLOCKS[payload] > 0 and abi.PAYLOAD_SCALE_BYTES[payload] > 0
    op = f"quantize_{payload}"
    assert hasattr(torch.ops.epkit, op), f"the C++ op epkit::{op} (registration.cpp)"
    assert op in epkit.triton.OPS, f"epkit.triton.OPS[{op!r}]"
    # the kernels' table, rendered from abi.py, has the payload's block and scale bytes
    header = abi.render_header()
    code = abi.PAYLOAD_CODES[payload]
    blocks = header.split("kPayloadBlocks[kPayloadCount] = {")[1].split("}")[0].split(", ")
    assert int(blocks[code]) == abi.PAYLOAD_BLOCKS[payload]
