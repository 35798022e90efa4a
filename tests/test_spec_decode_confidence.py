"""How far a tree's rows are trusted (kvserve/spec_decode/confidence.py): at first the head's own probability
for each token, then what the target did where the head gave about that probability."""
import pytest

from kvserve.spec_decode.confidence import ALTERNATIVE, FIRST, NEXT, Calibration, TreeDraft


def test_rows_start_at_the_heads_probability_and_a_chain_token_needs_all_before_it():
    cal = Calibration()
    # Bucket centres: 0.95, then 0.95 * 0.85 (the second token is accepted only with the first).
    assert cal.chain_gains([0.97, 0.81]) == pytest.approx([0.95, 0.95 * 0.85])
    # Alternatives never above the first token's gain nor the alternative before them: a step keeps a prefix.
    assert cal.alternative_gains([0.31, 0.12], first=0.45) == pytest.approx([0.35, 0.15])
    assert cal.alternative_gains([0.52, 0.48], first=0.45) == pytest.approx([0.45, 0.45])


def test_an_overconfident_head_is_trusted_as_far_as_the_target_agrees():
    cal = Calibration()
    for i in range(400):  # the head gives its first choice 0.95 and is right half the time
        cal.observe(TreeDraft([7], [0.95], [8], [0.03]), [7 if i % 2 else 5])
    assert cal.chain_gains([0.95])[0] == pytest.approx(0.5, abs=0.08)
    assert cal.rate[ALTERNATIVE][0] < 0.01  # its second choice never was
    assert cal.chain_gains([0.55])[0] == pytest.approx(0.55)  # other probabilities are kept apart


def test_each_kind_of_row_is_checked_only_where_the_target_went():
    cal = Calibration()
    before = [list(r) for r in cal.rate]
    draft = TreeDraft([1, 2, 3], [0.61, 0.72, 0.83], [4, 5], [0.21, 0.11])
    cal.observe(draft, [1, 2])  # first and second right; the third's outcome not known yet
    assert cal.rate[FIRST][6] > before[FIRST][6] and cal.rate[NEXT][7] > before[NEXT][7]
    assert cal.rate[NEXT][8] == before[NEXT][8]
    assert cal.rate[ALTERNATIVE][2] < before[ALTERNATIVE][2] and cal.rate[ALTERNATIVE][1] < before[ALTERNATIVE][1]
    cal = Calibration()
    cal.observe(draft, [5, 2, 3])  # the target took the head's third choice: no chain token after it counts
    assert cal.rate[FIRST][6] < before[FIRST][6]
    assert cal.rate[ALTERNATIVE][1] > before[ALTERNATIVE][1] and cal.rate[ALTERNATIVE][2] < before[ALTERNATIVE][2]
    assert cal.rate[NEXT] == before[NEXT]
