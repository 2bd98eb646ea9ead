"""Paths and names shared by the harness tests (imported as a top-level module: pytest puts
this directory on sys.path, tests/verify has no __init__.py)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
BROKEN = str(HERE / "broken_adapters.py")
MISBEHAVING = str(HERE / "pool_adapters.py")
PLAIN = "epkit.verify.adapters:plain_torch"
WORLD = 3
GATE = str(HERE / "gate_adapters.py")
TITAN = str(HERE / "titan_port.py")
ESCAPES = str(HERE / "escape_adapters.py")
