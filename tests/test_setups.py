"""The CPU-tier setups (``kvtriton.setups``): the removed preset names, compositions of setup
axes parsed to one canonical name with each axis setting its own switch, refusals that name the
value, the ablation, and the grammar written once as data, strict about what it accepts and the
source of the CLI's help text."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from hypothesis import given, reject
from hypothesis import strategies as st

from bench.tier_study.study import ABLATION
from kvtriton.eviction.lfu import DEFAULT_WINDOW_TIERS
from kvtriton.planner import PlannerConfig
from kvtriton.setups import (
    AXES,
    MAX_SESSION_IDLE_S,
    NUMBER,
    REFERENCES,
    REFUSED,
    REMOVED_PRESETS,
    canonical_number,
    parse_setup,
    read_number,
    tier_setup,
)

# ---- presets and compositions --------------------------------------------------------------------


def test_removed_presets_name_the_setups_they_always_were():
    """Each removed preset name is refused, naming the composition that is the setup it was."""
    bounded = PlannerConfig(restore=True, cpu_free_order="tail_first", restore_share=0.5)
    want = {
        "control": (PlannerConfig(restore=False, cpu_free_order="head_first"), "lru"),
        "restore_tail": (PlannerConfig(restore=True, cpu_free_order="tail_first"), "lru"),
        "restore_tail_bounded": (bounded, "lru"),
        "restore_tail_bounded_arc": (bounded, "arc"),
        "restore_tail_bounded_s3fifo": (bounded, "s3fifo"),
    }
    assert set(REMOVED_PRESETS) == {*want, "no_cpu"}
    for name, (cfg, eviction) in want.items():
        with pytest.raises(ValueError, match=rf"^{name!r} was a preset name .* write "
                                             rf"{re.escape(repr(REMOVED_PRESETS[name]))}$"):
            tier_setup(name)
        pol = tier_setup(REMOVED_PRESETS[name])
        assert (pol.planner, pol.cpu_eviction, pol.hints, pol.oracle) == (
            cfg, eviction, False, False), name
    assert tier_setup(REMOVED_PRESETS["no_cpu"]).planner is None
    # "restore" was a preset and is still a composition: the same setup.
    assert tier_setup("restore").planner == PlannerConfig(restore=True,
                                                          cpu_free_order="head_first")


@pytest.mark.parametrize(("spec", "canonical"), [
    ("eager+restore+tail+arc", "eager+restore+tail+arc"),
    ("arc+tail+restore+eager", "eager+restore+tail+arc"),  # any order
    ("restore", "eager+restore"),
    ("eager+head+lru+all", "eager"),  # defaults vanish
    ("lazy+hints:0.25+s3fifo", "lazy+s3fifo+hints:0.25"),
    ("eager+restore:0.5+tail", "eager+restore:0.5+tail"),
    ("eager+second", "eager+second"),
    ("eager+inf", "eager+inf"),
    ("reqlru+eager", "eager+reqlru"),
    ("tail+reqarc+waiting", "eager+tail+reqarc+waiting"),
])
def test_compositions_parse_to_one_canonical_name(spec, canonical):
    pol = tier_setup(spec)
    assert pol.composition == canonical
    assert tier_setup(canonical).planner == pol.planner


def test_each_axis_sets_its_own_switch():
    p = parse_setup("lazy+tail+arc+hints:0.3")
    assert (p.planner.lazy, p.planner.restore, p.planner.cpu_free_order, p.cpu_eviction,
            p.hint_protect_share) == (True, False, "tail_first", "arc", 0.3)
    p = parse_setup("eager+restore:0.25+second")
    assert (p.planner.restore_share, p.planner.admission) == (0.25, "second")
    assert parse_setup("eager+nextuse").oracle and parse_setup("eager+inf").oracle
    assert not parse_setup("eager+hints").oracle


@pytest.mark.parametrize(("spec", "named"), [
    ("eager+lfu:x", "'lfu:x'"),
    ("eager+arc:4", "'arc:4'"),
    ("eager+lru+arc", "'lru' and 'arc'"),
    ("eager+lazy", "'eager' and 'lazy'"),
    ("lazy+restore", "'lazy' with 're-store'"),
    ("lazy+second", "'second'"),
    ("eager+hinted", "'hinted' admission needs 'lazy'"),
    ("hinted+restore", "'hinted'"),
    ("eager+waiting+hints", "'hints' and 'waiting'"),
    ("eager+nextuse+waiting", "'waiting' with 'nextuse'"),
    ("eager+waiting:2", "'2'"),
    ("eager+waiting+waiting:0.2", "'waiting' and 'waiting:0.2' both set the lookahead"),
    ("eager+restore:1.5", "'1.5'"),
    ("eager+hints:x", "'x'"),
    ("eager+nextuse+hints", "'hints' with 'nextuse'"),
    ("eager++tail", "''"),
    ("", "non-empty"),
    ("fancy", "'fancy'"),
])
def test_bad_compositions_name_the_value(spec, named):
    with pytest.raises(ValueError) as e:
        tier_setup(spec)
    assert named in str(e.value)


def test_the_ablation_changes_one_axis_at_a_time():
    # Each setup differs from the control ("eager") in one axis value: one more token, or the
    # store mode swapped ("lazy"). Combinations are kept apart (COMBINED).
    assert ABLATION[0] == "eager"
    for spec in ABLATION[1:]:
        parts = tier_setup(spec).composition.split("+")
        assert parts == ["lazy"] or (parts[0] == "eager" and len(parts) == 2), spec
    assert all(tier_setup(b).oracle for b in REFERENCES)


def test_lookahead_composition():
    p = parse_setup("waiting:0.25+lazy")
    assert p.composition == "lazy+waiting:0.25" and p.lookahead and not p.hints
    assert parse_setup("eager+waiting").waiting_protect_share == 0.5


# ---- the grammar ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["restore:", "hints:", "waiting:", "eager+restore:",
                                  "eager+hints:", "lazy+waiting:"])
def test_a_share_axis_with_no_number_is_refused(spec):
    with pytest.raises(ValueError, match=r"the share must be a number in \[0, 1\], got ''"):
        tier_setup(spec)


@pytest.mark.parametrize("spec", ["eager+hints: 0.5", "eager+ restore", "eager +tail",
                                  "eager+restore:0.5 +tail", "hints :0.5"])
def test_spaces_inside_a_composition_are_refused_alike(spec):
    with pytest.raises(ValueError, match="a composition has no spaces"):
        tier_setup(spec)


@pytest.mark.parametrize("share", ["-0", "-0.0", "1e-1", "nan", "inf", "0x1", "1.5", "1E0",
                                   "1_0", "1e"])
def test_a_share_is_written_in_the_number_syntax_and_in_range(share):
    with pytest.raises(ValueError, match=f"got {share!r}"):
        tier_setup(f"eager+restore:{share}")


# ---- one number syntax for the grammar and the CLI (issue 50, item 5) ----------------------------


@pytest.mark.parametrize(("spec", "canonical"), [
    ("eager+sessions:1e3", "eager+sessions:1000"),
    ("eager+sessions:3e2", "eager+sessions"),  # the default, written without it
    ("eager+sessions:8.64e4", "eager+sessions:86400"),
    ("eager+lfu:1e9", "eager+lfu:1000000000"),
    ("eager+lfu:1.6e1", "eager+lfu"),
    ("eager+restore:.5e0", "eager+restore:0.5"),
    ("lazy+hints:0.25e0", "lazy+hints:0.25"),
    ("eager+waiting:1e0", "eager+waiting:1"),
])
def test_exponents_without_sign_are_numbers_and_print_in_digits(spec, canonical):
    """``1e3`` is a number in a composition as on the command line; the name has no exponent."""
    setup = parse_setup(spec)
    assert setup.composition == canonical and setup.name == canonical
    assert parse_setup(canonical) == setup


@pytest.mark.parametrize(("token", "what"), [
    ("lfu:1E9", "the window"), ("lfu:-1", "the window"), ("lfu:1e", "the window"),
    ("lfu:e3", "the window"), ("sessions:1_000", "the idle time"), ("hints:5e-1", "the share"),
])
def test_a_bad_spelling_names_the_axis_the_value_and_the_syntax(token, what):
    with pytest.raises(ValueError) as e:
        tier_setup(f"eager+{token}")
    message = str(e.value)
    assert f"setup axis {token!r}: {what}" in message and f"got {token.partition(':')[2]!r}" \
        in message and "1e3" in message, message


def test_a_signed_exponent_cannot_be_written_in_a_composition():
    """'+' joins axes: ``lfu:1e+9`` is the token ``lfu:1e`` (refused as a number) and ``9``."""
    with pytest.raises(ValueError, match=r"setup axis 'lfu:1e': the window .* got '1e'"):
        tier_setup("eager+lfu:1e+9")


def test_an_infinite_window_is_refused():
    with pytest.raises(ValueError, match=r"'lfu:1e400': the window must be a finite number"):
        tier_setup("eager+lfu:1e400")


@pytest.mark.parametrize(("text", "value"), [("0", 0), ("1000", 1000), ("1e3", 1000),
                                             (".5", Decimal("0.5")), ("1.", 1),
                                             ("2.5e1", 25), ("1e0", 1)])
def test_read_number_reads_the_one_syntax_exactly(text, value):
    assert NUMBER.fullmatch(text) and read_number(text) == value


@pytest.mark.parametrize("text", ["", "-1", "+1", "1e+3", "1e-3", "1E3", " 1", "1 ", "1_000",
                                  "inf", "nan", "0x10", "\u0661", "1e", "e3", ".", "1.2.3"])
def test_read_number_refuses_every_other_spelling(text):
    with pytest.raises(ValueError, match=rf"^{re.escape(repr(text))} is not a number \(.*1e3"):
        read_number(text)


# ---- sessions:S is bounded (issue 50, item 2) ----------------------------------------------------


@pytest.mark.parametrize("seconds", ["99999999999", "86400.5", "86401", "1e5", "0", "0.0"])
def test_session_idle_time_is_bounded_by_a_day(seconds):
    """``sessions:S`` with S past MAX_SESSION_IDLE_S would never age a session out."""
    assert MAX_SESSION_IDLE_S == 86400
    with pytest.raises(ValueError) as e:
        tier_setup(f"eager+sessions:{seconds}")
    message = str(e.value)
    assert f"setup axis 'sessions:{seconds}'" in message and f"got {seconds!r}" in message
    assert "(0, 86400]" in message and "MAX_SESSION_IDLE_S" in message


def test_session_idle_time_up_to_a_day_is_taken():
    assert parse_setup("eager+sessions:86400").session_idle_s == MAX_SESSION_IDLE_S
    assert parse_setup("eager+sessions:0.5").session_idle_s == 0.5


def test_the_connector_refuses_an_unbounded_session_idle_time():
    from kvtriton.vllm.config import parse_extra_config

    with pytest.raises(ValueError, match=r"'sessions:99999999999'.*\(0, 86400\]"):
        parse_extra_config({"setup": "eager+sessions:99999999999"})


# ---- the unknown-axis message is the grammar (issue 50, item 5) ----------------------------------


def test_an_unknown_axis_value_lists_every_axis_value():
    with pytest.raises(ValueError) as e:
        tier_setup("eager+fancy")
    known = str(e.value).partition("known: ")[2].split(", ")
    assert known == [v for axis in AXES for v in axis.values]
    for value in ("hints", "waiting", "sessions", "sessions:S", "shared"):
        assert value in known


@pytest.mark.parametrize(("share", "canonical"), [("0", "eager+restore:0"),
                                                  (".25", "eager+restore:0.25"),
                                                  ("1.", "eager+restore:1"),
                                                  ("0.50", "eager+restore:0.5")])
def test_good_shares_print_canonically(share, canonical):
    assert tier_setup(f"eager+restore:{share}").composition == canonical


@pytest.mark.parametrize(("spec", "reason"), [
    ("inf+nextuse", "an unbounded tier never evicts"),
    ("eager+inf+arc", "an unbounded tier never evicts"),
    ("eager+inf+hints", "nothing needs protecting"),
    ("eager+inf+waiting", "nothing needs protecting"),
    ("eager+inf+restore", "never evicts a running request's blocks"),
    ("lazy+inf", "written 'eager+inf'"),
])
def test_bounds_compose_only_where_they_mean_something(spec, reason):
    with pytest.raises(ValueError) as e:
        tier_setup(spec)
    assert reason in str(e.value)


def _example(condition: dict[str, tuple[str, ...]]) -> str:
    """The smallest composition meeting ``condition``: its first value on each axis named."""
    return "+".join(values[0] for values in condition.values())


@pytest.mark.parametrize(("condition", "reason"), REFUSED,
                         ids=[_example(c) for c, _ in REFUSED])
def test_every_refused_composition_gives_its_reason(condition, reason):
    with pytest.raises(ValueError) as e:
        tier_setup(_example(condition))
    assert reason in str(e.value)


def test_every_axis_value_parses_alone_or_with_what_it_needs():
    for axis in AXES:
        for value in axis.values:
            token = value.replace(":F", ":0.25").replace(":W", ":4").replace(":S", ":30")
            needs = "lazy+" if token == "hinted" else ""
            setup = tier_setup(needs + token)
            assert setup.composition  # a canonical name for every value


def test_the_help_lists_every_axis_value(capsys):
    from kvtriton.cli import main

    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for axis in AXES:
        assert f"{axis.name}: {'|'.join(axis.values)}" in text


def test_lfu_carries_its_window_in_the_queue_name():
    assert parse_setup("eager+lfu").cpu_eviction == "lfu"
    assert parse_setup("eager+lfu:16").composition == "eager+lfu"  # the default window
    p = parse_setup("eager+lfu:4+waiting")
    assert (p.cpu_eviction, p.composition, p.oracle) == ("lfu:4", "eager+lfu:4+waiting", False)
    assert "no aging" in parse_setup("eager+lfu:0").description


# ---- names that parse back (issue 36, item 6) ----------------------------------------------------

#: What a canonical name may hold: axis words, digits and points, '+' and ':' (no exponent, sign
#: or space), each number after a ':'.
_NAME = re.compile(r"[a-z0-9.]+(?:\+[a-z0-9.:]+)*")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _written(value: float | Decimal) -> str:
    """A number as a user may write it: digits and a point, exact (Decimal's positional form)."""
    return format(Decimal(value), "f")


#: Numbers in digits and a point: random floats written out exactly (0.1 is
#: 0.1000000000000000055511151231257827021181583404541015625), short decimals, and the tiny and
#: huge ones a general format writes with an exponent.
_SHARES = st.one_of(st.floats(0, 1).map(_written),
                    st.decimals(0, 1, places=6).map(_written),
                    st.sampled_from(["0.00001", "0.0000001", "1", "0", "0.1234567"]))
_WINDOWS = st.one_of(st.floats(0, 1e20).map(_written),
                     st.integers(0, 10**12).map(str),
                     st.builds("{}e{}".format, st.integers(0, 999), st.integers(0, 12)),
                     st.sampled_from(["1000000", "0.00001", "16", "16.0", "64", "1e3", ".5e1"]))
#: Seconds of ``sessions:S``: in (0, MAX_SESSION_IDLE_S].
_SECONDS = st.one_of(st.floats(0, MAX_SESSION_IDLE_S, exclude_min=True).map(_written),
                     st.integers(1, int(MAX_SESSION_IDLE_S)).map(str),
                     st.builds("{}e{}".format, st.integers(1, 864), st.integers(0, 2)),
                     st.sampled_from(["300", "86400", "0.001", "3e2", "8.64e4"]))


@st.composite
def _setups(draw) -> str:
    """A composition of random axis values, in random order (some refused: skipped)."""
    tokens = [draw(st.sampled_from(["eager", "lazy"]))]
    for axis in AXES[1:]:
        if not draw(st.booleans()):
            continue
        value = draw(st.sampled_from(axis.values))
        if value.endswith(":F"):
            value = value[:-1] + draw(_SHARES)
        elif value.endswith(":W"):
            value = value[:-1] + draw(_WINDOWS)
        elif value.endswith(":S"):
            value = value[:-1] + draw(_SECONDS)
        tokens.append(value)
    return "+".join(draw(st.permutations(tokens)))


@given(spec=_setups())
def test_every_name_printed_parses_back_to_its_setup(spec):
    try:
        setup = parse_setup(spec)
    except ValueError as e:
        if not any(reason in str(e) for _, reason in REFUSED):
            raise
        reject()
    name = setup.composition
    assert _NAME.fullmatch(name), name
    for token in name.split("+"):
        _, colon, number = token.partition(":")
        assert not colon or _NUMBER.fullmatch(number), name
    again = parse_setup(name)
    assert again == setup and again.composition == name and again.name == name
    # The name says the numbers written, not a rounding of them.
    shares = {t.partition(":")[0]: float(t.partition(":")[2]) for t in spec.split("+")
              if ":" in t}
    if "restore" in shares:
        assert setup.planner.restore_share == shares["restore"]
    if "hints" in shares:
        assert setup.hint_protect_share == shares["hints"]
    if "waiting" in shares:
        assert setup.waiting_protect_share == shares["waiting"]
    if "lfu" in shares:
        assert float(setup.cpu_eviction.partition(":")[2] or DEFAULT_WINDOW_TIERS) == shares["lfu"]


@pytest.mark.parametrize(("spec", "canonical"), [
    ("eager+restore:0.00001", "eager+restore:0.00001"),  # '1e-05' with a general format
    ("eager+lfu:1000000", "eager+lfu:1000000"),  # '1e+06'
    ("eager+lfu:1000000.0", "eager+lfu:1000000"),
    ("eager+restore:0.1234567", "eager+restore:0.1234567"),  # '0.123457' with six digits
    ("lazy+hints:0.0000001", "lazy+hints:0.0000001"),
    ("eager+waiting:0.000125", "eager+waiting:0.000125"),
])
def test_small_and_large_numbers_are_written_in_digits(spec, canonical):
    assert parse_setup(spec).composition == canonical


@pytest.mark.parametrize(("value", "text"), [(0.0, "0"), (1.0, "1"), (1e-5, "0.00001"),
                                             (1e6, "1000000"), (1e16, "10000000000000000"),
                                             (0.1, "0.1"), (64.0, "64"), (2.5, "2.5")])
def test_canonical_number_is_the_shortest_exact_decimal(value, text):
    assert canonical_number(value) == text and float(text) == value
