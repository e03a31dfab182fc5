"""Runs one benchmark by name; see `espo_jax.bench`."""

import argparse
import importlib
import json
import os
import sys

from espo_jax.bench import NAMES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m espo_jax.bench")
    parser.add_argument("name", choices=NAMES)
    parser.add_argument("--quick", action="store_true", help="a run under a minute")
    parser.add_argument("--out", default=None, help="write the figures to this JSON file")
    args, extra = parser.parse_known_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    module = importlib.import_module(f"espo_jax.bench.{args.name}")
    if extra:  # benchmark-specific flags (e.g. zve --init_from): the module's own parser
        if not hasattr(module, "main"):
            parser.error(f"unrecognized arguments for {args.name}: {' '.join(extra)}")
        own = extra + (["--quick"] if args.quick else [])
        return module.main(own + (["--out", args.out] if args.out else []))
    figures = module.run(quick=args.quick)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": args.name, "quick": args.quick, **figures}, f, indent=2)
        print(f"figures written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
