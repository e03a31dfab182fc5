"""`config.imports`: modules a run imports before its config is validated.

A loss (or anything else that registers itself on import) lives in your own module; naming it in
`--config.imports=my_loss` makes `--config.loss.name=...` valid from the command line. Each entry
of the comma-separated string (or tuple) is

    a module name   looked up on `sys.path`, then in the working directory, then in this
                    checkout's `experiments/` (those two are appended to `sys.path`, so they
                    never shadow an installed module)
    a `.py` path    imported under its file name, its directory put first on `sys.path`

`config_validation.validate` imports them first (the main job, the standalone and vLLM workers);
`espo_jax.rollout.worker.main_from_config` imports them too, so the worker processes the learner
spawns (which build their run from the config, without validating it) have them as well.
Importing is idempotent: a module already in `sys.modules` is not run again.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from espo_jax.configs import EXPERIMENTS_DIR


def module_names(imports) -> list[str]:
    """The entries of `config.imports`: a comma-separated string or a sequence of strings."""
    if isinstance(imports, str):
        parts = imports.split(",")
    elif isinstance(imports, (list, tuple)):
        parts = [str(p) for p in imports]
    else:
        raise ValueError(f"config.imports must be a comma-separated string or a tuple of module "
                         f"names, got {imports!r}")
    return [p.strip() for p in parts if p.strip()]


def import_module(name: str):
    """Imports one entry (module doc); an error names it and where it was looked for."""
    if name.endswith(".py"):
        path = os.path.abspath(name)
        if not os.path.isfile(path):
            raise ValueError(f"config.imports: no file {name!r} (from {os.getcwd()})")
        directory, name = os.path.dirname(path), os.path.basename(path)[:-3]
        if directory not in sys.path:
            sys.path.insert(0, directory)
    else:
        top = name.partition(".")[0]
        if importlib.util.find_spec(top) is None:
            found = [d for d in (os.getcwd(), EXPERIMENTS_DIR)
                     if os.path.isfile(os.path.join(d, f"{top}.py"))
                     or os.path.isdir(os.path.join(d, top))]
            if not found:
                raise ValueError(f"config.imports: no module {name!r} on sys.path, in the "
                                 f"working directory {os.getcwd()} or in {EXPERIMENTS_DIR}")
            if found[0] not in sys.path:
                sys.path.append(found[0])
    return importlib.import_module(name)


def import_modules(config) -> list[str]:
    """Imports every module `config.imports` names (module doc); returns their names."""
    names = module_names(config.imports)
    for name in names:
        import_module(name)
    return names
