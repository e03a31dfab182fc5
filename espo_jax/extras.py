"""Optional packages: the paths `pip install -e .` does not cover, and the extra that does.

`setup.py` installs them with `pip install -e '.[NAME]'`; the config validation (`missing`) and
the code that imports them (`require`) name what is absent and that command, before any work
instead of a ModuleNotFoundError mid-run.
"""

from __future__ import annotations

import importlib.util

# extra -> (what needs it, the modules it imports); the pins are setup.py's
EXTRAS = {
    "gguf": ("GGUF checkpoints (read through transformers)",
             ("torch", "transformers", "gguf", "accelerate")),
    "parquet": ("Parquet prompt files", ("pyarrow",)),
}


def missing(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here."""
    return [m for m in EXTRAS[extra][1] if importlib.util.find_spec(m) is None]


def hint(extra: str, absent: list[str]) -> str:
    """'<what> need(s) the packages ... (not installed): pip install -e '.[extra]''."""
    return (f"{EXTRAS[extra][0]} need the package{'s' if len(absent) > 1 else ''} "
            f"{', '.join(absent)} (not installed): pip install -e '.[{extra}]'")


def require(extra: str) -> None:
    """Raises ModuleNotFoundError naming the absent modules of `extra` and its install
    command."""
    absent = missing(extra)
    if absent:
        raise ModuleNotFoundError(hint(extra, absent), name=absent[0])
