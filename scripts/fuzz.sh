#!/usr/bin/env bash
# The coverage-guided fuzz targets (docs/security.md, "Fuzzing"): each runs under libFuzzer
# (cargo-fuzz, nightly Rust) for SECONDS (default 60), starting from its seed corpus
# `fuzz/corpus/<target>/` and a working corpus kept outside the repository, then one table:
# executions, coverage (libFuzzer's `cov` edges and `ft` features), the working corpus, the
# crashes (a crash, leak, timeout or out-of-memory input: the script fails) and the slow units
# (an input over 10 seconds), each one's input left in the artifacts folder. Extra arguments
# select targets by name.
#
#   bash scripts/fuzz.sh 600                    # every target for 10 minutes (2.5 hours)
#   MOULT_FUZZ_JOBS=2 bash scripts/fuzz.sh 600  # two at a time
#   bash scripts/fuzz.sh 60 tool_calls          # one target for a minute
#   bash scripts/fuzz.sh --properties 380       # the property tests instead (proptest)
#
# Needs the nightly toolchain and cargo-fuzz (`rustup toolchain install nightly; cargo install
# cargo-fuzz`). A crash's input replays with
#   MOULT_FUZZ_TARGET=<target> <the binary printed below> <artifact>
# and, once fixed, goes into fuzz/corpus/<target>/, which `cargo test` replays.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MOULT_ROOT"

if [ "${1:-}" = --properties ]; then
  # The property tests of runtime/tests/fuzz.rs and operator/tests/fuzz.rs on fresh random seeds.
  shift
  export MOULT_FUZZ_SECONDS="${1:-60}"
  shift || true
  status=0
  cargo test -p moult-runtime --test fuzz -- --nocapture "$@" || status=1
  cargo test -p moult-operator --test fuzz -- --nocapture "$@" || status=1
  exit "$status"
fi

SECONDS_EACH="${1:-60}"
shift || true
case "$SECONDS_EACH" in
  '' | *[!0-9]*) echo "fuzz: SECONDS must be a whole number of seconds, got '$SECONDS_EACH'" >&2; exit 2 ;;
esac
TARGETS=("$@")
if [ "${#TARGETS[@]}" = 0 ]; then
  mapfile -t TARGETS < <(ls fuzz/corpus)
fi
for t in "${TARGETS[@]}"; do
  [ -d "fuzz/corpus/$t" ] || { echo "fuzz: no target '$t' (one of: $(ls fuzz/corpus | tr '\n' ' '))" >&2; exit 2; }
done
cargo +nightly fuzz --version >/dev/null 2>&1 || {
  echo "fuzz: needs cargo-fuzz on the nightly toolchain: rustup toolchain install nightly && cargo install cargo-fuzz" >&2
  exit 1
}

# One instrumented build serves every target (MOULT_FUZZ_TARGET picks one). No sanitizer: the
# fuzzed code is Rust, memory-safe by construction; overflow checks and debug assertions are on.
echo "fuzz: building the instrumented binary (release, debug assertions)"
cargo +nightly fuzz build --fuzz-dir fuzz --features libfuzzer --sanitizer none --debug-assertions moult-fuzz
BIN="${CARGO_TARGET_DIR:-$MOULT_ROOT/target}/x86_64-unknown-linux-gnu/release/moult-fuzz"
[ -x "$BIN" ] || BIN="fuzz/target/x86_64-unknown-linux-gnu/release/moult-fuzz"
echo "fuzz: binary $BIN"

WORK="${MOULT_FUZZ_WORK:-$HOME/.cache/moult/fuzz}"
JOBS="${MOULT_FUZZ_JOBS:-1}"
echo "fuzz: ${#TARGETS[@]} targets, ${SECONDS_EACH}s each, $JOBS at a time; corpora, logs and crashes in $WORK"

# fuzz_one TARGET: one libFuzzer run, its log in $WORK/logs/TARGET.log.
fuzz_one() {
  local t="$1"
  mkdir -p "$WORK/corpus/$t" "$WORK/artifacts/$t" "$WORK/logs"
  touch "$WORK/artifacts/$t/.started" # crashes of earlier runs stay, and are not counted
  # The seed corpus is read, never written: new inputs go to the working corpus.
  MOULT_FUZZ_TARGET="$t" "$BIN" "$WORK/corpus/$t" "fuzz/corpus/$t" \
    -max_total_time="$SECONDS_EACH" -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$WORK/artifacts/$t/" >"$WORK/logs/$t.log" 2>&1 || true
  echo "fuzz: $t done"
}
running=0
for t in "${TARGETS[@]}"; do
  fuzz_one "$t" &
  running=$((running + 1))
  if [ "$running" -ge "$JOBS" ]; then
    wait -n || true
    running=$((running - 1))
  fi
done
wait

status=0
printf '\n| %-20s | %12s | %8s | %6s | %7s | %7s | %7s | %5s |\n' target executions "exec/s" cov ft corpus crashes slow
printf '| %-20s | %12s | %8s | %6s | %7s | %7s | %7s | %5s |\n' --- ---: ---: ---: ---: ---: ---: ---:
for t in "${TARGETS[@]}"; do
  log="$WORK/logs/$t.log"
  execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)"
  rate="$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)"
  last="$(grep -E '^#[0-9]+.*cov: ' "$log" | tail -n 1 || true)"
  cov="$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")"
  ft="$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")"
  corpus="$(find "$WORK/corpus/$t" -type f | wc -l)"
  # Crashes, leaks, timeouts and out-of-memory inputs fail the run; slow units (an input over 10
  # seconds: a denial of service, or a loaded machine) are counted for a look.
  found() { find "$WORK/artifacts/$t" -type f -newer "$WORK/artifacts/$t/.started" "$@" | wc -l; }
  crashes="$(found ! -name 'slow-unit-*')"
  slow="$(found -name 'slow-unit-*')"
  [ "$crashes" = 0 ] && [ -n "$execs" ] || status=1
  printf '| %-20s | %12s | %8s | %6s | %7s | %7s | %7s | %5s |\n' "\`$t\`" "${execs:-?}" "${rate:-?}" \
    "${cov:-?}" "${ft:-?}" "$corpus" "$crashes" "$slow"
done
if [ "$status" != 0 ]; then
  echo "fuzz: a target crashed or did not run: its log is in $WORK/logs, its input in $WORK/artifacts" >&2
fi
exit "$status"
