"""bench/pruning_variance.py compares keep policies on items that carry gradient, at the kept fraction it names.

Its earlier batches were mostly zero-variance groups and its prompt level pruned nothing (the history had no rewards,
so nothing was predicted): every policy's error was 0 and the headline ratio 0.0000. These checks fail on such a
table. A small run (2 batches x 60 draws, a few seconds): the kept fractions' standard errors are about 0.005.
"""

import math

import pytest

import bench.pruning_variance as bench

pytestmark = pytest.mark.shared_data  # its batches are MATH training problems


@pytest.fixture(scope="module")
def rows():
    return bench.measure(batches=2, draws=60, seed=0)


def test_every_row_keeps_its_target_fraction_within_sampling_error(rows):
    for row in rows:
        tolerance = 4 * row.kept_se if row.stochastic else 1e-12
        assert abs(row.kept - row.target) <= tolerance, (
            f"{row.table} {row.pruner}: kept {row.kept:.4f} against the target {row.target} (SE {row.kept_se:.4f})")


def test_every_pruning_policy_pays_gradient_error_on_items_that_carry_gradient(rows):
    # a relative MSE near 0 means the pruned items carried no gradient: the comparison would say nothing
    for row in rows:
        assert row.relative_mse > 0.01, f"{row.table} {row.pruner} at {row.target}: MSE {row.relative_mse:.3e}"
    for table in ("main", "prompt"):
        mses = {row.relative_mse for row in rows if row.table == table and row.stochastic}
        assert len(mses) > 1, f"every stochastic policy of the {table} table has the same MSE"


def test_proportional_completion_keep_lowers_the_gradient_variance_at_equal_kept_fraction(rows):
    ratio = bench.headline(rows)
    assert math.isfinite(ratio) and 0.1 < ratio < 0.9, ratio
    for row in rows:
        if row.table == "main" and row.pruner == "dppo-proportional":
            assert row.mse_vs_uniform < 0.9, f"kept {row.target}: {row.mse_vs_uniform:.3f}"
