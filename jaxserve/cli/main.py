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
    module = importlib.import_module(SUBCOMMANDS[name][0])
    from absl import app

    if not any(a.startswith(("--verbosity", "-v")) for a in argv[2:]):
        # JAX logs every platform it probes and cannot find (libtpu.so, CUDA) at INFO: noise
        # before every answer. absl's --verbosity still shows it.
        logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

    app.run(_with_extras(name, module.main), argv=[f"jaxserve {name}"] + argv[2:])


def _with_extras(name: str, main):
    """main, with a missing optional dependency reported in one line (exit 2)."""
    from jaxserve.tools import MissingExtra

    def run_main(argv):
        try:
            return main(argv)
        except MissingExtra as e:
            print(f"jaxserve {name}: {e}", file=sys.stderr)
            return 2
    return run_main


if __name__ == "__main__":
    run()
