"""Sampling designs: which items a level keeps, given each item's inclusion probability π_i. Whatever the design, item
i is kept with probability exactly π_i, so a kept item weighted 1/π_i estimates any sum over all items without bias
(Horvitz-Thompson); the designs differ in how many items they keep.

    bernoulli(π, generator)   an independent coin per item: Σπ kept on average, more or fewer on any draw
    systematic(π, generator)  randomized systematic πps (Hartley-Rao): the items in a random order, their π laid end to
                              end on [0, T), T = Σπ, one uniform start u in [0, 1): the items whose stretch holds one of
                              u, u + 1, ... below T. Each stretch is at most 1 long, so no item is kept twice, and it
                              holds a point with probability exactly its length π_i, whatever the order (the order
                              only spreads the joint probabilities). The count is T when T is whole, else floor(T) or
                              ceil(T)

Invariants: every π_i in (0, 1]; systematic keeps exactly Σπ distinct items when Σπ is whole (within
SUM_TOLERANCE), and never more than ceil(Σπ); both return the kept items' indices, ascending. The generator is the
caller's (seeded by seed, step and level: every rank draws alike, a resumed run draws again what it drew).
"""

import math

import torch

SAMPLING_DESIGNS = ("systematic", "bernoulli")
SUM_TOLERANCE = 1e-6


def check_inclusion_probabilities(inclusion: torch.Tensor) -> None:
    if inclusion.numel() and not bool(((inclusion > 0) & (inclusion <= 1.0 + 1e-12)).all()):
        raise ValueError(f"inclusion probabilities must be in (0, 1], got min {float(inclusion.min())} and max "
                         f"{float(inclusion.max())}: a probability of 0 cannot be weighted back")


def bernoulli(inclusion: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[kept] int64: each item kept by its own coin."""
    check_inclusion_probabilities(inclusion)
    coins = torch.rand(inclusion.numel(), generator=generator, dtype=torch.float64)
    return (coins < inclusion).nonzero().squeeze(1)


def systematic(inclusion: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[kept] int64: randomized systematic sampling (module docstring); exactly Σπ items when Σπ is whole."""
    check_inclusion_probabilities(inclusion)
    inclusion = inclusion.to(torch.float64)
    if inclusion.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    total = float(inclusion.sum())
    if abs(total - round(total)) <= SUM_TOLERANCE:
        total = float(round(total))  # a whole total's rounding must not add or drop the last point
    order = torch.randperm(inclusion.numel(), generator=generator)
    ends = inclusion[order].cumsum(0)
    ends[-1] = total
    start = float(torch.rand(1, generator=generator, dtype=torch.float64))
    points = start + torch.arange(math.ceil(total), dtype=torch.float64)
    points = points[points < total]
    kept = order[torch.searchsorted(ends, points, right=True)]
    if kept.unique().numel() != kept.numel():  # two points in one stretch: only a π above 1 could do that
        raise RuntimeError("systematic sampling kept an item twice: an inclusion probability exceeds 1")
    return kept.sort().values


def draw(design: str, inclusion: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The kept items' indices under `design` (one of SAMPLING_DESIGNS)."""
    if design == "systematic":
        return systematic(inclusion, generator)
    if design == "bernoulli":
        return bernoulli(inclusion, generator)
    raise ValueError(f"unknown sampling design {design!r}: choose one of {SAMPLING_DESIGNS}")
