"""lm-evaluation-harness in process (jaxserve/integrations/lm_eval.py, `jaxserve eval`) against
its reference: lm-eval's own local-completions model over the OpenAI server, on the same engine.

Three tasks written here over a local JSON file (--include_path): multiple choice
(loglikelihood), generate_until with stop strings, and perplexity over texts longer than the
context (loglikelihood_rolling: several windows). The model is the tiny seeded one, saved as an
orbax checkpoint so `jaxserve eval` in a subprocess loads the same weights."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.registry import get_model  # noqa: E402
from serving import serve_app  # noqa: E402
from tiny_model import tiny_loaded  # noqa: E402

TASKS = ["js_choice", "js_gen", "js_ppl"]
# Through the chat template: a prefilled answer ("The answer is") the choices continue, and
# generations after the template's generation prompt.
CHAT_TASKS = ["js_prefixed", "js_gen"]
ENGINE = dict(num_pages=160, page_size=16, max_num_seqs=16, max_num_batched_tokens=256,
              huge_pages=False)
MAX_LEN = 256  # the tiny model's context

DOCS = [
    {"question": "What colour is the sky?", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "How many legs has a cat?", "choices": ["two", "four", "ten"], "answer": 1},
    {"question": "Which is a fruit?", "choices": ["chair", "river", "apple"], "answer": 2},
    {"question": "What do bees make?", "choices": ["honey", "steel", "glass"], "answer": 0},
    {"question": "Where do fish live?", "choices": ["trees", "water", "sand"], "answer": 1},
]
TEXTS = ["The river ran past the old mill and on towards the sea. " * 12,  # ~690 bytes: 3 windows
         "A short line.", "Numbers: 1, 2, 3, 5, 8, 13, 21, 34, 55, 89. " * 3]

TASK_YAML = {
    "js_choice": """task: js_choice
dataset_path: json
dataset_kwargs: {{data_files: {{test: {docs}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
""",
    "js_gen": """task: js_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {docs}}}}}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs: {{until: ["\\n", "e"], max_gen_toks: 12, do_sample: false, temperature: 0.0}}
metric_list: [{{metric: exact_match}}]
""",
    "js_prefixed": """task: js_prefixed
