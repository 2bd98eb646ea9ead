"""The payload table: how a token row travels, one entry per ``payload=`` value.

=================  ==========================  ===============================  ===============
payload            expert_x [M, H]             expert_scale [M, H / block]      row bytes P
=================  ==========================  ===============================  ===============
``None``           x's dtype, bit for bit      None                             ``H * itemsize``
``"mxfp8"``        float8_e4m3fn               uint8 E8M0 codes, block 32       ``H + H / 32``
``"fp8_block128"`` float8_e4m3fn               float32 scales, block 128        ``H + 4 H / 128``
=================  ==========================  ===============================  ===============

A quantized payload is encoded at the source (every row of x), travels as ``H`` E4M3 bytes
followed by the row's ``H / block`` scales (little-endian), and is decoded to float32 only by
whoever asks (``decode``). It needs ``H % block == 0`` and finite x (``check``). Every module of
the reference asks this table instead of naming a payload; the rule of each payload lives in its
own module (mxfp8.py, fp8_block128.py). The numbers shared with the kernels (codes, blocks,
scale sizes) are abi.py's.

Adding a payload: a module with its ``quantize`` / ``dequantize``, an abi.py entry (code, block,
scale bytes) and a row here; production mirrors it in ``epkit.payloads``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from . import fp8_block128, mxfp8
from .abi import PAYLOAD_CODES, PAYLOAD_SCALE_BYTES, PayloadCodes as Codes, payload_bytes
from .dtypes import E4M3, FLOAT32
from .errors import Reason

Triple = Tuple[int, int, int]


@dataclass(frozen=True)
class Payload(Codes):
    """One row of the table (module docstring).

    name: the ``payload=`` value; scale_dtype: the scales' dtype (None: no scales);
    encode: x [T, H] -> (q [T, H] float8_e4m3fn, scale [T, H / block] scale_dtype);
    decode: (q, scale) -> [T, H] float32.
    """

    name: Optional[str]
    scale_dtype: Optional[np.dtype] = None
    encode: Optional[Callable] = None
    decode: Optional[Callable] = None


    def row_dtype(self, x_dtype) -> np.dtype:
        """dtype of the dispatched rows: x's, or E4M3."""
        return E4M3 if self.quantized else np.dtype(x_dtype)

    def scale_shape(self, rows: int, hidden: int) -> Tuple[int, int]:
        return (rows, hidden // self.block)

    def row_bytes(self, hidden: int, x_dtype) -> int:
        """``P``: bytes of one token's payload on the wire (abi.payload_bytes)."""
        return payload_bytes(hidden, np.dtype(x_dtype).itemsize, self.name)

    def zero_scales(self, rows: int, hidden: int) -> Optional[np.ndarray]:
        """[rows, H / block] zeros of the scale dtype (the scales of padding rows), or None."""
        return np.zeros(self.scale_shape(rows, hidden), self.scale_dtype) if self.quantized else None

    # -- validation (reference/validate.py, check 7) -----------------------------------------
    def check(self, x: np.ndarray) -> Triple:
        """One rank's x [T, H] (2-D, float): ``H % block``, then the first non-finite row
        (NONFINITE_PAYLOAD, a: row, b: the payload's code)."""
        if not self.quantized:
            return (Reason.OK, 0, 0)
        triple = self.hidden_triple(x.shape[1])
        if triple[0] != Reason.OK:
            return triple
        rows = np.flatnonzero(~np.isfinite(x.astype(FLOAT32)).all(axis=1))
        if rows.size:
            return (Reason.NONFINITE_PAYLOAD, int(rows[0]), self.code)
        return (Reason.OK, 0, 0)

    # -- the wire ---------------------------------------------------------------------------
    def wire_rows(self, xs: Sequence[np.ndarray]):
        """The rows each source puts on the wire: x itself, or ``encode(x)`` (at the source).
        Returns ``(rows, scales)``: R arrays [T_s, H]; R arrays [T_s, H / block] or None."""
        if not self.quantized:
            return list(xs), None
        encoded = [self.encode(x) for x in xs]
        return [q for q, _ in encoded], [s for _, s in encoded]

    def to_bytes(self, row: np.ndarray, scale: Optional[np.ndarray]) -> bytes:
        """One token's payload bytes: the row, then its scales little-endian."""
        if not self.quantized:
            return row.tobytes()
        return row.tobytes() + scale.astype(self.scale_dtype.newbyteorder("<")).tobytes()

    def from_bytes(self, buf: np.ndarray, hidden: int, x_dtype):
        """uint8 [P] payload bytes -> (row [H], scales [H / block] or None)."""
        dt = self.row_dtype(x_dtype)
        n = hidden * dt.itemsize
        row = np.frombuffer(buf[:n].tobytes(), dt)
        if not self.quantized:
            return row, None
        wire = self.scale_dtype.newbyteorder("<")
        nbytes = PAYLOAD_SCALE_BYTES[self.name] * (hidden // self.block)
        return row, np.frombuffer(buf[n:n + nbytes].tobytes(), wire).astype(self.scale_dtype)


TABLE = {
    None: Payload(None),
    "mxfp8": Payload("mxfp8", np.dtype(np.uint8), mxfp8.quantize_mxfp8, mxfp8.dequantize_mxfp8),
    "fp8_block128": Payload("fp8_block128", FLOAT32, fp8_block128.quantize_fp8_block128,
                            fp8_block128.dequantize_fp8_block128),
}
assert set(TABLE) == set(PAYLOAD_CODES), "abi.PAYLOAD_CODES and the payload table differ"
NAMES: Tuple[str, ...] = tuple(n for n in TABLE if n is not None)  # the valid payload= names


def get(name: Optional[str]) -> Payload:
    """The table's entry for a valid ``payload=`` value (validated by the caller)."""
    return TABLE[name]


def decode(name: str, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``q`` [T, H] E4M3 and its scales [T, H / block] -> [T, H] float32 under ``name``."""
    return TABLE[name].decode(q, scale)


def wire_rows(xs: Sequence[np.ndarray], name: Optional[str]) -> Tuple[List[np.ndarray], Optional[list]]:
    return TABLE[name].wire_rows(xs)
