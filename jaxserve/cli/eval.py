"""`jaxserve eval`: lm-evaluation-harness tasks on one in-process engine (the `eval` extra).

Flags are named as lm_eval's own; results and samples are written where and as lm_eval writes
them (its EvaluationTracker: OUTPUT_PATH/<model>/results_<time>.json, samples_<task>_<time>.jsonl).
"""

from __future__ import annotations

import json
import sys

from absl import flags

from jaxserve.cli import engine_flags  # noqa: F401  (defines the engine flags, --seed among them)

flags.DEFINE_list("tasks", None, "lm-eval task or group names, comma-separated.", required=True)
flags.DEFINE_multi_string("include_path", None, "Directory of extra task YAML files.")
flags.DEFINE_bool("include_defaults", True, "Index lm-eval's own tasks too (off: only "
                  "--include_path's, which skips reading its ~14k task files).")
flags.DEFINE_integer("num_fewshot", None, "Few-shot examples per prompt (default: the task's).")
flags.DEFINE_float("limit", None, "Documents per task; below 1, a fraction of them "
                   "(testing only: the metrics are not comparable).")
flags.DEFINE_string("output_path", None, "Directory for results (and samples) JSON.")
flags.DEFINE_bool("log_samples", False, "Also write every sample's prompt and response "
                  "(needs --output_path).")
flags.DEFINE_bool("apply_chat_template", False, "Render prompts with the model's chat template.")
flags.DEFINE_bool("fewshot_as_multiturn", False, "Few-shot examples as chat turns "
                  "(with --apply_chat_template).")
flags.DEFINE_string("system_instruction", None, "System message for every prompt.")
flags.DEFINE_string("gen_kwargs", None, "key=value,... overriding the tasks' generation "
                    "settings (temperature, max_gen_toks, until, top_p, top_k, ...).")
flags.DEFINE_integer("max_gen_toks", 256, "Most generated tokens where a task sets none.")
flags.DEFINE_bool("confirm_run_unsafe_code", False, "Allow tasks that execute model output.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    from jaxserve.tools import require

    require("lm_eval", "eval")
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable, make_table

    from jaxserve.integrations.lm_eval import JaxserveLM
    from jaxserve.llm import LLM
    from jaxserve.runtime.distributed import PeerLostError

    if FLAGS.log_samples and not FLAGS.output_path:
        print("jaxserve eval: error: --log_samples needs --output_path", file=sys.stderr)
        return 2
    options = engine_flags.engine_options()
    try:
        llm = LLM(**options)
        if FLAGS.process_id != 0:  # another process runs the evaluation: run its steps here
            llm.engine.follow()
            return 0
        tracker = EvaluationTracker(output_path=FLAGS.output_path)
        # lm-eval's seeds (random, numpy, torch, few-shot) are its defaults unless --seed is given
        seeds = [FLAGS.seed] * 4 if FLAGS["seed"].present else [0, 1234, 1234, 1234]
        results = simple_evaluate(
            model=JaxserveLM(llm=llm, model=options.get("model"), max_gen_toks=FLAGS.max_gen_toks,
                             seed=seeds[1]),
            model_args={k: v for k, v in options.items() if v is not None},
            tasks=FLAGS.tasks, num_fewshot=FLAGS.num_fewshot, limit=FLAGS.limit,
            log_samples=FLAGS.log_samples, evaluation_tracker=tracker,
            system_instruction=FLAGS.system_instruction,
            apply_chat_template=FLAGS.apply_chat_template,
            fewshot_as_multiturn=FLAGS.fewshot_as_multiturn, gen_kwargs=FLAGS.gen_kwargs,
            task_manager=TaskManager(include_path=FLAGS.include_path,
                                     include_defaults=FLAGS.include_defaults),
            random_seed=seeds[0], numpy_random_seed=seeds[1], torch_random_seed=seeds[2],
            fewshot_random_seed=seeds[3], confirm_run_unsafe_code=FLAGS.confirm_run_unsafe_code)
        llm.engine.stop_followers()
    except ValueError as e:  # bad input (an unknown task, a gen_kwarg out of range): no traceback
        print(f"jaxserve eval: error: {e}", file=sys.stderr)
        return 2
    except PeerLostError as e:
        print(f"jaxserve eval: error: {e}", file=sys.stderr)
        return 1
    samples = results.pop("samples", None)
    if FLAGS.output_path:
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results["configs"] if samples else ():
            tracker.save_results_samples(task_name=task, samples=samples[task])
    else:  # no file: the whole results object on stdout, before the table
        print(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    return 0
