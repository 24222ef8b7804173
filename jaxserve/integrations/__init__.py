"""Adapters that let other tools drive the engine in process: `lm_eval` (lm-evaluation-harness,
the `eval` extra) and `ray` (batch files over Ray replicas and a Ray Data processor, the `ray`
extra). Each module imports its tool through jaxserve.tools.require, so a missing one names the
extra to install."""
