#!/usr/bin/env bash
# The GPU measurements behind benchmarks/results/, one stage per argument, from the repository
# root on the H200 machine (no install: PYTHONPATH=.). Results land in $OUT (default ./out).
#
#   bash benchmarks/run_h200.sh models e2e peer        # stages run in the order given
#
# Stages and the result files they produce:
#   lower     lowers every kernel for CUDA on this machine's jax (seconds; Mosaic GPU's layout
#             inference in jax 0.11 refuses forms that jax 0.10 on CPU lowers): run it first
#   evidence  python -m decodejax evidence (base decode call)       -> evidence_<digest>.json
#   sweep     the >= 10,000-row GPU correctness sweeps (Triton, Mosaic) per dtype -> gpu_sweep_<backend>_<dtype>.json
#   models    append-attention GPU tests, then the model parity and engine tests with the GPU kernels in the loop
#   kernel    FlashInfer (own process), then decodejax and the JAX peers -> fi.json, decode_attention.json
#             (KERNEL_CASES: comma-separated case names for both; KERNEL_ARGS: more benchmark flags)
#   e2e       llama3-8b engine decode, with a GPU-time profile per shape -> e2e_decode.json
#             (E2E_CONTEXTS, E2E_BATCHES: comma-separated contexts and batches for e2e and peer;
#             B 64 at T 8,192 needs E2E_POOL_TOKENS=530000, e.g. E2E_CONTEXTS=8192 E2E_BATCHES=64)
#   e2e_top_p the same with nucleus sampling (the steps add the sorting resample) -> e2e_decode_top_p.json
#   peer      transformers generate on the e2e shapes (own process) -> hf.json
#             (PEER_DEADLINE_S: shapes start until then; PEER_ARGS=--profile adds the GPU kernel time a step)
#   startup   capture time of fresh processes, cold then warm cache -> e2e_startup.json
#   engine_defaults Engine(model) with no config: what it picks, its capture and TTFT, in a fresh
#             process with an empty compilation cache, then again with it filled -> engine_defaults_{cold,warm}.json
#   l2_prefetch whether the B 1 o projection's weights read faster from L2, and whether a prefetch
#             beside the small kernels before it gets them there -> l2_prefetch.json
#   ncu       Nsight Compute counters of the Triton and Mosaic kernels on NCU_CASES -> ncu_decode.json, ncu_exports.tar.gz
# FlashInfer needs its wheels (../shared/tools/fetch_peer_wheels.sh): in .whl, or, since the
# FlashInfer wheel alone nearly fills a device call's 64 MiB, unzipped and packed as
# .whl_fi/fi_site.tar.xz (flashinfer_python + apache_tvm_ffi, 19 MB) beside the other wheels it
# needs (cuda_tile); the device call carries that folder. DECODEJAX_SOURCE_COMMIT names the
# commit sent (the copy's .git may lag).
set -euo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
E2E_POOL_TOKENS=${E2E_POOL_TOKENS:-270000}  # 35 GB of K/V for llama3-8b: fits beside the weights and compiles
E2E_CONTEXTS=${E2E_CONTEXTS:-2048,512,8192}  # the contexts of the e2e and peer stages, e.g. E2E_CONTEXTS=2048
E2E_BATCHES=${E2E_BATCHES:-1,8,32,64,128}  # their batches

