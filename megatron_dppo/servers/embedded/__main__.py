"""python -m megatron_dppo.servers.embedded --model-dir DIR [flags]: serve the embedded engine (engine.py)."""

from megatron_dppo.servers.embedded.engine import main

main()
