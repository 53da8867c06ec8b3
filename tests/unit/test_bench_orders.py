"""``benchmarks/bench_step.py``'s round orders: a Williams design, so every variant runs in
every position, and right after every other variant, equally often over a cycle."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_step.py"


def adjacent(orders: list[list[int]]) -> Counter:
    """How often each ordered pair runs back to back within a round."""
    return Counter(pair for order in orders for pair in zip(order, order[1:], strict=False))


def balanced_orders():
    spec = importlib.util.spec_from_file_location("bench_step", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # module-level imports are the standard library's
    return module.balanced_orders


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_every_variant_takes_every_position_and_follows_every_other_alike(n: int) -> None:
    orders = balanced_orders()(n)
    assert len(orders) == (n if n % 2 == 0 else 2 * n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    positions = Counter((i, p) for order in orders for p, i in enumerate(order))
    assert len(positions) == n * n and len(set(positions.values())) == 1
    follows = adjacent(orders)
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1


def test_a_rotation_would_not_balance_what_comes_before() -> None:
    """The plain rotation the design replaces: each variant behind the same one every round."""
    n = 5
    rotation = [[(i + r) % n for i in range(n)] for r in range(n)]
    assert len(adjacent(rotation)) == n  # only (i, i + 1): 5 of the 20 ordered pairs
    assert len(adjacent(balanced_orders()(n))) == n * (n - 1)
