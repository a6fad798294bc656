#!/usr/bin/env bash
# Qwen3-4B on MATH with plain GRPO: the baseline of qwen3_4b_math_dppo.sh. Same layout, data, rollouts and
# optimiser; only the pruning is off. See that file for what is [paper] and what is [inferred].
#
#   HF_CHECKPOINT=/models/Qwen3-4B WORK_DIR=/scratch/qwen3-4b-grpo bash examples/configs/qwen3_4b_math_grpo.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

export TRAINER_NODES=${TRAINER_NODES:-1} ROLLOUT_NODES=${ROLLOUT_NODES:-1} GPUS_PER_NODE=${GPUS_PER_NODE:-8}
export SGLANG_TP=${SGLANG_TP:-1} TP=${TP:-1} PP=${PP:-1}
export SGLANG_ARGS=${SGLANG_ARGS:---mem-fraction-static 0.85}
export EVAL_ARGS=${EVAL_ARGS:-"--k 1 --temperature 0 --max-new-tokens 1024 --apply-chat-template --apply-chat-template-kwargs {\"enable_thinking\":false}"}

MATH_TRAIN_PROMPTS=7500
EPOCHS=15
BATCH_PROMPTS=128
TRAIN_ITERS=$((EPOCHS * MATH_TRAIN_PROMPTS / BATCH_PROMPTS))

ARGS=(
    --prompt-data math --apply-chat-template
    --apply-chat-template-kwargs '{"enable_thinking":false}'   # Qwen3 without thinking, as the DPPO recipe
    --n-samples-per-prompt 5
    --rollout-max-response-len 1024
    --rollout-batch-size "$BATCH_PROMPTS"
    --train-iters "$TRAIN_ITERS"
    --rollout-temperature 1.0
    --lr 1e-6 --lr-warmup-iters 10 --clip-grad 1.0 --weight-decay 0.0
    --bf16 --use-distributed-optimizer
    --max-tokens-per-gpu 16384
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1   # fits an 80 GB H100
    --save-interval 50 --eval-interval 50 --eval-size 500
    --algorithm grpo
    --advantage-estimator grpo --loss-agg-mode token-mean --eps-clip 0.2 --eps-clip-high 0.28
)
exec bash examples/slurm/pipeline.sh "${ARGS[@]}" "$@"