for stage in "$@"; do
  echo "== $stage ($(date -u +%H:%M:%S))"
  case "$stage" in
    lower)
      python3 -m pytest -q -p no:cacheprovider tests/test_decode_attention.py -k "lower" ;;
    evidence)
      python3 -m decodejax evidence --shape 8,8192,32,8,128,16 --out "$OUT" ;;
    sweep)  # SWEEP_ONLY narrows it, e.g. SWEEP_ONLY=mosaic (the test ids name the backend and dtype)
      python3 -m pytest -m gpu tests/test_decode_attention_gpu.py -k "ten_thousand${SWEEP_ONLY:+ and $SWEEP_ONLY}" -q \
        -p no:cacheprovider ;;
    models)
      python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_append_attention.py tests/test_llama_hf.py tests/test_engine.py ;;
    kernel)
      if [ -f .whl_fi/fi_site.tar.xz ]; then  # the wheels unpacked and xz-packed: small enough to travel
        mkdir -p /tmp/site && tar -xJf .whl_fi/fi_site.tar.xz -C /tmp/site
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_fi/*.whl
      elif [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
      fi
      if [ -d /tmp/site/flashinfer ]; then
        PYTHONPATH=$PYTHONPATH:/tmp/site python3 -m benchmarks.peers.flashinfer_decode "$OUT/fi.json" ${KERNEL_CASES:-}
      fi
      peer=(); if [ -f "$OUT/fi.json" ]; then peer=(--flashinfer "$OUT/fi.json"); fi
      XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m benchmarks.decode_attention --out "$OUT/decode_attention.json" "${peer[@]}" \
        ${KERNEL_CASES:+--cases $KERNEL_CASES} ${KERNEL_ARGS:-} ;;  # e.g. KERNEL_ARGS=--no-sweep, KERNEL_CASES=B1_T32768,B8_T8192
    e2e)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 python3 -m benchmarks.e2e_decode --pool-tokens "$E2E_POOL_TOKENS" \
        --context "$E2E_CONTEXTS" --batch "$E2E_BATCHES" --profile-steps 3 --out "$OUT/e2e_decode.json" ;;
    e2e_top_p)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 python3 -m benchmarks.e2e_decode --pool-tokens "$E2E_POOL_TOKENS" \
        --context 2048 --top-p 0.9 --profile-steps 3 --out "$OUT/e2e_decode_top_p.json" ;;
    peer)  # 30 decode steps: with 10, the three timed calls at B 1, T 2,048 put its step 2.5 ms apart (forty-sixth session)
      python3 -m benchmarks.peers.hf_generate --context "$E2E_CONTEXTS" --batch "$E2E_BATCHES" --steps 30 --deadline-s "${PEER_DEADLINE_S:-400}" \
        --out "$OUT/hf.json" ${PEER_ARGS:-}  # e.g. PEER_ARGS=--profile
      if [ -f "$OUT/e2e_decode.json" ]; then  # the comparison, into the e2e result
        python3 -m benchmarks.e2e_decode --from-json "$OUT/e2e_decode.json" --peer-json "$OUT/hf.json" --out "$OUT/e2e_decode.json"
      fi ;;
    engine_defaults)
      cache=$(mktemp -d)
      for run in cold warm; do
        python3 -m benchmarks.engine_defaults --compilation-cache "$cache" --out "$OUT/engine_defaults_$run.json"
      done ;;
    startup)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 python3 -m benchmarks.e2e_decode --startup-only --out "$OUT/e2e_startup.json" ;;
    l2_prefetch)
      python3 -m benchmarks.l2_prefetch --out "$OUT/l2_prefetch.json" ;;
    ncu)
      mkdir -p "$OUT/ncu"
      export NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)}
      sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats
                --section WarpStateStats --section SchedulerStats)  # --set full (38 passes) took 100+ s a case, these ~110 s too
      for case in ${NCU_CASES:-B32_T4096 B128_T1024 B1_T32768 d64_B32_T4096}; do
        for backend in pallas_triton pallas_mosaic_gpu; do
          report="$OUT/ncu/$case.$backend"
          timeout 200 "$NCU" --clock-control none -k regex:decodejax --launch-skip 2 --launch-count 2 "${sections[@]}" -f \
            -o "$report" python3 -m benchmarks.ncu_decode run "$case" "$backend" > "$report.log" 2>&1 \
            || { echo "ncu $case $backend failed:"; tail -n 5 "$report.log"; continue; }
          { "$NCU" --import "$report.ncu-rep" --csv --page details > "$report.details.csv" &&
            "$NCU" --import "$report.ncu-rep" --csv --page raw > "$report.raw.csv"; } \
            || { echo "ncu could not read $report.ncu-rep"; rm -f "$report.details.csv"; }
        done
      done
      python3 -m benchmarks.ncu_decode summarize "$OUT/ncu_decode.json" $(ls "$OUT"/ncu/*.details.csv | sed 's/.details.csv$//')
      # a device call brings back at most 8 files: the exports and logs travel as one archive
      tar -czf "$OUT/ncu_exports.tar.gz" -C "$OUT" $(cd "$OUT" && ls ncu/*.csv ncu/*.log 2>/dev/null) && rm -rf "$OUT/ncu" ;;
    *)
      echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
