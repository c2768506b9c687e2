"""The layout language: parser, tiling, the freq rule, and error messages that point at the mistake."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsaflow.errors import PlanError
from dsaflow.plan.layout import format_layout, freq_roles, parse_layout, tile_pattern


def roles_str(parsed):
    return "".join(parsed.roles)


def test_plain_letters_and_boundaries():
    p = parse_layout("FSSS|SSFS")
    assert roles_str(p) == "FSSSSSFS"
    assert p.stage_starts == (0, 4)
    assert p.num_stages == 2 and p.has_boundaries


def test_repeats_nesting_and_whitespace():
    p = parse_layout("  (FSSS)*2 | ( F S S S ) * 2 ")
    assert roles_str(p) == "FSSS" * 4
    assert p.stage_starts == (0, 8)
    nested = parse_layout("((FS)*2 S)*3")
    assert roles_str(nested) == "FSFSS" * 3
    assert parse_layout("F S*3").roles == ("F", "S", "S", "S")


def test_boundaries_inside_a_repeat():
    p = parse_layout("(FSSS|)*3 FSSS")
    assert roles_str(p) == "FSSS" * 4
    assert p.stage_starts == (0, 4, 8, 12)


def test_no_boundary_is_one_stage():
    p = parse_layout("FFSS")
    assert p.stage_starts == (0,) and not p.has_boundaries


@pytest.mark.parametrize(
    "text, needle, pos",
    [
        ("FSXS", "unknown role letter 'X'", 2),
        ("FS(SS", "unbalanced '('", 2),
        ("FSS)S", "unbalanced ')'", 3),
        ("(FS)*", "must be followed by a repeat count", 5),
        ("(FS)*0", "at least 1", 5),
        ("*3", "nothing to repeat", 0),
        ("F()S", "empty group", 1),
    ],
)
def test_syntax_errors_name_field_position_and_fix(text, needle, pos):
    with pytest.raises(PlanError) as e:
        parse_layout(text)
    msg = str(e.value)
    assert msg.startswith(f"layout={text!r}")
    assert needle in msg
    assert f"position {pos}" in msg
    assert "Fix:" in msg
    # The caret line points at the offending character.
    lines = msg.splitlines()
    assert lines[2].index("^") - 4 == pos


@pytest.mark.parametrize("text", ["|FS", "FS|", "FS||SS", "(FS|)*2|SS", ""])
def test_empty_stages_and_empty_layouts_are_errors(text):
    with pytest.raises(PlanError, match="empty|no layers"):
        parse_layout(text)


def test_lowercase_letters_are_rejected_not_guessed():
    with pytest.raises(PlanError, match="unknown role letter 'f'"):
        parse_layout("fsss")


def test_tile_pattern_cuts_the_last_repetition():
    assert "".join(tile_pattern("FSS", 7)) == "FSSFSSF"
    assert "".join(tile_pattern("(FS)*2", 4)) == "FSFS"
    with pytest.raises(PlanError, match="cannot contain '\\|'"):
        tile_pattern("FS|FS", 4)


def test_freq_rule_lists_the_documented_f_layers():
    roles = freq_roles(4, 0, 16)
    assert [i for i, r in enumerate(roles) if r == "F"] == [0, 4, 8, 12]
    roles = freq_roles(4, 2, 12)  # i < offset, or (i - offset) % freq == 0
    assert [i for i, r in enumerate(roles) if r == "F"] == [0, 1, 2, 6, 10]
    assert set(freq_roles(1, 0, 5)) == {"F"}
    with pytest.raises(PlanError, match="index.freq=0"):
        freq_roles(0, 0, 4)
    with pytest.raises(PlanError, match="index.offset=-1"):
        freq_roles(2, -1, 4)


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 40))
    roles = tuple(draw(st.lists(st.sampled_from("FS"), min_size=n, max_size=n)))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=min(6, n - 1)))) if n > 1 else []
    return roles, (0, *cuts)


@settings(max_examples=200, deadline=None)
@given(layouts(), st.data())
def test_format_then_parse_round_trips(layout, data):
    roles, starts = layout
    text = format_layout(roles, starts)
    # Sprinkle whitespace anywhere: it must not change the meaning.
    spaced = "".join(ch + " " * data.draw(st.integers(0, 2)) for ch in text)
    parsed = parse_layout(spaced)
    assert parsed.roles == roles
    assert parsed.stage_starts == starts


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from("FS"), min_size=1, max_size=6),
    st.integers(1, 5),
    st.lists(st.sampled_from("FS"), max_size=4),
)
def test_repeat_equals_written_out(unit, count, tail):
    u, t = "".join(unit), "".join(tail)
    assert parse_layout(f"({u})*{count}{t}").roles == tuple(u * count + t)
