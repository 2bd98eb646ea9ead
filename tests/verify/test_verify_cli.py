"""``epkit verify`` / ``python -m epkit.verify``: report, table, closing line, exit status."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from epkit.verify.cli import main
from verify_testlib import BROKEN, PLAIN

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _last_line(text):
    return text.strip().splitlines()[-1]


def test_plain_torch_run_passes_with_table_json_and_closing_line(tmp_path, capsys):
    out_json = tmp_path / "r.json"
    rc = main(["--world-size", "2", "--examples", "4", "--impl", PLAIN, "--seed", "3",
               "--no-progress", "--json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0, text
    last = _last_line(text)
    n = int(last.split()[0])
    assert last == f"{n} passed, 0 failed" and n >= 32
    assert "mode" in text and "dispatch_backward" in text and "padded" in text
    data = json.loads(out_json.read_text())
    assert data["failed"] == 0 and data["passed"] == n and data["seed"] == 3
    corners = data["modes"]["ragged"]["corner_cases"]
    assert corners >= 4 and data["modes"]["padded"]["corner_cases"] == corners
    assert data["results"]["ragged"]["combine"]["passed"] == 4 + corners
    assert data["results"]["padded"]["dispatch"]["passed"] == 4 + corners
    # which of epkit's kernels served, in the summary and the JSON (the C++ ones here)
    assert "epkit's kernels: C++ (CPU)" in text and data["kernels"] == "C++ (CPU)"


def test_a_broken_impl_exits_non_zero_with_a_report(capsys):
    rc = main(["--world-size", "2", "--examples", "30", "--impl", f"{BROKEN}:weight_twice",
               "--seed", "5", "--no-progress", "--shrink-seconds", "2"])
    text = capsys.readouterr().out
    assert rc == 1
    assert "FAILED" in text and "worst difference at" in text and "replay(Case(" in text
    assert "rerun the mode: python -m epkit.verify --impl" in text and "--seed 5" in text
    assert _last_line(text).endswith(" failed") and not _last_line(text).endswith(" 0 failed")


def test_modes_are_listed_and_filtered(capsys):
    assert main(["--list-modes"]) == 0
    names = capsys.readouterr().out.split()
    assert len(names) == 40 and "pairs/static/mxfp8" in names and "dedup/auto/fp8_block128" in names
    assert "hier/equal" in names
    assert main(["--list-modes", "--modes", "dedup/*,*/lazy/mxfp8", "--modes", "pairs/equal"]) == 0
    picked = capsys.readouterr().out.split()
    assert picked == [n for n in names if n.startswith("dedup/") or n.endswith("/lazy/mxfp8")
                      or n == "pairs/equal"]
    assert len(picked) == 6 * 3 + 2
    assert main(["--modes", "nothing/*"]) == 2


def test_nccl_outside_torchrun_says_how_to_launch(capsys, monkeypatch):
    for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    assert main(["--backend", "nccl", "--impl", PLAIN]) == 2
    assert "torchrun" in capsys.readouterr().err


def test_python_dash_m_off_a_terminal_writes_plain_progress_lines():
    """stderr a pipe (a CI log): no bar, so no carriage return anywhere; one line per mode."""
    proc = subprocess.run(
        [sys.executable, "-m", "epkit.verify", "--world-size", "2", "--examples", "3",
         "--impl", PLAIN, "--seed", "1"],
        capture_output=True, timeout=300, env=ENV)  # bytes: text mode would turn \r into \n
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, out + err
    assert _last_line(out).endswith("passed, 0 failed")
    assert "\r" not in out + err
    lines = [ln for ln in err.splitlines() if ln.startswith("epkit verify: mode ")]
    assert len(lines) == 2 and lines[-1].startswith("epkit verify: mode padded passed (2/2, ")


def test_on_a_terminal_the_bar_is_drawn_instead_of_mode_lines(monkeypatch, capsys):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    rc = main(["--world-size", "2", "--examples", "3", "--impl", PLAIN, "--seed", "1"])
    assert rc == 0, capsys.readouterr().out
    assert "\r" in err.getvalue() and "epkit verify: mode " not in err.getvalue()


def test_torchrun_drives_from_rank_0_and_the_others_serve():
    """The torchrun path (the one NCCL uses) on CPU: every process is a rank, rank 0 draws,
    broadcasts and checks; the others serve until told to stop."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "-m", "epkit.verify", "--backend", "gloo", "--impl", PLAIN, "--examples", "4",
         "--seed", "2", "--no-progress"],
        capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "world size 2 (gloo)" in proc.stdout
    assert _last_line(proc.stdout).endswith("passed, 0 failed")


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_nccl_under_torchrun():
    import torch

    n = min(torch.cuda.device_count(), 2)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(n), "-m", "epkit.verify", "--backend", "nccl", "--impl", PLAIN, "--examples",
         "5", "--seed", "4", "--no-progress"],
        capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"world size {n} (nccl)" in proc.stdout
    assert _last_line(proc.stdout).endswith("passed, 0 failed")


