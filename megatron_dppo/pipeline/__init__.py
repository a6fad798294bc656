"""The RL step, composed of the parts: what the trainer trains on, how a step runs, and how it is evaluated.

    tasks.py (prompt source + reward) ─► trainer.py, one method per phase:
        experience.py (rank 0: draw, prompt level, rollout, rewards, advantages, pruning; partial_rollouts.py when a
        draw spans steps) ─► packing.py (Dense Prompt Packing into THD micro-batches) ─► actor/ (forward, loss,
        optimizer step) ─► rollout/weight_sync.py (the new weights to the servers)
    evaluation.py: held-out benchmarks through the same rollout client

It imports the parts (actor/, algo/, rollout/, rewards/, data/) and the leaves, never launch/.
"""
