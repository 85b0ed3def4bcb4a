"""Reading torch.export's length bounds from its "Constraints violated" messages."""

from __future__ import annotations

from tppc.frontend.length_bounds import admitted_range, bound_site

_DOGE = """Constraints violated (seq)! For more information, run with TORCH_LOGS="+dynamic".
  - Not all values of seq = L['input_ids'].size()[1] in the specified range seq <= 4096 satisfy the generated guard 2 <= L['input_ids'].size()[1] and L['input_ids'].size()[1] <= 2048
Suggested fixes:
  seq = Dim('seq', max=2048)
"""
_TABLE = """Constraints violated (seq)! For more information, run with TORCH_LOGS="+dynamic".
  - Not all values of seq = L['ids'].size()[1] in the specified range seq <= 40 satisfy the generated guard (40*L['ids'].size()[1]) != 1600.
"""
_PINNED = """Constraints violated (seq)! ... specialized it to be a constant (24)
Suggested fixes:
  seq = 24
"""


def test_a_suggested_maximum_that_holds_the_example_and_more_is_a_range() -> None:
    assert admitted_range(Exception(_DOGE), 24) == (2, 2048)
    assert admitted_range(Exception(_DOGE), 2048) is None  # only the example: pinned
    assert admitted_range(Exception(_DOGE.replace("max=2048", "min=8, max=2048")), 24) \
        == (8, 2048)
    assert admitted_range(Exception(_DOGE.replace("Dim('seq'", "Dim('other'")), 24) is None
    assert admitted_range(Exception(_PINNED), 24) is None


def test_a_guard_that_excludes_the_maximum_alone_narrows_the_range_by_one() -> None:
    assert admitted_range(Exception(_TABLE), 24, high=40) == (2, 39)
    assert admitted_range(Exception(_TABLE), 24, high=41) is None  # excludes 40, not 41
    assert admitted_range(Exception(_TABLE), 24) is None


def test_the_bounding_guard_is_named_by_its_boundary() -> None:
    sites = [("s70 > 1", ("/x/site-packages/m/a.py", 3, "mask")),
             ("s70 + 2 <= 66", ("/x/site-packages/m/b.py", 7, "forward"))]
    assert bound_site(sites, 64).startswith("m/b.py:7 in forward")
    assert bound_site(sites, 100).startswith("m/a.py:3 in mask")  # none matches: the first
    assert bound_site([], 64) == "a line inside torch"