def test_contract_supports_and_junit_xml(tmp_path, capsys):
    import xml.etree.ElementTree as ET

    from verify_testlib import GATE

    xml_path = tmp_path / "v.xml"
    rc = main(["--world-size", "2", "--examples", "6", "--impl", f"{GATE}:false_green",
               "--supports", "capacity=no", "--contract", "bounded", "--seed", "2",
               "--no-progress", "--shrink-seconds", "1", "--junit-xml", str(xml_path)])
    text = capsys.readouterr().out
    assert rc == 1 and "contract bounded, accumulate float32" in text
    assert "; capabilities: capacity=no" in text
    suite = ET.parse(xml_path).getroot()
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert set(cases) == {"dispatch", "dispatch_backward", "combine", "combine_backward",
                          "weight_grad"}
    assert cases["combine"].find("failure") is not None
    assert cases["dispatch"].find("failure") is None
    assert int(suite.get("failures")) >= 1
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["kernels"] == "C++ (CPU)"
    assert main(["--supports", "capacity=perhaps", "--impl", PLAIN]) == 2


def test_the_kernels_that_serve_are_named(monkeypatch):
    """C++ on CPU by default, Triton interpreted with --kernels triton on a machine without a
    GPU (this one, or TRITON_INTERPRET=1), Triton compiled over NCCL, with Triton's version."""
    from importlib import metadata

    from epkit.verify.kernels import kernels_served

    monkeypatch.delenv("EPKIT_KERNELS", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    version = metadata.version("triton")
    assert kernels_served("gloo") == "C++ (CPU)"
    assert kernels_served("gloo", "triton") == f"Triton {version}, interpreted (CPU)"
    monkeypatch.setenv("EPKIT_KERNELS", "triton")
    assert kernels_served("gloo") == f"Triton {version}, interpreted (CPU)"
    assert kernels_served("nccl") == f"Triton {version}, compiled (CUDA)"


def test_a_short_mode_exits_1_with_a_one_line_reason(capsys):
    from verify_testlib import MISBEHAVING

    rc = main(["--world-size", "2", "--examples", "4", "--impl",
               f"{MISBEHAVING}:combine_not_implemented",
               "--seed", "1", "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 1
    assert "default: FAILED: only 0 of " in text and " examples checked for combine: " in text
    assert "refused (combine: NotImplementedError: combine: not yet)" in text
    assert not _last_line(text).endswith(" 0 failed")


@pytest.mark.parametrize("argv", [
    ["--impl", "nosuchmodule:make"],
    ["--impl", "tests/verify/broken_adapters.py:nosuch"],
    ["--impl", "tests/verify/broken_adapters.py"],
    ["--impl", "no/such/file.py:make"],
    ["--world-size", "0"],
    ["--examples", "-1"],
    ["--timeout", "zero"],
    ["--accumulate", "float8"],
    ["--max-hidden", "0"],
    ["--supports", "capacity=perhaps"],
])
def test_usage_errors_are_one_line_and_exit_2(argv):
    proc = subprocess.run([sys.executable, "-m", "epkit.verify", *argv, "--list-modes"],
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 2, (argv, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("epkit verify: ") and "_epkit_verify_impl_" not in lines[0]


def test_reports_record_the_run_and_nothing_lands_in_the_current_directory(
        tmp_path, monkeypatch, capsys):
    import xml.etree.ElementTree as ET

    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("HYPOTHESIS_STORAGE_DIRECTORY", raising=False)
    out = tmp_path / "out"
    out.mkdir()
    rc = main(["--world-size", "2", "--examples", "2", "--impl", PLAIN, "--seed", "4",
               "--modes", "ragged", "--contract", "bounded", "--accumulate", "native",
               "--supports", "capacity=no", "--no-progress", "--json", str(out / "r.json"),
               "--junit-xml", str(out / "r.xml")])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert list(work.iterdir()) == [], list(work.iterdir())
    assert "accumulate native" in text and "invalid inputs not checked" in text
    props = {p.get("name"): p.get("value")
             for p in ET.parse(out / "r.xml").getroot().iter("property")}
    assert props["contract"] == "bounded" and props["accumulate"] == "native"
    assert props["seed"] == "4" and props["examples"] == "2" and props["world_size"] == "2"
    assert "capacity=no" in props["capabilities"] and props["check_errors"] == "False"
    assert props["world_sizes_checked"] == "1,2"
    data = json.loads((out / "r.json").read_text())
    assert data["accumulate"] == "native" and data["world_sizes_checked"] == [1, 2]
    assert data["modes"]["ragged"]["capabilities"] == "capacity=no"