dataset_path: json
dataset_kwargs: {{data_files: {{test: {docs}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
gen_prefix: "The answer is"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list: [{{metric: acc}}]
""",
    "js_ppl": """task: js_ppl
dataset_path: json
dataset_kwargs: {{data_files: {{test: {texts}}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list: [{{metric: word_perplexity}}, {{metric: bits_per_byte}}]
""",
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The task directory and the tiny model's orbax checkpoint (its tokenizer beside it)."""
    from jaxserve.weights.orbax_io import save_orbax

    root = tmp_path_factory.mktemp("lm_eval")
    docs, texts = root / "docs.jsonl", root / "texts.jsonl"
    docs.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    tasks = root / "tasks"
    tasks.mkdir()
    for name, template in TASK_YAML.items():
        (tasks / f"{name}.yaml").write_text(template.format(docs=docs, texts=texts))
    save_orbax(str(root / "model"), tiny_loaded(seed=3, max_len=MAX_LEN))
    return root


@pytest.fixture(scope="module")
def engine(workdir):
    from jaxserve.config import EngineConfig
    from jaxserve.engine import make_engine

    return make_engine(EngineConfig.from_options(model=str(workdir / "model"), **ENGINE))


def _evaluate(model, workdir, **kwargs) -> dict:
    """TASKS as they are, and CHAT_TASKS through the chat template: {"plain": .., "chat": ..}."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # lm-eval's own ~14k task files are not indexed (half a minute on this machine)
    tasks = TaskManager(include_path=str(workdir / "tasks"), include_defaults=False)
    if isinstance(model, str):
        model = get_model(model).create_from_arg_obj(kwargs.pop("model_args"))
    return {"plain": simple_evaluate(model=model, tasks=TASKS, log_samples=True,
                                     task_manager=tasks, **kwargs),
            "chat": simple_evaluate(model=model, tasks=CHAT_TASKS, log_samples=True,
                                    task_manager=tasks, apply_chat_template=True, **kwargs)}


@pytest.fixture(scope="module")
def in_process(engine, workdir):
    from jaxserve.integrations.lm_eval import JaxserveLM
    from jaxserve.llm import LLM

    return _evaluate(JaxserveLM(llm=LLM.from_engine(engine)), workdir)


@pytest.fixture(scope="module")
def over_http(in_process, engine, workdir):
    """The same tasks through lm-eval's local-completions model and the OpenAI server (after the
    in-process run: one engine, driven by one of them at a time)."""
    from jaxserve.server import AsyncEngine, ServerConfig, build_app

    aengine = AsyncEngine(engine)
    try:
        with serve_app(build_app(aengine, ServerConfig())) as url:
            return _evaluate("local-completions", workdir, model_args={
                "base_url": url + "/v1/completions", "model": str(workdir / "model"),
                "tokenizer": str(workdir / "model" / "tokenizer"),
                "tokenizer_backend": "huggingface", "max_length": MAX_LEN, "max_retries": 1})
    finally:
        aengine.shutdown()


def _responses(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def _assert_same(ours: dict, reference: dict, tasks=TASKS) -> None:
    for task in tasks:
        mine, theirs = _responses(ours, task), _responses(reference, task)
        assert len(mine) == len(theirs) == len(DOCS if task != "js_ppl" else TEXTS)
        for a, b in zip(mine, theirs):  # written samples hold numbers and flags as strings
            if task == "js_gen":
                assert a == b  # generations: the same text
            elif task in ("js_choice", "js_prefixed"):  # [[(logprob, greedy)], ...] a choice
                np.testing.assert_allclose([float(r[0][0]) for r in a],
                                           [float(r[0][0]) for r in b], atol=1e-4)
                assert [str(r[0][1]) for r in a] == [str(r[0][1]) for r in b]
            else:  # one rolling logprob per text
                np.testing.assert_allclose(float(a[0][0]), float(b[0][0]), atol=1e-4)


def test_greedy_continuations_are_flagged(engine):
    """A continuation the model itself chose greedily scores is_greedy True; the same with its
    last token changed, False, and its logprob is lower. (Runs before the server takes the
    engine: the tiny model's choices are all far from greedy, so the comparison with the
    server checks the flag only as False.)"""
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.integrations.lm_eval import JaxserveLM
    from jaxserve.llm import LLM

    llm = LLM.from_engine(engine)
    context = engine.tokenizer.encode("Question: What do bees make?\nAnswer:")
    [out] = llm.generate({"prompt_token_ids": context},
                         SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    greedy = out.outputs[0].token_ids
    other = greedy[:-1] + [(greedy[-1] + 1) % 256]
    lm = JaxserveLM(llm=llm)
    [(lp_greedy, is_greedy), (lp_other, other_greedy)] = lm._loglikelihood_tokens(
        [(None, context, greedy), (None, context, other)], disable_tqdm=True)
    assert is_greedy and not other_greedy
    assert lp_other < lp_greedy < 0


def _assert_same_metrics(ours: dict, reference: dict, tasks=TASKS) -> None:
    for task in tasks:  # the metrics follow from the responses
        for key, value in ours["results"][task].items():
            if isinstance(value, float):
                assert reference["results"][task][key] == pytest.approx(value, rel=1e-5), key


def test_in_process_equals_local_completions_over_http(in_process, over_http):
    _assert_same(in_process["plain"], over_http["plain"])
    _assert_same_metrics(in_process["plain"], over_http["plain"])
    gens = [r[0][0] for r in _responses(in_process["plain"], "js_gen")]
    assert all("\n" not in g and "e" not in g for g in gens), gens  # cut at the stop strings
    assert any(gens), "every generation stopped at once: the stop strings test nothing"


def test_chat_template_prompts_equal_local_completions(in_process, over_http):
    """With --apply_chat_template both render the model's template the same way, a prefilled
    answer left open (transformers' continue_final_message on the HTTP side)."""
    chat = in_process["chat"]
    _assert_same(chat, over_http["chat"], CHAT_TASKS)
    _assert_same_metrics(chat, over_http["chat"], CHAT_TASKS)
    [prefixed] = [s for s in chat["samples"]["js_prefixed"] if s["doc_id"] == 0]
    context = prefixed["arguments"][0][0]  # (context, continuation) of the first choice
    assert context == f"<user>{DOCS[0]['question']}\n<assistant>The answer is", context
    [gen] = [s for s in chat["samples"]["js_gen"] if s["doc_id"] == 0]
    assert gen["arguments"][0][0].endswith("\n<assistant>")  # (context, gen_kwargs)


def test_rolling_windows_cover_a_text_longer_than_the_context(engine):
    """The long text (one token per byte) needs several windows, so the equality above covers
    windows after the first (each scores only its own tokens, conditioned on the previous)."""
    from lm_eval.utils import get_rolling_token_windows

    ids = engine.tokenizer.encode(TEXTS[0], add_special_tokens=False)
    assert len(list(get_rolling_token_windows(ids, 0, MAX_LEN - 2, 1))) >= 3


def test_lm_eval_finds_the_model_by_name(workdir):
    """`--model jaxserve --model_args model=...,<engine options>` once the module is imported
    (lm-eval 0.4.13 has no plugin discovery)."""
    from lm_eval.api.registry import get_model

    from jaxserve.integrations.lm_eval import JaxserveLM

    assert get_model("jaxserve") is JaxserveLM
    lm = JaxserveLM.create_from_arg_string(
        f"model={workdir / 'model'},num_pages=32,max_model_len=128,huge_pages=False",
        {"batch_size": 1, "device": "cpu"})
    assert (lm.max_length, lm.tokenizer_name) == (128, str(workdir / "model").replace("/", "__"))
    with pytest.raises(ValueError, match="not both"):
        JaxserveLM(llm=lm.llm, num_pages=32)


def test_bad_gen_kwargs_are_refused(engine):
    from jaxserve.integrations.lm_eval import JaxserveLM
    from jaxserve.llm import LLM

    lm = JaxserveLM(llm=LLM.from_engine(engine))
    with pytest.raises(ValueError, match=r"\['num_beams'\] are not supported"):
        lm._sampling_params({"until": ["\n"], "num_beams": 4})
    with pytest.raises(ValueError, match="top_p must be"):
        lm._sampling_params({"temperature": 0.5, "top_p": 0})
    params, until = lm._sampling_params({"until": "\n\n", "do_sample": True, "top_k": 5})
    assert (params.temperature, params.top_k, params.stop, until) == (1.0, 5, ["\n\n"], ["\n\n"])
    assert params.seed == lm.seed  # sampled generations are reproducible
    assert lm._sampling_params({})[0].max_tokens == MAX_LEN - 1  # the default (256) is cut


def test_cli_on_two_data_parallel_replicas_equals_one_in_process(in_process, workdir):
    """`jaxserve eval` with two replicas on two virtual CPU devices writes, where lm_eval
    writes them, results and samples equal to the single in-process engine's."""
    out = workdir / "out"
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    flags = [f"--{k}={v}" for k, v in ENGINE.items() if not isinstance(v, bool)]
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli.main", "eval", f"--model={workdir / 'model'}",
         *flags, "--nohuge_pages", "--data_parallel_size=2", f"--tasks={','.join(TASKS)}",
         f"--include_path={workdir / 'tasks'}", "--noinclude_defaults", f"--output_path={out}",
         "--log_samples"],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "js_choice" in proc.stdout  # lm_eval's table
    [results_file] = glob.glob(str(out / "*" / "results_*.json"))
    written = json.loads(open(results_file).read())
    assert written["config"]["model_args"]["data_parallel_size"] == 2
    samples = {}
    for task in TASKS:
        [path] = glob.glob(str(out / "*" / f"samples_{task}_*.jsonl"))
        samples[task] = [json.loads(line) for line in open(path)]
    _assert_same(in_process["plain"], {"samples": samples})
    _assert_same_metrics(in_process["plain"], written)
