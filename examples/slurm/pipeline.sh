#!/usr/bin/env bash
# Data → convert → train → export → evaluate, each stage a Slurm job step; run from the repository root on a login
# node. Called by examples/configs/*.sh, which set the variables below and pass the trainer's flags as arguments.
#
#   HF_CHECKPOINT   the base model: an HF folder, or a Hub name (Qwen/Qwen3-4B) each step reads from the Hugging
#                   Face cache (HF_HOME), downloading it there first where it is not     required
#   WORK_DIR        where data, checkpoints, exports, evaluations and logs go           required
#   DATA_DIR        where the data stage writes the built-in sets (default WORK_DIR/data)
#   TP, PP          trainer tensor / pipeline parallel sizes (default 1)
#   TRAINER_NODES, ROLLOUT_NODES, GPUS_PER_NODE (default 1, 1, 8), SGLANG_TP, ...  passed on to dppo.sbatch
#   EVAL_ARGS       flags of tools/evaluate.py (default: the six benchmarks, greedy, 1024 new tokens)
#   STAGES          which stages run (default "data convert train export evaluate")
#   SRUN_ARGS       extra flags of every srun, this script's and dppo.sbatch's, e.g. pyxis'
#                   "--container-image=megatron-dppo.sqsh --container-mounts=/data": every step runs in that container
#
# The data stage writes every built-in set as DATA_DIR/<set>.parquet (tools/prepare_data.py --skip-bad-rows: each
# set's rows and the bad ones left out are printed, and kept in LOG_DIR/data.log; a set with more than 1% bad rows,
# or one that cannot be fetched, stops the pipeline here, before any GPU node is asked for); the recipes train on
# those files. It reads each set's local copy
# (DPPO_DATA_DIR) or downloads its public source into the Hugging Face cache, where the evaluate stage, which reads
# the benchmarks by name, finds them again (HF_HOME on a file system every node mounts; else it downloads them).
# Data, convert and export are CPU steps; evaluate asks for one node's GPUS_PER_NODE GPUs (evaluate_node.sh starts
# one SGLang server on each). The steps get absolute paths: a container's working directory may differ.
#
# A stage whose output is complete is skipped, so re-running after a failure resumes: training restarts from
# WORK_DIR/checkpoints when it holds a checkpoint (see docs/multinode.md, "When something dies").
set -euo pipefail

: "${HF_CHECKPOINT:?set HF_CHECKPOINT to the base model directory (HF format)}"
: "${WORK_DIR:?set WORK_DIR to a directory on a file system every node mounts}"
TP=${TP:-1}
PP=${PP:-1}
# dppo.sbatch reads these too: one trainer and one rollout node of 8 GPUs unless told otherwise (its own default,
# ROLLOUT_NODES=0, would make the rollout node train)
export TRAINER_NODES=${TRAINER_NODES:-1} ROLLOUT_NODES=${ROLLOUT_NODES:-1} GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PYTHON=${PYTHON:-python3}
REPO=$PWD
read -r -a SRUN_EXTRA <<<"${SRUN_ARGS:-}"
STAGES=${STAGES:-data convert train export evaluate}
DATA_DIR=${DATA_DIR:-$WORK_DIR/data}
INIT_DIR=$WORK_DIR/megatron-init-tp$TP-pp$PP
SAVE_DIR=$WORK_DIR/checkpoints
HF_OUT=$WORK_DIR/hf-final
EVAL_DIR=$WORK_DIR/eval
export LOG_DIR=${LOG_DIR:-$WORK_DIR/logs}
export HF_CHECKPOINT PYTHON
mkdir -p "$WORK_DIR" "$LOG_DIR"

has_stage() {
    [[ " $STAGES " == *" $1 "* ]]
}

if has_stage data && [ ! -e "$DATA_DIR/.complete" ]; then
    echo "pipeline: the built-in data sets into $DATA_DIR (also in $LOG_DIR/data.log)"
    mkdir -p "$DATA_DIR"
    srun "${SRUN_EXTRA[@]}" --nodes=1 --ntasks=1 --job-name=dppo-data \
        "$PYTHON" "$REPO/tools/prepare_data.py" --out "$DATA_DIR" --skip-bad-rows 2>&1 | tee "$LOG_DIR/data.log"
    touch "$DATA_DIR/.complete"
fi

if has_stage convert && [ ! -e "$INIT_DIR/latest" ]; then
    echo "pipeline: HF -> Megatron (TP=$TP, PP=$PP) into $INIT_DIR"
    srun "${SRUN_EXTRA[@]}" --nodes=1 --ntasks=1 --job-name=dppo-convert --output="$LOG_DIR/convert.log" \
        "$PYTHON" "$REPO/tools/convert_hf_to_megatron.py" --hf-dir "$HF_CHECKPOINT" --out "$INIT_DIR" \
        --tp "$TP" --pp "$PP" --dtype bf16
fi

if has_stage train; then
    LOAD=$INIT_DIR
    if [ -e "$SAVE_DIR/latest" ]; then
        LOAD=$SAVE_DIR  # resume after a failure
    fi
    echo "pipeline: training from $LOAD, checkpoints in $SAVE_DIR"
    sbatch --wait --nodes=$((TRAINER_NODES + ROLLOUT_NODES)) --gpus-per-node="$GPUS_PER_NODE" \
        --job-name=dppo-train \
        --output="$LOG_DIR/train-%j.out" examples/slurm/dppo.sbatch \
        --hf-checkpoint "$HF_CHECKPOINT" --load "$LOAD" --save "$SAVE_DIR" \
        --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
        --log-dir "$WORK_DIR/metrics" "$@"
fi

if has_stage export && [ ! -e "$HF_OUT/config.json" ]; then
    echo "pipeline: Megatron -> HF into $HF_OUT"
    srun "${SRUN_EXTRA[@]}" --nodes=1 --ntasks=1 --job-name=dppo-export --output="$LOG_DIR/export.log" \
        "$PYTHON" "$REPO/tools/convert_megatron_to_hf.py" --megatron-dir "$SAVE_DIR" --out "$HF_OUT" \
        --tokenizer-dir "$HF_CHECKPOINT" --dtype bf16
fi

if has_stage evaluate; then
    echo "pipeline: evaluating $HF_OUT into $EVAL_DIR"
    read -r -a EXTRA_EVAL <<<"${EVAL_ARGS:-}"
    srun "${SRUN_EXTRA[@]}" --nodes=1 --ntasks=1 --gpus-per-node="$GPUS_PER_NODE" --job-name=dppo-eval \
        --output="$LOG_DIR/evaluate.log" \
        bash "$REPO/examples/slurm/evaluate_node.sh" "$HF_OUT" "$EVAL_DIR" "${EXTRA_EVAL[@]}"
    cat "$EVAL_DIR/results.md"
fi
