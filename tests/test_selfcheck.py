"""`python -m decodejax selfcheck` recomputes every seed fixture and passes."""

import subprocess
import sys


def test_selfcheck_command_passes():
    out = subprocess.run([sys.executable, "-m", "decodejax", "selfcheck"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "5 passed, 0 failed" in out.stdout
