"""megatron_dppo: GRPO-family RL with DPPO (dynamic pruning, importance-corrected, densely packed) on Megatron-Core.

The package reads in three layers; an arrow is "imports", and no two parts import each other
(tests/test_package_structure.py).

entry      examples/pretrain_dppo.py ─► launch/: arguments.py (the flags, checked) ─► run.py (starts and stops
           everything); launch_plan.py (--dry-run: nodes, ranks, servers); embedded.py (the no-argument CPU default)

pipeline   pipeline/: tasks.py (prompt source + reward) ─► trainer.py, one RL step, a method per phase:
             experience.py (rank 0: prompt draw ─► algo/ prompt level ─► rollout/ client ─► rewards/ ─► algo/
             advantages and completion pruning; partial_rollouts.py when chunks span steps)
             ─► packing.py (Dense Prompt Packing into THD micro-batches) ─► actor/ (Megatron-Core model, fused
             log-probs, loss, optimizer, checkpoints) ─► rollout/weight_sync.py (new weights to the servers)
           evaluation.py (benchmarks through the same client)

servers    servers/embedded/ (the SGLang-compatible CPU engine), servers/vllm_extension.py (runs inside vLLM): what
           runs in a rollout server's process; the trainer reaches them over HTTP and the weight-update group only

leaves     flags.py (domains, the parser), weight_update_protocol.py (what the syncer and the servers say to each
           other), metrics.py (the per-step log, its reader and curves), hub.py (Hub names to local snapshots),
           answers.py, errors.py, convert/ (HF <-> Megatron tables), platform/ (device, collectives, processes),
           data/ (prompts, tokenizers, the built-in sets' public sources)
"""
