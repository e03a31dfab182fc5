"""`python -m espo_jax.buffer inspect DIR [--policy_version=N] [--consumed_log=FILE]
[--show_group=N --tokenizer=char|PATH]`: a buffer directory's shards, record counts, policy
versions, what the learner consumed (staleness at consumption) and decode errors; with
`--show_group` the text of one group (prompt, completions, rewards, outcomes) instead. Exits 1
when a record is damaged, 2 when DIR, the log or the group does not exist."""

import sys

from absl import app, flags

from espo_jax.buffer.inspect import find_group, format_report, inspect_directory
from espo_jax.buffer.text import format_group, group_rows

_POLICY_VERSION = flags.DEFINE_integer(
    "policy_version", None, "the learner's policy version, for the age of unread groups "
    "(default: the newest version in the directory)")
_CONSUMED_LOG = flags.DEFINE_string(
    "consumed_log", None, "the learner's consumed.jsonl (default: the one next to DIR, "
    "WORKDIR/consumed.jsonl for WORKDIR/buffer)")
_SHOW_GROUP = flags.DEFINE_integer(
    "show_group", None, "print the text of this group (0-based, in reading order) instead "
    "of the report")
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", "char", "the run's config.tokenizer for --show_group: char, or the path of a "
    "Hugging Face tokenizer (tokenizer.json or its directory)")

_USAGE = ("usage: python -m espo_jax.buffer inspect DIR [--policy_version=N] "
          "[--consumed_log=FILE] [--show_group=N [--tokenizer=char|PATH]]")


def _decoders(spec: str):
    """(prompt text, completion text) functions of the run's tokenizer. The command-line tool
    reads text for a person; the buffer contract itself never needs a tokenizer."""
    from espo_jax.tokenizer import CharTokenizer, load_tokenizer

    tokenizer = load_tokenizer(spec)
    if isinstance(tokenizer, CharTokenizer):  # a sampled id past the vocabulary shows as U+FFFD
        return tokenizer.decode, lambda ids: tokenizer.decode(ids, errors="replace")
    return tokenizer.decode, tokenizer.decode


def show_group(directory: str, index: int, tokenizer: str) -> int:
    try:
        prompt_text, completion = _decoders(tokenizer)
    except (OSError, ValueError) as e:
        print(f"error: --tokenizer={tokenizer!r}: {e}", file=sys.stderr)
        return 2
    try:
        group, shard, record = find_group(directory, index)
    except (FileNotFoundError, IndexError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"group {index}: {shard.name} record {record}")
    print(format_group(group, group_rows(group, prompt_text, completion)))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] != "inspect":
        raise app.UsageError(_USAGE)
    if _SHOW_GROUP.value is not None:
        return show_group(argv[2], _SHOW_GROUP.value, _TOKENIZER.value)
    try:
        report = inspect_directory(argv[2], _POLICY_VERSION.value, _CONSUMED_LOG.value)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    app.run(main)
