"""`jaxserve` entry point: dispatches to one subcommand module, which defines its own absl flags.

Only the chosen subcommand's module is imported, so each subcommand sees only its own flags.
"""

from __future__ import annotations

import importlib
import logging
import sys

SUBCOMMANDS = {
    "generate": ("jaxserve.cli.generate", "generate text from a prompt"),
    "serve": ("jaxserve.cli.serve", "run the OpenAI-compatible HTTP server"),
    "batch": ("jaxserve.cli.batch", "run an OpenAI batch file (JSONL) through the engine"),
    "bench": ("jaxserve.cli.bench", "serving benchmark under a stated workload"),
    "kv_budget": ("jaxserve.cli.kv_budget", "analytic KV-cache memory accounting"),
    "compile": ("jaxserve.cli.compile", "compile the engine's shapes ahead of time: for a TPU "
                "topology from any machine (plan and check), or into this host's cache"),
    "eval": ("jaxserve.cli.eval", "lm-evaluation-harness tasks on the in-process engine"),
}


def _usage() -> str:
    lines = ["usage: jaxserve <subcommand> [--flags]", "", "subcommands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines.append("\n`jaxserve <subcommand> --helpfull` lists a subcommand's flags.")
    return "\n".join(lines)


def run(argv: list[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(_usage())
        sys.exit(0 if len(argv) >= 2 else 2)
    name = argv[1]
    if name not in SUBCOMMANDS:
        print(f"jaxserve: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        sys.exit(2)
    _leave_out_an_absent_tpu()
    _define_common_flags()
    module = importlib.import_module(SUBCOMMANDS[name][0])
    from absl import app

    if not any(a.startswith(("--verbosity", "-v")) for a in argv[2:]):
        # JAX logs every platform it probes and cannot find (libtpu.so, CUDA) at INFO: noise
        # before every answer. absl's --verbosity still shows it.
        logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

    app.run(_with_extras(name, module.main), argv=[f"jaxserve {name}"] + argv[2:])


def _leave_out_an_absent_tpu() -> None:
    """With libtpu installed (the test extra, `jaxserve compile --topology`) JAX probes a TPU in
    every process, and on a host without one libtpu prints errors (`E0000 ... unexpected worker
    hostname`). Unless JAX_PLATFORMS (or JAX_FORCE_TPU_INIT) says otherwise, a host whose PCI
    bus shows no TPU chip runs on its GPU or CPU. Compiling for a TPU topology needs libtpu's
    compiler only, not the TPU platform."""
    import importlib.util
    import os

    if ("JAX_PLATFORMS" in os.environ or "JAX_FORCE_TPU_INIT" in os.environ
            or importlib.util.find_spec("libtpu") is None):
        return
    try:  # JAX's own test for attached TPU chips (cloud_tpu_init's)
        from jax._src import hardware_utils

        if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
            return
        cuda = hardware_utils.has_visible_nvidia_gpu() and any(
            importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    except (ImportError, AttributeError, OSError):  # a JAX without it: leave JAX to choose
        return
    import jax

    platforms = "cuda,cpu" if cuda else "cpu"
    os.environ["JAX_PLATFORMS"] = platforms  # for child processes; JAX read it at import
    jax.config.update("jax_platforms", platforms)


def _define_common_flags() -> None:
    """Flags every subcommand takes."""
    from absl import flags

    if "compilation_cache_dir" not in flags.FLAGS:
        flags.DEFINE_string(
            "compilation_cache_dir", None,
            "JAX's persistent compilation cache (default: $JAX_COMPILATION_CACHE_DIR, else "
            "$XDG_CACHE_HOME/jaxserve/xla); `jaxserve compile` fills it for later starts.")


def _use_cache_dir() -> None:
    """--compilation_cache_dir, for this process and its children (JAX reads the variable)."""
    import os

    from absl import flags

    path = flags.FLAGS.compilation_cache_dir
    if path:
        import jax

        path = os.path.abspath(os.path.expanduser(path))
        os.environ["JAX_COMPILATION_CACHE_DIR"] = path
        jax.config.update("jax_compilation_cache_dir", path)


def _with_extras(name: str, main):
    """main, with a missing optional dependency reported in one line (exit 2)."""
    from jaxserve.tools import MissingExtra

    def run_main(argv):
        _use_cache_dir()
        try:
            return main(argv)
        except MissingExtra as e:
            print(f"jaxserve {name}: {e}", file=sys.stderr)
            return 2
    return run_main


if __name__ == "__main__":
    run()
