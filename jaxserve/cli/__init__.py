"""Command-line front end: `jaxserve <subcommand> --flags` (absl flags)."""
