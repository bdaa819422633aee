"""How a stage exits on a user mistake: one `error:` line and exit 2, whether the mistake was caught
by our schemas, by Hydra (an unknown key or group option, override syntax) or by the stage itself."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from hydra.errors import HydraException, MissingConfigException, OverrideParseException

from pipeline.errors import PipelineError, UnknownKeyError
from stages._run.overrides import SWEEP_DIR, forget_refused_sweep, forget_unknown_key


def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr and a non-zero exit: never a traceback for a user mistake."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def refuse(message: str) -> NoReturn:
    """`fail` before the stage ran anything: a multirun refused at its first job leaves no sweep dir."""
    forget_refused_sweep()
    fail(message)


def config_failed(e: PipelineError) -> NoReturn:
    """`refuse` a config the schema refused; a refused unknown key is also taken out of params.yaml."""
    refuse(str(e) + (forget_unknown_key(e.key) if isinstance(e, UnknownKeyError) else ""))


def entry(main: Callable[[], Any]) -> None:
    """Run a `@hydra.main` function so that Hydra's own refusals (an unknown key, an unknown group
    option, override syntax) end like ours: one `error:` line and exit 2, not Hydra's multi-line
    report and exit 1. Bugs still raise with their traceback."""
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra re-raises instead of printing and exiting 1
    sys.argv[1:] = sweep_dir_args([quoted_non_ascii(a) for a in sys.argv[1:]])
    try:
        main()
    except HydraException as e:
        fail(hydra_message(e))


def sweep_dir_args(argv: list[str]) -> list[str]:
    """`argv`, plus conf/config.yaml's tokened `hydra.sweep.dir` for a multirun that sets none: a composed
    config (`--config-name params`) has no `hydra` section, and Hydra's own default has no token, so two
    multiruns started in the same second shared one directory."""
    if not {"-m", "--multirun"} & set(argv) or any(a.lstrip("+~").startswith("hydra.sweep.dir=") for a in argv):
        return argv
    return [*argv, f"hydra.sweep.dir={SWEEP_DIR}"]


def quoted_non_ascii(arg: str) -> str:
    """`key=value` with the value in quotes when it holds a character outside ASCII (an accented folder
    name): Hydra's override grammar refuses those unquoted. Sweeps (commas), lists, dicts, values already
    quoted and values with quotes or backslashes are left as they are."""
    key, eq, value = arg.partition("=")
    if not eq or value.isascii() or not re.fullmatch(r"[+~]{0,2}[\w.@/-]+", key):
        return arg
    if any(c in value for c in "'\"\\,[]{}()") or value[:1] in "'\"":
        return arg
    return f"{key}='{value}'"


def override_message(e: OverrideParseException) -> str:
    """An override Hydra could not parse: what it expected, what the parser found, and the quoting that fixes it."""
    override = e.override or ""
    key, eq, value = override.partition("=")
    found = " ".join(str(e.__cause__ or e).split()).split(" See https://")[0][:160]
    if not eq:
        return (
            f"config override '{override}': expected key=value, found no '=' (a value with spaces that the shell "
            "split into two words?); fix: quote the whole override for the shell, e.g. 'data.path=my dir/corpus.txt'"
        )
    shown = value.replace("\\", "\\\\").replace("'", "\\'")
    return (
        f"config override '{override}': expected a value in Hydra's override syntax (unquoted: letters, digits "
        f"and /-_.:+*@?; lists in [..]), found {found}; fix: quote the value for Hydra and the shell, "
        f"e.g. \"{key}='{shown}'\" (or close the brackets of a list)"
    )


def hydra_message(e: HydraException) -> str:
    """Hydra's message on one line: the key, what was expected (the choices of a group), the fix."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    found = lines[0] if lines else type(e).__name__
    cause = str(e.__cause__).splitlines()[0] if e.__cause__ is not None and str(e.__cause__) else ""
    key = re.search(r"override '([^']+)'|find '([^']+)'", found)
    name = next((g for g in key.groups() if g), "") if key else ""
    if isinstance(e, MissingConfigException) and e.options:
        group = name.split("/")[0]
        return f"config group {group}: expected one of {', '.join(e.options)}, found {name}; fix: pick one of them"
    if "not in struct" in cause:
        return (
            f"config key {name}: expected a key of the config, found none of that name; fix: check its spelling "
            "(`python -m stages.compose` prints every key)"
        )
    if "No match in the defaults list" in found:  # a group choice on a config without groups (params.yaml)
        return (
            f"config group {name}: expected a config with a defaults list (conf/config.yaml), found one without "
            f"(a composed file such as params.yaml); fix: drop --config-dir/--config-name to pick {name}=..., "
            f"or set its keys one by one ({name}.key=value)"
        )
    if isinstance(e, OverrideParseException):
        return override_message(e)
    detail = f"{found} ({cause})" if cause else found
    return f"config override: {detail}; fix: quote values with spaces, commas or brackets"
