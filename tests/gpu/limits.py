"""Time limits of the tests that need a CUDA GPU (tests/gpu), read by tools/gpu_check.py too, so that the check allows
each launch as much as the tests allow themselves."""

LAUNCH_TIMEOUT_S = 900  # one torchrun launch of the smoke run (its handler prints the run's log)
TEST_TIMEOUT_S = 1200  # pytest-timeout of a test, above its launch's
