"""Schedulers: SAGE searches levels 1..3 on all-zero groups only; SAGE-LIGHT moves a prompt's level by its accuracy."""

import pytest

from sage_core.schedulers import GRPO, SAGE, SAGELight, make_scheduler


def test_grpo_never_hints():
    s = GRPO()
    assert s.level_before("x") == 0
    assert s.next_action("x", [(0, [0.0] * 8)]) is None


def test_sage_escalates_only_all_zero_groups_and_stops_at_first_success():
    s = SAGE()
    assert s.next_action("x", [(0, [1.0] * 8)]) is None  # all-one: hints would only make it easier
    assert s.next_action("x", [(0, [0, 1, 0, 0])]) is None  # mixed: the gate is already open
    tries = [(0, [0.0] * 4)]
    levels = []
    while (a := s.next_action("x", tries)) is not None:
        levels.append(a.level)
        tries.append((a.level, [0.0] * 4))
    assert levels == [1, 2, 3]
    assert s.next_action("x", [(0, [0] * 4), (1, [0, 0, 1, 0])]) is None


def test_sage_skips_a_level_whose_hint_could_not_be_written():
    # an empty try means "no usable hint at that level": the search goes on to the next level
    assert SAGE().next_action("x", [(0, [0] * 4), (1, [])]).level == 2


def test_sage_trains_on_the_rescued_group_else_the_unhinted_one():
    s = SAGE()
    sel = s.finalize("x", [(0, [0] * 4), (1, [0] * 4), (2, [0, 1, 1, 0])])
    assert sel.picks == [(2, j) for j in range(4)] and sel.weight == 1.0
    sel = s.finalize("x", [(0, [0] * 4), (1, []), (2, [0] * 4), (3, [0] * 4)])
    assert sel.picks == [(0, j) for j in range(4)]
    # a hinted group that got every rollout right ends the search like a mixed one: that level is the one trained
    # (advantage 0 either way, but the tracker and the level metrics then show the hint that was used and solved it)
    sel = s.finalize("x", [(0, [0] * 4), (1, [0] * 4), (2, [1] * 4)])
    assert s.next_action("x", [(0, [0] * 4), (1, [0] * 4), (2, [1] * 4)]) is None
    assert sel.picks == [(2, j) for j in range(4)]
    assert s.finalize("x", [(0, [1] * 4)]).picks == [(0, j) for j in range(4)]


@pytest.mark.parametrize("acc,before,after", [(0.0, 0, 1), (0.0, 3, 3), (0.125, 2, 2), (0.5, 2, 1), (1.0, 0, 0)])
def test_sage_light_level_rule(acc, before, after):
    s = SAGELight(light_min=0.1, light_max=0.35)
    G = 8
    rewards = [1.0] * round(acc * G) + [0.0] * (G - round(acc * G))
    s.observe("x", before, rewards)
    assert s.level_before("x") == after
    assert s.next_action("x", [(after, rewards)]) is None  # one rollout per step


def test_sage_light_state_round_trip_and_thresholds_validated():
    s = SAGELight()
    s.observe("a", 0, [0] * 8)
    t = SAGELight()
    t.load_state(s.state())
    assert t.level_before("a") == 1 and t.level_before("b") == 0
    with pytest.raises(ValueError, match="light_min"):
        SAGELight(light_min=0.5, light_max=0.2)


def test_make_scheduler_names_the_bad_method():
    with pytest.raises(ValueError, match="bogus"):
        make_scheduler("bogus")
    assert make_scheduler("sage-light", light_min=0.0, light_max=0.5, unrelated=3).light_max == 0.5


def test_a_weighted_scheduler_is_weighted_for_the_advantages_it_is_given():
    """make_scheduler hands scale_rewards to the weighting wrapper: with TRL's scale_rewards='none' a group's
    advantages are r - mean (no std), and the weight h S_ref / S_sel must be taken with those."""
    from sage_core.curation import pilot_weight, reference_signal, signal

    s = make_scheduler("sage", weighting="log", scale_rewards="none")
    assert s.scale_rewards == "none"
    rewards = [1.0, 0.0, 0.0, 0.0]
    sel = s.finalize("x", [(0, rewards)])
    expected = pilot_weight(1, 4, "log") * reference_signal(4, "none") / signal(rewards, "none")
    assert sel.weight == pytest.approx(expected)
