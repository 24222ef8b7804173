"""The same lm-eval tasks in process (model "jaxserve") and over HTTP (lm-eval's local-completions
against `jaxserve serve` in another process): wall seconds and requests per second of each.

    python scripts/bench_lm_eval.py [--model smollm2-135m] [--docs 200] [--concurrency 1,16]

Two tasks written here over local JSON (no hub): sums_choice (multiple choice, 3 loglikelihood
requests a document) and sums_gen (generate_until, up to 8 tokens). Each way runs twice on one
engine or server: the first run compiles what warm-up left, the second is the steady number.
Timings are taken on whatever else the machine is doing: say so when quoting them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TASKS = ["sums_choice", "sums_gen"]
YAML = """task: {name}
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: {kind}
doc_to_text: "Question: What is {{{{a}}}} + {{{{b}}}}?\\nAnswer:"
doc_to_target: {target}
{extra}
"""


def write_tasks(root: str, docs: int) -> str:
    data = os.path.join(root, "sums.jsonl")
    with open(data, "w") as f:
        for i in range(docs):
            a, b = 3 + i % 47, 5 + (i * 7) % 53
            f.write(json.dumps({"a": a, "b": b, "answer": 0,
                                "choices": [str(a + b), str(a + b + 1), str(a * b)]}) + "\n")
    tasks = os.path.join(root, "tasks")
    os.makedirs(tasks)
    for name, kind, target, extra in [
            ("sums_choice", "multiple_choice", "answer",
             'doc_to_choice: "{{choices}}"\nmetric_list: [{metric: acc}]'),
            ("sums_gen", "generate_until", '"{{choices[0]}}"',
             'generation_kwargs: {until: ["\\n"], max_gen_toks: 8}\n'
             'metric_list: [{metric: exact_match}]')]:
        with open(os.path.join(tasks, f"{name}.yaml"), "w") as f:
            f.write(YAML.format(name=name, data=data, kind=kind, target=target, extra=extra))
    return tasks


def timed(model, tasks_dir: str, **kwargs) -> tuple[float, int, dict]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=tasks_dir, include_defaults=False)
    t0 = time.perf_counter()
    out = simple_evaluate(model=model, tasks=TASKS, task_manager=manager, **kwargs)
    seconds = time.perf_counter() - t0
    docs = {t: out["n-samples"][t]["effective"] for t in TASKS}
    requests = 3 * docs["sums_choice"] + docs["sums_gen"]  # a loglikelihood request per choice
    return seconds, requests, {t: out["results"][t] for t in TASKS}


def wait_ready(url: str, proc, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jaxserve serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError("jaxserve serve did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--docs", type=int, default=200)
    parser.add_argument("--concurrency", default="1,16", help="local-completions num_concurrent")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench_lm_eval_")
    tasks = write_tasks(root, args.docs)
    rows = []

    from jaxserve.integrations.lm_eval import JaxserveLM
    from jaxserve.llm import LLM

    llm = LLM(model=args.model)
    lm = JaxserveLM(llm=llm, model=args.model)
    tokenizer_dir = os.path.join(root, "tokenizer")
    llm.get_tokenizer().save(tokenizer_dir)  # local-completions tokenizes with the same vocabulary
    max_len = llm.engine.max_model_len
    for run in (1, 2):
        seconds, n, results = timed(lm, tasks)
        rows.append({"way": "in process", "run": run, "seconds": seconds, "requests": n,
                     "results": results})
        report(rows[-1])
    del lm, llm

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "jaxserve.cli.main", "serve",
                               f"--model={args.model}", f"--port={port}", "--log_level=warning"])
    try:
        wait_ready(url, server)
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            for run in (1, 2):
                seconds, n, results = timed("local-completions", tasks, model_args={
                    "base_url": url + "/v1/completions", "model": args.model,
                    "tokenizer": tokenizer_dir, "tokenizer_backend": "huggingface",
                    "max_length": max_len, "num_concurrent": concurrency, "max_retries": 1})
                rows.append({"way": f"HTTP, num_concurrent={concurrency}", "run": run,
                             "seconds": seconds, "requests": n, "results": results})
                report(rows[-1])
    finally:
        server.terminate()
        server.wait(60)
    print(json.dumps(rows, default=str))


def report(row: dict) -> None:
    print(f"{row['way']:<28} run {row['run']}: {row['seconds']:7.1f} s  "
          f"{row['requests'] / row['seconds']:6.1f} requests/s  "
          f"acc {row['results']['sums_choice']['acc,none']:.3f}  "
          f"exact_match {row['results']['sums_gen']['exact_match,none']:.3f}", flush=True)


if __name__ == "__main__":
    main()
