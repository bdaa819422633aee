"""The value checks every schema runs in `__post_init__`: one line naming the key, expected, found, fix."""

from __future__ import annotations

from pipeline.errors import ConfigError, problem


def check(ok: bool, key: str, expected: str, found: object, fix: str) -> None:
    if not ok:
        raise ConfigError(problem(f"config key {key}", expected, repr(found), fix))


def positive(value: float, key: str) -> None:
    check(value > 0, key, "a value > 0", value, f"set {key} to a positive value")


def choice(value: str, key: str, choices: tuple[str, ...]) -> None:
    check(value in choices, key, f"one of {', '.join(choices)}", value, f"set {key} to one of them")


def at_least(value: float, key: str, low: float, fix: str) -> None:
    check(value >= low, key, f"a value >= {low}", value, fix)


def integer(value: object, key: str, low: int, fix: str) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    check(ok, key, f"an integer >= {low}", value, fix)
