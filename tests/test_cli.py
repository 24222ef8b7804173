"""`jaxserve generate` end to end through the installed console script, and its bad-input paths:
each gives a clear message naming the problem and exit status 2, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

# The installed console script when present, else the same entry point through the interpreter.
JAXSERVE = [shutil.which("jaxserve")] if shutil.which("jaxserve") else [
    sys.executable, "-m", "jaxserve.cli.main"]


def run(*args, timeout=300):
    return subprocess.run(JAXSERVE + list(args), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_chat_answers_paris(default_model_path):
    proc = run("generate", "--chat", "--prompt=What is the capital of France?",
               "--temperature=0", "--max_tokens=16", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "Paris" in out["text"]
    assert out["finish_reason"] == "stop"
    assert out["token_ids"] and out["prompt_token_ids"]
    assert out["timings"]["ttft_s"] > 0


@pytest.mark.parametrize("flag,message", [
    ("--temperature=-1", "temperature must be a finite number in [0, 10000]"),
    ("--top_p=0", "top_p must be a finite number in (0, 1]"),
    ("--top_p=1.5", "top_p must be a finite number in (0, 1]"),
    ("--max_tokens=0", "max_tokens must be an integer in [1, 2147483647]"),
    ("--model=no-such-model", "no-such-model"),
    ("--model=/nonexistent/model.gguf", "/nonexistent/model.gguf"),
    ("--page_size=0", "page_size must be >= 1"),
])
def test_bad_input_gives_clear_error(flag, message):
    proc = run("generate", "--prompt=hello", flag)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_prompt_longer_than_context(default_model_path):
    proc = run("generate", "--prompt=" + "word " * 200, "--max_model_len=64")
    assert proc.returncode == 2
    assert "max_model_len" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_subcommand():
    proc = run("frobnicate")
    assert proc.returncode == 2 and "unknown subcommand" in proc.stderr


def test_bad_model_files_are_one_line_and_exit_2(tmp_path):
    """A truncated GGUF and broken config.json files were tracebacks (struct.error, KeyError)
    or a JSON error naming no file: generate and serve say in one line which file is wrong."""
    from test_weights import bad_model_files

    cases = bad_model_files(tmp_path)
    for name, (path, fault) in cases.items():
        proc = run("generate", "--prompt=hi", f"--model={path}")
        errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (name, proc.stderr)
        assert len(errors) == 1 and str(path) in errors[0] and fault in errors[0], errors
    path, fault = cases["not-json"]
    proc = run("serve", f"--model={path}", "--port=0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"jaxserve serve: error: {path}" in proc.stderr and fault in proc.stderr


def test_no_tpu_probe_noise_on_a_host_without_one(tmp_path):
    """With libtpu installed every jaxserve process printed libtpu's probe errors (E0000 ...
    unexpected worker hostname) on a host with no TPU; the CLI leaves the TPU out there."""
    pytest.importorskip("libtpu")
    from jax._src import hardware_utils

    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        pytest.skip("this host has a TPU")
    from test_weights import write_tiny_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "Q8_0", True)
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run(JAXSERVE + ["generate", "--prompt=hi", "--max_tokens=1",
                                      f"--model={tmp_path / 'tiny.gguf'}"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "TPU" not in proc.stderr and "E0000" not in proc.stderr, proc.stderr
