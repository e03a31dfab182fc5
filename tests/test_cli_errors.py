"""A bad command line in one line (espo_jax.cli_errors): the errors ml_collections and absl
raise, condensed; absl's --verbosity read before the flags parse. The main job end to end:
tests/test_main.py."""

import pytest

from espo_jax import cli_errors


def test_a_quoted_traceback_is_condensed_to_its_last_line():
    quoted = ValueError("flag --config=x.py:nosuch: Error whilst parsing config file:\n\n"
                        "  Traceback (most recent call last):\n    File \"x.py\", line 3\n"
                        "  ValueError: unknown experiment argument 'nosuch'; valid: ['small']\n")
    assert cli_errors.one_message(quoted) == (
        "flag --config=x.py:nosuch: Error whilst parsing config file: ValueError: unknown "
        "experiment argument 'nosuch'; valid: ['small']")


def test_a_missing_field_names_the_flag_and_keeps_the_suggestion():
    inner = KeyError("'step'\nDid you mean \"steps\" instead of \"step\"?")
    argv = ["main", "--config", "x.py", "--config.train.step=3", "--config.train.loss=a"]
    assert cli_errors.one_message(AttributeError(inner), argv) == (
        "--config.train.step: the config has no field 'step' Did you mean \"steps\" instead of "
        "\"step\"?")


def test_a_multiline_error_gives_its_cause_s_last_line():
    try:
        try:
            raise OSError("Failed loading config file\n  Attempted:\n    x.py\n"
                          "      [Errno 2] No such file or directory: 'x.py'")
        except OSError as e:
            raise OSError("Configuration is not available: Failed loading config file\n"
                          "  Attempted:\n    x.py") from e
    except OSError as e:
        assert cli_errors.one_message(e) == "[Errno 2] No such file or directory: 'x.py'"


@pytest.mark.parametrize("argv, verbosity", [
    (["main"], 0), (["main", "--verbosity=1"], 1), (["main", "-v", "2"], 2),
    (["main", "--v=1", "--verbosity=0"], 0), (["main", "--verbosity"], 0),
    (["main", "--verbosity=debug"], 0)])
def test_verbosity_read_before_parsing(argv, verbosity):
    assert cli_errors.verbosity_asked(argv) == verbosity


def test_fail_prints_one_message_or_raises_at_verbosity_1(capsys):
    error = ValueError("invalid config: config.train.replay='bogus' is not one of ('r3', 'off')")
    assert cli_errors.fail(error, 0) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "error: " + str(error) and len(err) == 2
    with pytest.raises(ValueError, match="bogus"):
        cli_errors.fail(error, 1)
