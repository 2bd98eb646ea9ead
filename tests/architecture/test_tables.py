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
    assert not _missing(abi.TRANSPORT_CODES, transports.TABLE), "production/transports.py"
    for row in transports.TABLE.values():
        assert row.code == abi.TRANSPORT_CODES[row.name]
        importlib.import_module(f"epkit.{row.module}")  # the module that carries it out


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
