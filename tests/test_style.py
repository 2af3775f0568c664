"""The code's style, as CI checks it: pyflakes' and pycodestyle's errors and warnings at 120 columns."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F,E,W",
                          "--line-length", "120", "pyhipa2a", "tests", "scripts"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
