"""`harness.runs.interleaved`: the order the runners of `measure` take, a seeded shuffle per repeat and chunk."""

from parse_jax.harness.runs import interleaved

NAMES = ["target", "parse", "parse (fixed)", "parse+eagle3", "parse+eagle3 (fixed)", "sd", "eagle3", "sequential"]


def test_each_order_is_a_permutation_and_the_same_for_the_same_seed():
    for r in range(5):
        order = interleaved(NAMES, 11, r, 0)
        assert sorted(order) == sorted(NAMES)
        assert order == interleaved(NAMES, 11, r, 0)
    assert any(interleaved(NAMES, 11, r, 0) != interleaved(NAMES, 12, r, 0) for r in range(3))


def test_no_runner_always_follows_the_same_one():
    """The rotation this replaced kept each runner behind the same one in every repeat; over 9 repeats each runner
    here follows at least two others."""
    before = {n: set() for n in NAMES}
    for r in range(9):
        order = interleaved(NAMES, 11, r, 0)
        for a, b in zip(order, order[1:]):
            before[b].add(a)
    assert all(len(v) >= 2 for n, v in before.items() if n != interleaved(NAMES, 11, 0, 0)[0]), before
    assert len({interleaved(NAMES, 11, r, 0)[0] for r in range(9)}) >= 3  # different runners go first
