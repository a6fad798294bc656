#!/usr/bin/env bash
# Qwen3-4B on MATH with plain GRPO: the baseline of qwen3_4b_math_dppo.sh. Same layout, data, rollouts, optimiser and
# settings; only the pruning is off. See that file for what is [paper] and what is [inferred].
#
#   WORK_DIR=/scratch/qwen3-4b-grpo bash examples/configs/qwen3_4b_math_grpo.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${WORK_DIR:?set WORK_DIR to a directory on a file system every node mounts}"

# Settings: the values to edit (tests/test_recipes.py runs this file as written with small ones)
export HF_CHECKPOINT=${HF_CHECKPOINT:-Qwen/Qwen3-4B}
export TRAINER_NODES=${TRAINER_NODES:-1} ROLLOUT_NODES=${ROLLOUT_NODES:-1} GPUS_PER_NODE=${GPUS_PER_NODE:-8}
export SGLANG_TP=${SGLANG_TP:-1} TP=${TP:-1} PP=${PP:-1}
export SGLANG_ARGS=${SGLANG_ARGS---mem-fraction-static 0.85}
export EVAL_ARGS=${EVAL_ARGS:---k 1 --temperature 0 --max-new-tokens 1024 --apply-chat-template}
EPOCHS=${EPOCHS:-15}
BATCH_PROMPTS=${BATCH_PROMPTS:-128}
SAMPLES=${SAMPLES:-5}
RESPONSE_LEN=${RESPONSE_LEN:-1024}
TOKENS_PER_GPU=${TOKENS_PER_GPU:-16384}
EVAL_SIZE=${EVAL_SIZE:-500}
INTERVAL=${INTERVAL:-50}
MATH_TRAIN_PROMPTS=7500
TRAIN_ITERS=${TRAIN_ITERS:-$((EPOCHS * MATH_TRAIN_PROMPTS / BATCH_PROMPTS))}

DATA=${DATA_DIR:-$WORK_DIR/data}
ARGS=(
    --prompt-data "$DATA/math_train.parquet" --difficulty-key difficulty --reward-type math
    --eval-prompt-data math500 "$DATA/math500.parquet" amc23 "$DATA/amc23.parquet" aime24 "$DATA/aime24.parquet"
    --apply-chat-template
    --n-samples-per-prompt "$SAMPLES"
    --rollout-max-response-len "$RESPONSE_LEN"
    --rollout-batch-size "$BATCH_PROMPTS"
    --train-iters "$TRAIN_ITERS"
    --rollout-temperature 1.0
    --lr 1e-6 --lr-warmup-iters 10 --clip-grad 1.0 --weight-decay 0.0
    --bf16 --use-distributed-optimizer
    --max-tokens-per-gpu "$TOKENS_PER_GPU"
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1   # fits an 80 GB H100
    --save-interval "$INTERVAL" --eval-interval "$INTERVAL" --eval-size "$EVAL_SIZE"
    --algorithm grpo
    --advantage-estimator grpo --loss-agg-mode token-mean --eps-clip 0.2 --eps-clip-high 0.28
)
export DATA_DIR=$DATA
exec bash examples/slurm/pipeline.sh "${ARGS[@]}" "$@"
