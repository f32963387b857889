#!/usr/bin/env bash
# Stages of gpu-checks.sh side by side on one GPU, after `gpu-checks.sh PARTS OUT install`:
#   DEADLINE_S=520 bash tools/gpu-host/parallel-stages.sh PARTS_DIR OUT_DIR TARBALL STAGE...
# The tiny models' engines take 10% of an H200's memory each (glm5_generate.py's default), so
# several stages fit at once; each gets OUT_DIR/<stage>/ and its own pytest basetemp, and
# starts STAGGER_S after the one before (stages that install the capability hook do not
# race). A stage still running after DEADLINE_S is stopped (its process group), so that the
# call ends before the device tool's limit; OUT_DIR is packed into TARBALL (e.g. in the
# tool's $OUT) every 20 s and at the end, so a call cut short still brings back what ran.
# Timings of stages run side by side share the GPU: run benchmarks alone.
set -uo pipefail
parts="${1:?parts dir}"; out="${2:?out dir}"; tarball="${3:?tarball}"; shift 3
here="$(cd "$(dirname "$0")/../.." && pwd)"
mkdir -p "$out"
pack() { tar czf "$tarball.tmp" -C "$(dirname "$out")" "$(basename "$out")" && mv "$tarball.tmp" "$tarball"; }
start=$SECONDS
pids=()
for stage in "$@"; do
  mkdir -p "$out/$stage"
  PYTEST_ADDOPTS="--basetemp=/tmp/basetemp-$stage" setsid bash "$here/tools/gpu-host/gpu-checks.sh" \
    "$parts" "$out/$stage" "$stage" > "$out/$stage.log" 2>&1 &
  pids+=("$!")
  sleep "${STAGGER_S:-5}"
done
( while sleep 20; do pack; done ) &
packer=$!
for i in "${!pids[@]}"; do
  while kill -0 "${pids[$i]}" 2>/dev/null; do
    if (( SECONDS - start > ${DEADLINE_S:-520} )); then
      echo "[parallel] $(( SECONDS - start )) s: stopping stage ${*:$((i + 1)):1}" >> "$out/parallel.log"
      kill -TERM -- "-${pids[$i]}" 2>/dev/null; sleep 2; kill -KILL -- "-${pids[$i]}" 2>/dev/null
    fi
    sleep 2
  done
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
kill "$packer" 2>/dev/null
pack
for stage in "$@"; do echo "== $stage"; tail -n 6 "$out/$stage.log"; done
cat "$out/parallel.log" 2>/dev/null
exit $rc
