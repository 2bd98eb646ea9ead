"""The ABI is defined once: reference/abi.py. The kernels' header csrc/abi.h is
generated from it and must not drift; no kernel source may type one of its numbers by hand."""

import glob
import os
import re

from epkit.reference import abi
from epkit.reference.errors import Reason

CSRC = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "production", "csrc")
SOURCES = [p for pat in ("*.h", "cpu/*.cpp", "*.cpp")
           for p in glob.glob(os.path.join(CSRC, pat)) if not p.endswith("abi.h")]


def test_checked_in_header_is_generated_from_abi_py():
    with open(os.path.join(CSRC, "abi.h")) as f:
        assert f.read() == abi.render_header(), (
            "csrc/abi.h differs from reference/abi.py: regenerate it with "
            "python -c 'from epkit import _build; _build.sync_abi_header()'")


def test_no_kernel_source_defines_an_abi_number():
    """A reason, plan word, word field or wire constant defined with a number outside abi.h
    would be a second copy that can drift."""
    camel = abi._camel
    names = {f"k{camel(r.name.lower())}" for r in Reason}
    names |= {f"k{camel(f)}" for f in abi.PLAN_FIELDS} | {f"kWord{camel(f)}" for f in abi.WORD_FIELDS}
    names |= {"kPairs", "kDedup", "kWordHeader", "kPlanHeader", "kPairsMetaBytes", "kSlotRowBytes",
              "kDedupTokMeta", "kDedupMaxTopK", "kDedupMaxLocal", "kRagged", "kPadded", "kEqual",
              "kStatic"}
    pattern = re.compile(r"\b(k[A-Z]\w*)\s*=\s*-?\d")
    found = []
    for path in SOURCES:
        for n, line in enumerate(open(path), 1):
            for name in pattern.findall(line.split("//")[0]):
                if name in names:
                    found.append(f"{os.path.relpath(path, CSRC)}:{n}: {line.strip()}")
    assert not found, "defined outside abi.h:\n" + "\n".join(found)


def test_count_words_are_indexed_by_name():
    """The count words' header and prepare's pre_error are read by field name (kWord*,
    kPreError*), not w[4] / r[6] / pre_error[3]."""
    bare = re.compile(r"\b(?:w|r|r0|words0|pre_error)\[[0-7]\]|row\((?:s|0)\)\[[0-7]\]")
    found = [f"{os.path.relpath(p, CSRC)}:{n}: {ln.strip()}" for p in SOURCES
             for n, ln in enumerate(open(p), 1) if bare.search(ln.split("//")[0])]
    assert not found, "\n".join(found)


def test_no_kernel_source_types_a_wire_offset_or_the_mxfp8_block():
    """Row metadata at ``P + kPairsMeta*`` / ``P + kDedupMeta*``, MXFP8 blocks of kMxfp8Block."""
    bare = re.compile(r"\bP \+ (?:4|8|12)\b|\bH / 32\b")
    found = [f"{os.path.relpath(p, CSRC)}:{n}: {ln.strip()}" for p in SOURCES
             for n, ln in enumerate(open(p), 1) if bare.search(ln.split("//")[0])]
    assert not found, "\n".join(found)


def test_python_takes_the_plan_layout_from_abi():
    from epkit import plan as W

    assert W.PLAN_HEADER == abi.PLAN_HEADER and W.WORD_HEADER == abi.WORD_HEADER
    assert W.plan_size(4, 16) == abi.plan_size(4, 16)
    assert W.TRANSPORTS == abi.TRANSPORT_CODES
    assert [W.ERR_CODE, W.RANKS, W.NONUNIFORM_RANK] == [
        abi.PLAN_FIELDS.index(n) for n in ("err_code", "ranks", "nonuniform_rank")]


def test_error_texts_name_options_by_the_abi_codes():
    """errors.option_names (the texts' code -> name tables) reads from abi.py's codes,
    and the payload table has a row for every payload code."""
    from epkit.reference import payloads
    from epkit.reference.errors import option_names

    for kind, codes in (("transport", abi.TRANSPORT_CODES), ("exchange", abi.EXCHANGE_CODES),
                        ("payload", abi.PAYLOAD_CODES)):
        assert option_names(kind) == {v: str(k) for k, v in codes.items()}, kind
    assert set(abi.PAYLOAD_CODES) == set(payloads.TABLE) == set(abi.PAYLOAD_BLOCKS)
