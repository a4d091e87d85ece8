"""The command-line entry points: selfcheck and the README's main job."""

import argparse
import subprocess
import sys

import pytest

from decodejax import evidence


def test_selfcheck_command_passes():
    out = subprocess.run([sys.executable, "-m", "decodejax", "selfcheck"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "5 passed, 0 failed" in out.stdout


def test_readme_main_job_generates():
    out = subprocess.run([sys.executable, "-m", "decodejax", "generate", "--model", "tiny", "--prompt", "The decode phase",
                          "--max-new-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("The decode phase") and "8 tokens in" in out.stdout and "tokens/s" in out.stdout


def run_e2e_benchmark(tmp_path, *args) -> dict:
    """The end-to-end benchmark script on the tiny preset (float32, CPU) with `args`; its JSON. The
    replay's runs start without the pause that settles a GPU: on CPU it would only add 10 s a shape."""
    import json
    import os

    out = tmp_path / "e2e.json"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    run = subprocess.run([sys.executable, "-m", "benchmarks.e2e_decode", "--model", "tiny", "--context", "24", "--dtype", "float32",
                          "--replay-idle-s", "0", "--out", str(out), *args], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(out.read_text())


def test_e2e_benchmark_runs_on_a_tiny_model(tmp_path):
    """The end-to-end benchmark script, on CPU with the tiny preset (its GPU run is separate)."""
    result = run_e2e_benchmark(tmp_path, "--batch", "1,3", "--steps", "4", "--profile-steps", "1")
    rows = result["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 24), (3, 24)]
    assert all(len(r["step_ms_samples"]) == 4 and r["tokens_per_s"] > 0 and 0 < r["roofline_fraction"] for r in rows)
    assert all(len(r["replay_ms_samples"]) == 5 and r["replay_ms_median"] > 0 for r in rows) and result["replay_idle_s"] == 0
    # One traced engine step dispatches two decode steps (the engine keeps one in flight).
    assert all(r["profile"]["steps"] == 2 and r["profile"]["wall_ms_per_step_traced"] > 0 for r in rows)
    # The backends each bucket's step selected (on CPU: the XLA reference for decode attention).
    assert result["prefer_backends"] == [] and set(result["selected_backends"]) == {"1", "3"}
    assert all(["attention", "decode", "xla"] in chosen for chosen in result["selected_backends"].values())
    # The commit measured (this checkout's HEAD; on the GPU machine, DECODEJAX_SOURCE_COMMIT).
    assert result["source_commit"] == evidence.source_identity()["commit"] and len(result["source_commit"]) == 40


def test_e2e_benchmark_samples_with_top_p_when_asked(tmp_path):
    """`--top-p`: the seated requests sample (the steps add the sorting resample executable)."""
    result = run_e2e_benchmark(tmp_path, "--batch", "3", "--steps", "3", "--top-p", "0.9")
    assert result["sampling"] == {"top_p": 0.9}
    assert [len(r["step_ms_samples"]) for r in result["rows"]] == [3]


def test_e2e_benchmark_sets_xla_options_on_top_of_the_step_policy(tmp_path):
    """`--xla-option KEY=VALUE` (repeatable) adds compile options to every bucket's step, over the
    runner's policy or, with `--xla-defaults`, over none; the result records what each bucket got."""
    from benchmarks.e2e_decode import parse_xla_option
    from decodejax.runner import default_step_xla_options

    assert parse_xla_option("xla_gpu_enable_pdl=True") == ("xla_gpu_enable_pdl", True)
    assert parse_xla_option("xla_gpu_graph_min_graph_size=3") == ("xla_gpu_graph_min_graph_size", 3)
    assert parse_xla_option("xla_gpu_enable_command_buffer=FUSION") == ("xla_gpu_enable_command_buffer", "FUSION")
    for bad in ("xla_gpu_enable_pdl", "gpu_enable_pdl=true"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected xla_NAME=VALUE"):
            parse_xla_option(bad)
    over_policy = run_e2e_benchmark(tmp_path, "--batch", "3", "--steps", "1", "--xla-option", "xla_gpu_enable_pdl=false",
                                    "--xla-option", "xla_gpu_graph_min_graph_size=3")
    assert over_policy["step_xla_options"] == {"3": {**default_step_xla_options(3), "xla_gpu_enable_pdl": False,
                                                     "xla_gpu_graph_min_graph_size": 3}}
    over_none = run_e2e_benchmark(tmp_path, "--batch", "3", "--steps", "1", "--xla-defaults", "--xla-option", "xla_gpu_enable_pdl=true")
    assert over_none["step_xla_options"] == {"3": {"xla_gpu_enable_pdl": True}}
