"""The epkit command's help (defaults shown), `epkit version`, and the extension's first-build
notice (production/_build.py)."""

import os
import subprocess
import sys

import pytest

from epkit import _build
from epkit.tools import bench, cli, simulate


@pytest.mark.parametrize("module, defaults", [
    (bench, ["(default: 4)", "(default: 2048)", "(default: bfloat16)", "(default: 300.0)"]),
    (simulate, ["(default: 64)", "(default: 7168)", "(default: uniform)", "(default: 450.0)",
                "(default: 3.0)"]),
])
def test_help_shows_defaults(module, defaults, capsys):
    with pytest.raises(SystemExit):
        module.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for d in defaults:
        assert d in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_top_level_help_quotes_the_defaults(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "defaults: --world-size 4 --tokens 2048" in text
    assert "defaults: --ranks 64 --experts 256" in text


def test_bench_quick_help_states_a_duration():
    """The help's duration is docs/benchmarks.md's (issue 36: they had drifted apart; that the
    figure is no older than the command is tests/docs/test_doc_rules.py's check)."""
    import os
    import re

    said = re.search(r"measured: (\d+) s on 2 cores at a load of ([\d.]+) to ([\d.]+)",
                     bench.QUICK_DURATION)
    assert said, bench.QUICK_DURATION
    doc = open(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs",
                            "benchmarks.md")).read()
    quoted = re.search(r"epkit bench --quick --json out.json +# ([\d.]+) s wall at load "
                       r"([\d.]+) -> ([\d.]+)", doc)
    assert quoted, "docs/benchmarks.md quotes no --quick duration"
    assert round(float(quoted.group(1))) == int(said.group(1))
    assert [float(v) for v in quoted.groups()[1:]] == [float(v) for v in said.groups()[1:]]
    ap = bench.build_parser()
    quick = next(a for a in ap._actions if a.dest == "quick")
    assert bench.QUICK_DURATION in quick.help


def test_version_prints_torch_and_the_extension_build(capsys):
    import torch

    assert cli.main(["version"]) == 0
    text = capsys.readouterr().out
    assert f"torch {torch.__version__}" in text
    assert "CPU build" in text and _build.build_directory(_build.NAME) in text
    assert "cflags: -O3 -ffp-contract=off" in text and "loaded: yes" in text
    assert "kernels: CPU C++;" in text  # this process keeps the default EPKIT_KERNELS=cpp


def test_stale_sources(tmp_path):
    srcs = _build.sources()
    assert _build.stale_sources(str(tmp_path), "epkit_C") == srcs  # nothing built yet
    future, past = (2**31, 2**31), (1, 1)
    for p in srcs:
        obj = _build._object(str(tmp_path), p)
        open(obj, "wb").close()
        os.utime(obj, future)
    lib = tmp_path / "epkit_C.so"
    lib.write_bytes(b"")
    os.utime(lib, future)                  # newer than every source: cached, nothing said
    assert _build.stale_sources(str(tmp_path), "epkit_C") == []
    os.utime(lib, past)                    # the library is old but every object is current
    assert _build.stale_sources(str(tmp_path), "epkit_C") == []
    os.utime(_build._object(str(tmp_path), srcs[1]), past)
    assert _build.stale_sources(str(tmp_path), "epkit_C") == [srcs[1]]
    os.remove(_build._object(str(tmp_path), srcs[0]))
    assert _build.stale_sources(str(tmp_path), "epkit_C") == srcs[:2]


def test_build_notice_says_what_where_and_how_long(tmp_path, capsys):
    srcs = _build.sources()
    _build._announce(str(tmp_path), srcs)
    err = capsys.readouterr().err
    assert err.startswith("epkit: building the C++ extension (CPU kernels) in " + str(tmp_path))
    assert " s" in err and "\n" not in err      # one line, finished by the build's "done in"
    (tmp_path / _build._LAST_BUILD).write_text("6.0")
    _build._announce(str(tmp_path), srcs[:2])
    err = capsys.readouterr().err
    assert f"rebuilding 2 changed source(s) of {len(srcs)}" in err
    assert "about 12 s (as fast as the last build)" in err


def test_a_cached_extension_loads_silently():
    name = _build.NAME
    if _build.stale_sources(_build.build_directory(name), name):
        pytest.skip("the extension is being rebuilt (a source changed): nothing cached to test")
    run = subprocess.run([sys.executable, "-c", "import epkit.ops"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "epkit: building" not in run.stderr and "rebuilding" not in run.stderr


def test_one_notice_however_many_processes_wait(tmp_path):
    """Ranks importing epkit at once: the first to take the notice lock speaks, the rest wait
    silently (they would otherwise print the same line, interleaved)."""
    first = _build._notice_lock(str(tmp_path))
    assert first is not None and _build._notice_lock(str(tmp_path)) is None
    first.close()
    again = _build._notice_lock(str(tmp_path))
    assert again is not None
    again.close()
