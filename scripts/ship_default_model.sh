#!/usr/bin/env bash
# Evaluate the default checkpoint on the held-out test, export its shipped model dirs and run parity.
# Usage: bash scripts/ship_default_model.sh [CHECKPOINT] [CORPUS_DIR] [VERSION]   (needs `nmt-corpus --out data/corpus` first)
# VERSION defaults to train.json's shipped.version, else nmt-export's default (the best validation step).
set -euo pipefail
checkpoint=${1:-artifacts/de-en-small}
corpus=${2:-data/corpus}
test_tsv="$corpus/test.tsv"
version=${3:-$(python -c "import json, sys; print(json.load(open(sys.argv[1])).get('shipped', {}).get('version', ''))" "$checkpoint/train.json")}

# Best weights ship in float16 (nmt-train writes them so; this converts a checkpoint saved before that).
python -c "import sys; from model.checkpoint import load_checkpoint, save_weights; save_weights(load_checkpoint(sys.argv[1]).model, sys.argv[1], half=True)" "$checkpoint"
nmt-eval "$checkpoint" --test "$test_tsv" --beam 4 --record
nmt-eval "$checkpoint" --test "$test_tsv" --beam 1 --record
# The int8 dir keeps its self-attention cache in int8, scaled on what the model writes for the validation sources (never the test set).
for precision in fp32 int8; do
  calibration=()
  [ "$precision" = int8 ] && calibration=(--cache-calibration "$corpus/valid.tsv")
  nmt-export "$checkpoint" --out "$checkpoint/onnx-$precision" --precision "$precision" --parity-test "$test_tsv" ${version:+--model-version "$version"} \
    "${calibration[@]}"
done
du -sh "$checkpoint"/model.safetensors "$checkpoint"/onnx-*
git ls-files -co --exclude-standard "$checkpoint" | xargs du -cb | tail -1  # everything committed under the checkpoint dir (limit: 80 MB)
