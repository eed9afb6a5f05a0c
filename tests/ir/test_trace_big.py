"""Issue #2 acceptance: tracing a model with more than 20 GB of float32 params needs < 1 GB RSS and < 30 s."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("leaves", ["spec", "meta"])
def test_trace_20gb_model_in_a_fresh_process(leaves):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = ROOT / "benchmarks" / "trace_20gb.py"
    cmd = [sys.executable, str(script), "--json", *(["--meta"] if leaves == "meta" else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["param_gb"] >= 20 and report["graph_param_gb"] == report["param_gb"]
    assert report["eqns"] >= 3 * 40
    assert report["peak_rss_mb"] < 1000, report
    assert report["trace_s"] < 30, report
