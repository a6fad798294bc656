#!/usr/bin/env bash
# Qwen3-4B on MATH with DPPO (the paper's main setting), under Slurm: data → convert → train → export → evaluate.
#
#   WORK_DIR=/scratch/qwen3-4b-dppo bash examples/configs/qwen3_4b_math_dppo.sh
#
# [paper] = the DPPO paper as read second-hand (its abstract and reports of it: Qwen3-4B, MATH train,
#           5 rollouts per prompt, 1024-token responses, 15 epochs, 8 x H100, pass@1 on six math benchmarks).
# [inferred] = not reported by the paper (or not found): our choice. The paper's default pruning rates, batch size,
#           learning rate and the names of its six benchmarks were not found.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${WORK_DIR:?set WORK_DIR to a directory on a file system every node mounts}"

# Settings: the values to edit. tests/test_recipes.py runs this file as written with small ones (a tiny model under
# this Hub name, 2 CPU processes, the embedded engine, 2 steps).
export HF_CHECKPOINT=${HF_CHECKPOINT:-Qwen/Qwen3-4B}  # a Hub name (each step reads HF_HOME's copy) or a folder
# Layout [inferred]: one trainer node (8 GPUs, DP=8) and one rollout node (8 SGLang servers, TP=1);
# the paper ran on one 8 x H100 node [paper], which colocated training and generation.
export TRAINER_NODES=${TRAINER_NODES:-1} ROLLOUT_NODES=${ROLLOUT_NODES:-1} GPUS_PER_NODE=${GPUS_PER_NODE:-8}
export SGLANG_TP=${SGLANG_TP:-1} TP=${TP:-1} PP=${PP:-1}
export SGLANG_ARGS=${SGLANG_ARGS---mem-fraction-static 0.85}
export EVAL_ARGS=${EVAL_ARGS:---k 1 --temperature 0 --max-new-tokens 1024 --apply-chat-template}  # pass@1 [paper]; greedy [inferred]
EPOCHS=${EPOCHS:-15}                   # [paper]
BATCH_PROMPTS=${BATCH_PROMPTS:-128}    # prompts per RL step [inferred]
SAMPLES=${SAMPLES:-5}                  # rollouts per prompt [paper]
RESPONSE_LEN=${RESPONSE_LEN:-1024}     # [paper]
TOKENS_PER_GPU=${TOKENS_PER_GPU:-16384}  # the longest micro-batch [inferred]
EVAL_SIZE=${EVAL_SIZE:-500}            # problems of each held-out set [inferred]
INTERVAL=${INTERVAL:-50}               # steps between checkpoints, and between held-out evaluations [inferred]
MATH_TRAIN_PROMPTS=7500                # the MATH training split
TRAIN_ITERS=${TRAIN_ITERS:-$((EPOCHS * MATH_TRAIN_PROMPTS / BATCH_PROMPTS))}

DATA=${DATA_DIR:-$WORK_DIR/data}  # pipeline.sh's data stage writes the built-in sets there (tools/prepare_data.py)
ARGS=(
    --prompt-data "$DATA/math_train.parquet"     # MATH train [paper], the rows without a final answer left out
    --difficulty-key difficulty                  # MATH's level/subject: DPPO's prior for prompts not yet seen
    --reward-type math                           # math-verify [paper]
    --eval-prompt-data math500 "$DATA/math500.parquet" amc23 "$DATA/amc23.parquet" aime24 "$DATA/aime24.parquet"
    --apply-chat-template                        # Qwen3's own chat template around each problem
    --n-samples-per-prompt "$SAMPLES"
    --rollout-max-response-len "$RESPONSE_LEN"
    --rollout-batch-size "$BATCH_PROMPTS"
    --train-iters "$TRAIN_ITERS"
    --rollout-temperature 1.0                    # [inferred]
    --lr 1e-6 --lr-warmup-iters 10 --clip-grad 1.0 --weight-decay 0.0   # [inferred]
    --bf16 --use-distributed-optimizer
    --max-tokens-per-gpu "$TOKENS_PER_GPU"
    # Each layer keeps only its input and runs again in backward (slime's Qwen3-4B on 8 x H100 does too): the memory
    # plan (--dry-run) gives about 40 GiB per GPU with it, 126 GiB without (docs/actor.md, "The memory plan")
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    --save-interval "$INTERVAL" --eval-interval "$INTERVAL" --eval-size "$EVAL_SIZE"
    --algorithm dppo                             # GRPO + DPPO's prompt and completion pruning [paper]
    --advantage-estimator grpo --loss-agg-mode token-mean --eps-clip 0.2 --eps-clip-high 0.28
    --dppo-prompt-prune-rate 0.5 --dppo-completion-prune-rate 0.5   # rates <= 0.7 called moderate [paper]; 0.5 [inferred]
    --dppo-mode stochastic                       # the unbiased variant (docs/algorithms.md)
)
export DATA_DIR=$DATA
exec bash examples/slurm/pipeline.sh "${ARGS[@]}" "$@"
