#!/usr/bin/env bash
# Train the default model on a lent GPU: runs THERE, in the repo root, through the device tool's `run`
# (README, "Training on a GPU"). model/ needs only what that machine's image has (torch, tokenizers,
# safetensors, sacrebleu, tqdm), so nothing is installed.
#
# Usage: scripts/train_on_gpu.sh CHECKPOINT CORPUS MINUTES [nmt-train options...]
#   CHECKPOINT  the checkpoint dir to continue (artifacts/de-en-small), or - to start a new model
#               (then name it in the options: --preset base --dropout 0.3 --max-steps N --cooldown-steps M)
#   CORPUS      a dir with train.tsv and valid.tsv, carried (data/corpus)
#   MINUTES     training minutes of this call: a command may run 10 minutes, so keep it <= 8
# A second call on the same (still warm) machine resumes the run exactly from its last/ state.
# Writes to $OUT what may come back (at most 8 files of 16 MiB): train.json and train.log, the best
# validation's weights with config and tokenizer (best/), and the means of the newest 2 and 4 snapshots
# (avg2/, avg4/). Weights over 16 MiB (a model above ~8M parameters, stored in float16) do not come back.
set -euo pipefail

checkpoint=${1:?checkpoint dir} corpus=${2:?corpus dir} minutes=${3:?minutes}
shift 3
out=${OUT:?OUT is set by the device tool}
run=/tmp/gpu-run

resume=(--resume)
if [ ! -f "$run/last/trainer_state.pt" ]; then  # a first call: start from the committed weights, or from scratch
    rm -rf "$run" && mkdir -p "$run"
    if [ "$checkpoint" = "-" ]; then
        resume=()  # a new model: nmt-train trains its tokenizer on the corpus and initialises the weights
    else
        cp "$checkpoint"/{config.json,model.safetensors,tokenizer.json,train.json} "$run"/
    fi
fi
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi

# Options after these ("$@") win: `--device cpu` tries the script on a machine without a GPU.
status=0
PYTHONPATH=. python3 -m model.train --train "$corpus/train.tsv" --valid "$corpus/valid.tsv" --out "$run" "${resume[@]}" \
    --device cuda --max-minutes "$minutes" --keep-snapshots 6 "$@" >"$run/raw.log" 2>&1 || status=$?
# tqdm redraws its bar with carriage returns: keep the log's lines, show the validations and errors.
# A log line can follow a bar on the same line: cut the bar off it, then drop the bars.
tr '\r' '\n' <"$run/raw.log" | sed -E 's/^train:.*\](INFO|WARNING|ERROR)/\1/' | grep -av -e '^train:' -e '^[[:space:]]*$' >"$out/train.log" || true
tail -n 40 "$out/train.log"
if [ "$status" -ne 0 ]; then
    echo "nmt-train failed with exit status $status" >&2
    exit "$status"
fi

cp "$run/train.json" "$out/"
mkdir -p "$out/best"
cp "$run/model.safetensors" "$run/config.json" "$run/tokenizer.json" "$out/best/"  # a new model brings its own tokenizer
mapfile -t snapshots < <(ls -d "$run"/snapshots/step-* 2>/dev/null | sort)
for count in 2 4; do
    if [ "${#snapshots[@]}" -ge "$count" ]; then
        PYTHONPATH=. python3 -m model.average "$run" "${snapshots[@]: -$count}" --out "$run/avg$count"
        mkdir -p "$out/avg$count"
        cp "$run/avg$count/model.safetensors" "$out/avg$count/"
    fi
done
ls -la "$out" "$out"/*/
