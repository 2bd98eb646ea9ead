"""scripts/exit_stress.py, the measurement docs/usage.md ("Troubleshooting") quotes: it counts an
abort at exit as one (SIGABRT under torchrun: ``exitcode: -6``), a plain failure as a failure,
and a clean run as neither; its table counts what ran, by program."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
spec = importlib.util.spec_from_file_location("exit_stress", os.path.join(ROOT, "scripts", "exit_stress.py"))
stress = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stress)


def test_outcomes_are_told_apart():
    aborted = stress.run_once("abort", "import os\nos.abort()\n")
    assert aborted["aborted"] and not aborted["failed"], aborted
    failed = stress.run_once("fail", "raise SystemExit(3)\n")
    assert failed["failed"] and not failed["aborted"], failed
    clean = stress.run_once("clean", "pass\n")
    assert not clean["failed"] and not clean["aborted"] and clean["rc"] == 0, clean


def test_programs_and_table(tmp_path):
    progs = stress.programs()
    names = list(progs)
    assert names[0].startswith("control") and names[1].startswith("control, the group kept")
    assert names[2].startswith("README.md:")
    assert len(names) >= 10 and all("init_process_group(" in c for c in progs.values())
    results = tmp_path / "r.jsonl"
    assert stress.main(["--only", "control (plain", "--control-runs", "1", "--load", "0", "--parallel", "1",
                        "--results", str(results)]) == 0
    done = results.read_text().splitlines()
    assert len(done) == 1
    # a second call with the same count runs nothing more (resumable)
    assert stress.main(["--only", "control (plain", "--control-runs", "1", "--load", "0",
                        "--results", str(results)]) == 0
    assert len(results.read_text().splitlines()) == 1
