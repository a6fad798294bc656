"""The entry: from a command line to a running pipeline, and back to a summary.

    argv ─► arguments.py (the trainer's flags, each group checked) ─► run.py: parallel state, the model and the
    checkpoint, the task, the rollout servers (rollout/launcher), the weight-sync group, Trainer ─► metrics, summary
    launch_plan.py: what --dry-run prints (node roles, ranks, GPUs, server commands, the weight-sync group), no torch
    memory_plan.py: each trainer GPU's memory plan (--dry-run, and checked at a start on a GPU) and its flags, no torch
    colocated_sglang.py: a colocated SGLang server's share of a trainer GPU and the --mem-fraction-static it gets
    resume.py: where a run starts (its own latest checkpoint in --save, --load, or afresh) and --fresh-start
    embedded.py: what the no-argument CPU run builds first (tiny model, cached supervised warm start)
    rollout_correction_flags.py: one group of arguments.py's flags, in a module of its own (--rollout-correction)
    rollout_servers.py: one rollout server's GPUs from the flags, and the SGLang layouts that cannot take the weights

No other part of the package imports it: it is the top of the import graph (bench/ and tools/ use it as users do).
"""
