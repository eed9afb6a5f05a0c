"""The README's usage example runs as written, and its loss falls."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_usage_example_runs_and_learns(tmp_path):
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    code = code.replace("print(float(loss))", "print('LOSS', float(loss))\nprint('FIRST', first)")
    code = code.replace("state = None\n", "state = None\nfirst = float(step(local, x, y)[0])\n")
    script = tmp_path / "train.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    values = dict(line.split() for line in out.stdout.splitlines() if line.startswith(("LOSS", "FIRST")))
    assert float(values["LOSS"]) < 0.9 * float(values["FIRST"])
