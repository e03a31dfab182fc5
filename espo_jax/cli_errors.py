"""A bad command line or config, said in one message: no Python traceback on the console.

A mistyped flag, an override of a field the config lacks (`--config.train.nosuch=1`), a value
of the wrong type, a config file that does not load and a config that fails validation
(`espo_jax.config_validation`) are the user's to fix, not bugs: the main job prints

    error: invalid config: config.train.replay='bogus' is not one of ('r3', 'r2', 'off')

and exits with status 1. `--verbosity=1` (absl's flag) raises them with their traceback again.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Sequence

from absl import flags

_TRACEBACK = "Traceback (most recent call last):"


class CommandLineError(ValueError):
    """What the command line asks for cannot be done, found once its flags parsed (a
    checkpoint of another model than the command's): an entry point prints it with `fail`."""


class UserError(ValueError, RuntimeError):
    """What the user brought is at fault, found while the run is set up (a task's reward that
    raises, a prompt longer than the config allows): `fail` prints the message as one `error:`
    line and, when the user's own code raised (`raise UserError(...) from e`), that code's
    frames only, not espo_jax's."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def own_frames(exc: BaseException) -> str:
    """`exc`'s traceback without espo_jax's frames (those under this package), then its last
    line: the frames of the user's code and of what it called."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not os.path.abspath(f.filename).startswith(_PACKAGE)]
    return "".join(["Traceback (your code's frames; --verbosity=1 shows every frame):\n",
                    *traceback.format_list(frames),
                    *traceback.format_exception_only(type(exc), exc)])


_HINT = "(--verbosity=1 shows the traceback, --helpshort the flags)"


def _missing_field(exc: KeyError | AttributeError, argv: Sequence[str]) -> str:
    """ml_collections' error for an override of a field the config lacks (an AttributeError
    around a KeyError around "'name'\nDid you mean ...?"), with the flag that named it."""
    while len(exc.args) == 1 and isinstance(exc.args[0], BaseException):
        exc = exc.args[0]
    lines = str(exc.args[0] if exc.args else exc).strip().splitlines() or [repr(exc)]
    name = lines[0].strip("'\"")
    given = [a.split("=")[0] for a in argv if a.startswith("--config.")
             and name in a.split("=")[0].split(".")[1:]]
    return " ".join([f"{given[0] if given else '--config'}: the config has no field {name!r}",
                     *lines[1:]])


def one_message(exc: BaseException, argv: Sequence[str] = ()) -> str:
    """`exc` as one line: the cause's last line where the message embeds a traceback
    (ml_collections quotes a config file's exception in its flag error) or spans lines (a
    config file that does not load); for an override of a missing field, the flag."""
    if isinstance(exc, KeyError | AttributeError):
        return _missing_field(exc, argv)
    text = str(exc).strip()
    if _TRACEBACK in text:
        head = text.split(_TRACEBACK)[0].strip().rstrip(":")
        last = [line.strip() for line in text.splitlines() if line.strip()][-1]
        return f"{head}: {last}"
    while "\n" in text and exc.__cause__ is not None:  # the file's own error, not the wrapper's
        exc = exc.__cause__
        text = str(exc).strip()
    return [line.strip() for line in text.splitlines() if line.strip()][-1] if text else repr(exc)


def verbosity_asked(argv: Sequence[str]) -> int:
    """absl's `--verbosity` (`-v`, `--v`) in `argv`, read before the flags are parsed (a
    parse that fails leaves `FLAGS.verbosity` unset); 0 where absent or not a number."""
    value = "0"
    for i, arg in enumerate(argv[1:], start=1):
        m = re.fullmatch(r"--?(?:v|verbosity)(?:=(.*))?", arg)
        if m:
            value = m.group(1) if m.group(1) is not None else (argv[i + 1] if i + 1 < len(argv)
                                                                else "0")
    try:
        return int(value)
    except ValueError:
        return 0


def fail(exc: BaseException, verbosity: int, argv: Sequence[str] = ()) -> int:
    """Prints `exc` as one message on stderr and returns the exit status 1; at `verbosity` >= 1
    raises it again instead (with its traceback)."""
    if verbosity >= 1:
        raise exc
    if isinstance(exc, UserError):
        cause = exc.__cause__
        sys.stderr.write(f"error: {exc}\n" + (own_frames(cause) if cause is not None else ""))
        return 1
    sys.stderr.write(f"error: {one_message(exc, argv)}\n{_HINT}\n")
    return 1


def parse_flags(argv: Sequence[str]) -> list[str]:
    """`app.run`'s `flags_parser`: absl's parse, plus a look at the `--config` it loaded
    (ml_collections defers a load error until the config is read); a bad flag, field or file
    exits with one message (`fail`)."""
    try:
        rest = flags.FLAGS(argv)
        if "config" in flags.FLAGS and flags.FLAGS["config"].present:
            # A file that failed to load is an object whose every attribute raises its error.
            flags.FLAGS["config"].value.keys  # noqa: B018
        return rest
    except (flags.Error, AttributeError, KeyError, OSError) as e:
        sys.exit(fail(e, verbosity_asked(argv), argv))
