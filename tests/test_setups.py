"""The setup grammar (``kvtriton.setups``): written once as data, strict about what it accepts,
and the source of the CLI's help text."""

from __future__ import annotations

import pytest

from kvtriton.setups import AXES, REFUSED, tier_policy


@pytest.mark.parametrize("spec", ["restore:", "hints:", "waiting:", "eager+restore:",
                                  "eager+hints:", "lazy+waiting:"])
def test_a_share_axis_with_no_number_is_refused(spec):
    with pytest.raises(ValueError, match=r"the share must be a number in \[0, 1\], got ''"):
        tier_policy(spec)


@pytest.mark.parametrize("spec", ["eager+hints: 0.5", "eager+ restore", "eager +tail",
                                  "eager+restore:0.5 +tail", "hints :0.5"])
def test_spaces_inside_a_composition_are_refused_alike(spec):
    with pytest.raises(ValueError, match="a composition has no spaces"):
        tier_policy(spec)


@pytest.mark.parametrize("share", ["-0", "-0.0", "1e-1", "nan", "inf", "0x1", "1.5"])
def test_a_share_is_digits_and_a_point_in_range(share):
    with pytest.raises(ValueError, match=f"got {share!r}"):
        tier_policy(f"eager+restore:{share}")


@pytest.mark.parametrize(("share", "canonical"), [("0", "eager+restore:0"),
                                                  (".25", "eager+restore:0.25"),
                                                  ("1.", "eager+restore:1"),
                                                  ("0.50", "eager+restore:0.5")])
def test_good_shares_print_canonically(share, canonical):
    assert tier_policy(f"eager+restore:{share}").composition == canonical


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
        tier_policy(spec)
    assert reason in str(e.value)


def _example(condition: dict[str, tuple[str, ...]]) -> str:
    """The smallest composition meeting ``condition``: its first value on each axis named."""
    return "+".join(values[0] for values in condition.values())


@pytest.mark.parametrize(("condition", "reason"), REFUSED,
                         ids=[_example(c) for c, _ in REFUSED])
def test_every_refused_composition_gives_its_reason(condition, reason):
    with pytest.raises(ValueError) as e:
        tier_policy(_example(condition))
    assert reason in str(e.value)


def test_every_axis_value_parses_alone_or_with_what_it_needs():
    for axis in AXES:
        for value in axis.values:
            token = value.replace(":F", ":0.25")
            needs = "lazy+" if token == "hinted" else ""
            policy = tier_policy(needs + token)
            assert policy.composition  # a canonical name for every value


def test_the_help_lists_every_axis_value(capsys):
    from kvtriton.cli import main

    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for axis in AXES:
        assert f"{axis.name}: {'|'.join(axis.values)}" in text
