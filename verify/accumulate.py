"""The accumulation dtype of the bound, per dtype of the data summed.

A declaration maps the dtype of the data an implementation sums to the dtype it sums in:

- ``float32``: every sum in float32 (the default);
- ``native`` (or ``bfloat16``): every sum in the dtype of the data it sums: bfloat16 data in
  bfloat16, float16 data in float16, float32 data in float32 (a bfloat16 declaration never
  loosens a float32 case);
- ``bfloat16:bfloat16,float32:float32``: explicit, per dtype (a dtype left out: float32).

The data of a sum is bfloat16 when any array it reads or writes is (x, expert_y, a gradient,
the output): a sum of bfloat16 rows into a float32 output may be taken in either dtype; else
float16 when any is float16; else float32.
"""

from __future__ import annotations

__all__ = ["ACC_DTYPES", "accumulation_dtype", "describe_accumulate", "parse_accumulate"]

DATA_DTYPES = ("bfloat16", "float32", "float16")
ACC_DTYPES = ("bfloat16", "float32", "float64", "float16")
NATIVE = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}
USAGE = ("float32, native, bfloat16 or float16 (the same as native), or per dtype such as "
         "bfloat16:bfloat16,float32:float32")


def parse_accumulate(spec) -> dict | None:
    """A declaration (a string, a dict, or None) -> ``{data dtype: accumulation dtype}``, or
    None when ``spec`` is None. Raises ValueError naming what is wrong."""
    if spec is None:
        return None
    if isinstance(spec, dict):
        pairs = list(spec.items())
    else:
        text = str(spec).strip().lower()
        if text in ("native", "bfloat16", "float16"):
            return dict(NATIVE)
        if text in ACC_DTYPES:
            return {d: text for d in DATA_DTYPES}
        pairs = []
        for item in text.split(","):
            data, sep, acc = item.partition(":")
            if not sep:
                raise ValueError(f"accumulate: expected {USAGE}; got {spec!r}")
            pairs.append((data.strip(), acc.strip()))
    out = {d: "float32" for d in DATA_DTYPES}
    for data, acc in pairs:
        if data not in DATA_DTYPES:
            raise ValueError(f"accumulate: data dtype {data!r} is not one of "
                             f"{', '.join(DATA_DTYPES)} (in {spec!r})")
        if acc not in ACC_DTYPES:
            raise ValueError(f"accumulate: accumulation dtype {acc!r} is not one of "
                             f"{', '.join(ACC_DTYPES)} (in {spec!r})")
        out[data] = acc
    return out


def describe_accumulate(acc: dict | None) -> str:
    """The canonical text of a declaration: ``float32``, ``native`` or the per-dtype form."""
    if acc is None:
        return "float32"
    if len(set(acc.values())) == 1:
        return next(iter(acc.values()))
    if acc == NATIVE:
        return "native"
    return ",".join(f"{d}:{acc[d]}" for d in DATA_DTYPES if d != "float16" or acc[d] != "float32")


def accumulation_dtype(acc: dict | None, *dtypes) -> str:
    """The accumulation dtype of a sum that reads or writes arrays of ``dtypes``."""
    names = {str(d) for d in dtypes}
    data = next((d for d in ("bfloat16", "float16") if d in names), "float32")
    return (acc or {}).get(data, "float32")
