"""Evidence bundles (ladder levels bounded by their fields) and the comparison estimators."""

import copy
import json
import subprocess
import sys

import numpy as np
import pytest

from decodejax import evidence


@pytest.fixture(scope="module")
def bundle():
    return evidence.collect((2, 64, 8, 2, 64, 16), samples=20)


def test_bundle_binds_key_selection_correctness_and_samples(bundle):
    assert bundle["selection"]["digest"] == bundle["digest"] and len(bundle["digest"]) == 64
    assert bundle["selection"]["selected"] == "xla"  # on this CPU machine
    assert any(c["backend"] == "pallas_triton_interpret" for c in bundle["selection"]["candidates"])
    assert bundle["correctness"]["passed"] and bundle["correctness"]["tolerances"]["o_abs"] == 2e-2
    t = bundle["timing"]
    assert len(t["samples_us"]) >= 20 and t["min_us"] <= t["median_us"] <= t["p95_us"] <= t["max_us"]
    assert bundle["loaded_artifacts"] and all(len(a["sha256"]) == 64 for a in bundle["loaded_artifacts"])
    assert all(c["present"] for c in bundle["source"]["chain"])
    json.dumps(bundle)  # serializable


def test_level_never_exceeds_what_the_fields_support(bundle):
    # The XLA backend has no named kernel: no execution evidence, so the ladder stops at 4.
    assert bundle["execution"]["compiled_has_kernel"] is False
    assert evidence.evidence_level(bundle) == bundle["evidence_level"] == 4
    forged = copy.deepcopy(bundle)
    forged["execution"] = {"compiled_has_kernel": True, "profile": {"names_kernel": True}}
    assert evidence.evidence_level(forged) == 6  # measured, correct and now "executed"
    forged["correctness"]["passed"] = False
    assert evidence.evidence_level(forged) == 5
    forged["selection"]["digest"] = "0" * 64  # selection not bound to this key
    assert evidence.evidence_level(forged) == 3
    forged["loaded_artifacts"] = []
    assert evidence.evidence_level(forged) == 2


def test_estimators_answer_different_questions():
    base = {"a": 100.0, "b": 10.0}
    cand = {"a": 50.0, "b": 20.0}  # 2x faster on a, 2x slower on b
    est = evidence.ratio_estimators(base, cand)
    assert est["ratios"] == {"a": 2.0, "b": 0.5}
    assert est["arithmetic_mean_of_ratios"] == 1.25
    assert est["geometric_mean"] == pytest.approx(1.0)
    assert est["ratio_of_sums"] == pytest.approx(110 / 70)
    assert est["max"] == 2.0


def test_rows_that_differ_in_a_comparability_field_are_not_ranked():
    row = {"case": "x", "scope": "kernel", "phase": "decode", "metric": "latency", "gpu": "H200", "precision": "bf16", "workload": "w", "statistic": "median", "median_us": 1.0}
    other = dict(row, gpu="H100", statistic="min", median_us=2.0)
    with pytest.raises(evidence.NotComparable, match="gpu: 'H200' vs 'H100'; statistic: 'median' vs 'min'"):
        evidence.compare([row], [other])
    assert evidence.compare([row], [dict(row, median_us=0.5)])["max"] == 2.0


def test_evidence_cli_writes_a_bundle(tmp_path):
    out = subprocess.run([sys.executable, "-m", "decodejax", "evidence", "--shape", "1,32,4,4,64,8", "--out", str(tmp_path), "--samples", "20"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    files = list(tmp_path.glob("evidence_*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["evidence_level"] == 4


def test_source_commit_comes_from_git_or_a_named_variable(monkeypatch):
    assert evidence.source_identity()["commit_from"] == "git"

    def no_git(*args, **kwargs):
        raise OSError("git: not found")

    monkeypatch.setattr(evidence.subprocess, "run", no_git)
    monkeypatch.delenv("DECODEJAX_SOURCE_COMMIT", raising=False)
    assert evidence.source_identity()["commit"] is None  # no claim without a source: level 0
    monkeypatch.setenv("DECODEJAX_SOURCE_COMMIT", "a" * 40)
    ident = evidence.source_identity()
    assert ident["commit"] == "a" * 40 and ident["commit_from"] == "DECODEJAX_SOURCE_COMMIT"


def test_committed_h200_bundle_reaches_the_top_and_matches_its_source():
    """The bundle produced on the H200 (issue 4): level 6, and its source hashes are the commit's files."""
    import glob
    import hashlib
    import os

    paths = glob.glob(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "evidence_*.json"))
    assert paths, "no committed evidence bundle"
    for path in paths:
        with open(path) as f:
            b = json.load(f)
        assert b["evidence_level"] == evidence.evidence_level(b) == 6
        assert b["environment"]["device_platform"] == "gpu" and b["selection"]["selected"] == "pallas_triton"
        for link in b["source"]["chain"]:
            shown = subprocess.run(["git", "show", f"{b['source']['commit']}:{link['path']}"], capture_output=True, timeout=30)
            if shown.returncode:  # a shallow clone without that commit: the hash cannot be checked here
                pytest.skip(f"commit {b['source']['commit']} is not in this clone")
            assert hashlib.sha256(shown.stdout).hexdigest() == link["sha256"], link["path"]


def test_in_program_timing_keeps_every_call_and_runs_them_in_order():
    """A chained program keeps one call per copy after compilation (nothing merged or hoisted),
    each call sees bit-identical inputs, and the timing gives one figure per sample."""
    import jax.numpy as jnp

    def fn(x, w):
        return jnp.tanh(x @ w)

    x, w = jnp.arange(32.0).reshape(4, 8) / 7, jnp.ones((8, 2)) / 3
    program = evidence.chained_program(fn, 5)
    copies = evidence.distinct_copies(x, 5)
    assert len({c.unsafe_buffer_pointer() for c in copies}) == 5
    compiled = program.lower(copies, w).compile().as_text()
    assert compiled.count(" dot(") == 5, compiled
    outputs = program(copies, w)
    assert len(outputs) == 5 and all(np.array_equal(np.asarray(o), np.asarray(fn(x, w))) for o in outputs)
    samples = evidence.timed_samples_in_program(fn, (x, w), samples=3, calls=5, warmup=1, programs_per_sample=2)
    assert len(samples) == 3 and all(s > 0 for s in samples)


def test_interleaved_timing_takes_the_variants_samples_in_turns_and_drops_one_that_fails():
    """One sample of each variant per round, in the order given; a variant whose call raises
    leaves the rounds with its error, and the others keep all their samples."""
    import jax.numpy as jnp

    log = []

    def variant(name, fails_on_call=None):
        def fn(x):
            log.append(name)
            if fails_on_call is not None and log.count(name) == fails_on_call:
                raise RuntimeError(f"{name} failed")
            return x + 1

        return fn

    calls = {"a": (variant("a"), (jnp.ones(3),)), "b": (variant("b"), (jnp.ones(3),)),
             "c": (variant("c", fails_on_call=3), (jnp.ones(3),))}
    samples, errors = evidence.timed_samples_interleaved(calls, samples=3, reps=2, warmup=1)
    assert log == ["a", "b", "c"] + ["a", "a", "b", "b", "c", "c"] + ["a", "a", "b", "b"] * 2
    assert set(samples) == {"a", "b"} and all(len(v) == 3 and min(v) > 0 for v in samples.values())
    assert errors == {"c": "RuntimeError('c failed')"}
