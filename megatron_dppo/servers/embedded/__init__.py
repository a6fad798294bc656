"""The embedded SGLang-compatible rollout engine for CPU: see engine.py (EmbeddedEngine and its command line)."""
