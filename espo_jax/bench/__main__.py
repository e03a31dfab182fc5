"""`python -m espo_jax.bench NAME [--quick] [--out FILE.json]`: runs one benchmark by name.

NAME is one of model, buffer, engine, zve, attention, peers, packing, profile, device_check,
linear_decode, real, mla_decode, aot, scan (see `espo_jax.bench`). zve also takes
`--init_from WORKDIR`, `--budget TOKENS` and `--prompts N` (`espo_jax.bench.zve`); device_check
`--dry_run` and `--budget_s S`, and writes --out after each of its sections
(`espo_jax.bench.device_check`); profile `--programs a,b` (`espo_jax.bench.profile.PROGRAMS`);
aot `--config EXPERIMENT` and `--topology TOPOLOGY` (`espo_jax.bench.aot`); real
`--sections a,b` (`espo_jax.bench.real.SECTIONS`).
"""

import importlib
import json
import os

from absl import app, flags

from espo_jax.bench import NAMES

_QUICK = flags.DEFINE_bool("quick", False, "a run under a minute (zve: on another model, the "
                           "`tiny` one of experiments/arith_espo.py:small, not its `small`)")
_OUT = flags.DEFINE_string("out", None, "write the figures to this JSON file")
# A benchmark's own flags -> the keyword arguments of its `run`.
_INIT_FROM = flags.DEFINE_string(
    "init_from", None, "zve: main-job WORKDIR (or its checkpoints/) holding the warm-started "
    "params: of the `small` model (a run of experiments/arith_espo.py), with --quick of the "
    "`tiny` one (a run of experiments/arith_espo.py:small)")
_BUDGET = flags.DEFINE_integer("budget", None, "zve: generated tokens per configuration",
                               lower_bound=1)
_PROMPTS = flags.DEFINE_integer("prompts", None, "zve: RL prompt pool size", lower_bound=1)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "device_check: the same code on the CPU, tiny")
_BUDGET_S = flags.DEFINE_float("budget_s", None, "device_check: total seconds (default: its own)")
_CONFIG = flags.DEFINE_string("config", None, "aot: the experiment, e.g. "
                              "experiments/qwen3_30b_a3b.py:devices=16,expert=8")
_TOPOLOGY = flags.DEFINE_string("topology", None, "aot: the TPU slice, e.g. v5p:2x2x4 or v5p-32")
_PROGRAMS = flags.DEFINE_list("programs", None, "profile: the programs to profile "
                               "(espo_jax.bench.profile.PROGRAMS)")
_SECTIONS = flags.DEFINE_list("sections", None, "real: the sections to run (default all of "
                              "espo_jax.bench.real.SECTIONS)")
OWN_FLAGS = {"zve": {"init_from": _INIT_FROM, "budget_tokens": _BUDGET, "prompts": _PROMPTS},
             "device_check": {"dry_run": _DRY_RUN, "budget_s": _BUDGET_S},
             "profile": {"programs": _PROGRAMS},
             "real": {"sections": _SECTIONS},
             "aot": {"config": _CONFIG, "topology": _TOPOLOGY}}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in NAMES:
        raise app.UsageError(f"give one benchmark NAME, one of {', '.join(NAMES)}; got "
                             f"{' '.join(argv[1:]) or 'none'}")
    name = argv[1]
    own = OWN_FLAGS.get(name, {})
    foreign = [h.name for bench, holders in OWN_FLAGS.items() if bench != name
               for h in holders.values() if h.present]
    if foreign:
        raise app.UsageError(f"--{', --'.join(foreign)}: not a flag of the {name} benchmark")
    if _INIT_FROM.value and not os.path.isdir(_INIT_FROM.value):
        raise app.UsageError(f"--init_from {_INIT_FROM.value!r} is not a directory")
    from espo_jax import host_memory

    # under glibc's huge pages as the main job runs (a restart); bench peers starts its peers
    # in a child process with glibc's defaults (`espo_jax.bench.peer_process`)
    host_memory.reexec_with_huge_pages()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from espo_jax import console

    console.quiet(flags.FLAGS.verbosity)  # library INFO records off the console (as the main job)
    from espo_jax import cli_errors

    module = importlib.import_module(f"espo_jax.bench.{name}")
    kwargs = {k: h.value for k, h in own.items()}
    if name == "device_check":  # its figures reach --out after each section, not only the last
        kwargs["out"] = _OUT.value
    try:
        figures = module.run(quick=_QUICK.value, **kwargs)
    except cli_errors.CommandLineError as e:  # one message (--verbosity=1: the traceback)
        return cli_errors.fail(e, flags.FLAGS.verbosity)
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump({"benchmark": name, "quick": _QUICK.value, **figures}, f, indent=2)
        print(f"figures written to {_OUT.value}")
    return 0


if __name__ == "__main__":
    app.run(main)
