"""The command-line entry points: selfcheck and the README's main job."""

import subprocess
import sys


def test_selfcheck_command_passes():
    out = subprocess.run([sys.executable, "-m", "decodejax", "selfcheck"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "5 passed, 0 failed" in out.stdout


def test_readme_main_job_generates():
    out = subprocess.run([sys.executable, "-m", "decodejax", "generate", "--model", "tiny", "--prompt", "The decode phase",
                          "--max-new-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("The decode phase") and "8 tokens in" in out.stdout and "tokens/s" in out.stdout
