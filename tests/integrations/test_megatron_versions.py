"""The Megatron-Core comparisons (test_megatron.py) against the previous pin as well.

The set-up installs megatron-core 0.19.2 into the environment and 0.16.1, the newest release
that declares Python 3.11, into ``.venv/megatron-core-0.16.1`` (the Makefile says why). This
runs test_megatron.py's float32 cases again with that folder first on the path, so an
integration change that only works on the newest Megatron fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is a test dependency (epkit[frameworks])")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
OLD = os.path.join(os.path.dirname(os.path.dirname(sys.executable)), "megatron-core-0.16.1")


def _env():
    if not os.path.isdir(OLD):
        pytest.fail(f"{OLD} is missing: `make setup` installs megatron-core 0.16.1 there")
    return dict(os.environ, PYTHONPATH=OLD + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _version(env) -> str:
    code = "import importlib.metadata as m; print(m.version('megatron-core'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_both_versions_are_installed():
    import importlib.metadata as m

    assert m.version("megatron-core") == "0.19.2"
    assert _version(_env()) == "0.16.1"


def test_megatron_layer_on_0_16_1():
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                        "tests/integrations/test_megatron.py", "-k", "float32_bitwise"],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert re.search(r"\b6 passed", p.stdout), p.stdout[-2000:]


def test_megatron_example_on_0_16_1():
    from test_examples import run_example

    out = run_example("megatron_cpu.py", env=_env())
    said = re.findall(r"rank (\d): megatron-core 0\.16\.1, \d+ tensors compared with "
                      r"Megatron's own dispatcher: all bit for bit equal", out)
    assert sorted(said) == ["0", "1"], out[-3000:]
