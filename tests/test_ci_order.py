"""FASTKIT_TEST_ORDER (tests/conftest.py's _reorder): another order of the same tests, a file's tests kept together."""

from pathlib import Path

import pytest

from tests.conftest import _reorder


class Item:
    def __init__(self, path, name):
        self.path, self.name = Path(path), name

    def __repr__(self):
        return f"{self.path}::{self.name}"


def _items():
    return [Item(f"tests/test_{f}.py", f"t{i}") for f in "abcde" for i in range(4)]


def _files(items):
    """The files in their order, each once: a file's tests are contiguous exactly when this has no repeats."""
    seen = [items[0].path]
    for item in items[1:]:
        if item.path != seen[-1]:
            seen.append(item.path)
    return seen


@pytest.mark.parametrize("order", ["reverse", "random:7", "random:8"])
def test_same_tests_other_order_files_kept_together(order):
    items = _items()
    before = list(items)
    _reorder(items, order)
    assert sorted(map(repr, items)) == sorted(map(repr, before))  # a permutation: nothing dropped or repeated
    assert items != before
    files = _files(items)
    assert len(files) == len(set(files)) == 5  # each file's tests together (module fixtures set up once)


def test_reverse_is_files_and_tests_last_to_first():
    items = _items()
    _reorder(items, "reverse")
    assert items[0].path.name == "test_e.py" and [i.name for i in items[:4]] == ["t3", "t2", "t1", "t0"]


def test_a_seed_gives_one_order_every_time():
    """xdist fails a run whose workers collect different orders: one seed must give one order in every process."""
    first, second = _items(), _items()
    _reorder(first, "random:7")
    _reorder(second, "random:7")
    assert list(map(repr, first)) == list(map(repr, second))
    third = _items()
    _reorder(third, "random:8")
    assert list(map(repr, third)) != list(map(repr, first))


@pytest.mark.parametrize("order", ["random", "random:x", "shuffle", ""])
def test_an_unknown_order_is_refused_naming_the_forms(order):
    with pytest.raises(pytest.UsageError, match="'reverse' or 'random:SEED'"):
        _reorder(_items(), order)
