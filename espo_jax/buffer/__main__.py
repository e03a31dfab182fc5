"""`python -m espo_jax.buffer inspect DIR [--policy_version=N]`: a buffer directory's shards,
record counts, policy versions, staleness and decode errors. Exits 1 when a record is damaged,
2 when DIR does not exist."""

import sys

from absl import app, flags

from espo_jax.buffer.inspect import format_report, inspect_directory

_POLICY_VERSION = flags.DEFINE_integer(
    "policy_version", None, "the learner's policy version, for staleness (default: the newest "
    "version in the directory)")


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] != "inspect":
        raise app.UsageError("usage: python -m espo_jax.buffer inspect DIR [--policy_version=N]")
    try:
        report = inspect_directory(argv[2], _POLICY_VERSION.value)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    app.run(main)
