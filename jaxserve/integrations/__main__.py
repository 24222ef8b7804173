"""`python -m jaxserve.integrations --model jaxserve --model_args ... --tasks ...`: lm-eval's own
command line with the "jaxserve" model registered. lm-eval (0.4.13) finds models only in its
registry, filled by imports: nothing outside its tree is discovered, so `lm_eval --model jaxserve`
works only from Python that imported jaxserve.integrations.lm_eval first; this is that import."""

import jaxserve.integrations.lm_eval  # noqa: F401  (registers the "jaxserve" model)

if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
