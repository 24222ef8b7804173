"""Analytic KV accounting (jaxserve.tools.kv_budget), its CLI and its plots. No JAX, no model."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from fractions import Fraction

import pytest

from jaxserve.tools import kv_budget as kvb
from jaxserve.tools.architectures import load_architectures

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTHS = [37, 91, 128, 201, 511]
LLAMA3 = ["--num_layers=32", "--num_kv_heads=8", "--head_dim=128", "--dtype_bytes=2"]


# --- bytes -------------------------------------------------------------------------------------

def test_bytes_per_token_design_numbers():
    assert kvb.bytes_per_token(32, 8, 128, 2) == 131072
    assert kvb.kv_bytes([4096], 131072) == kvb.GIB // 2
    assert kvb.to_gib(kvb.kv_bytes(4096, kvb.bytes_per_token(32, 8, 128, 2))) == 0.5
    assert kvb.to_gib(kvb.kv_bytes(4096, kvb.bytes_per_token(32, 32, 128, 2))) == 2.0
    assert kvb.kv_bytes(LENGTHS, 131072) == 968 * 131072


def test_bytes_per_token_matches_model_config():
    from jaxserve.config import ModelConfig

    cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64)
    arch = kvb.KVArchitecture.from_model_config(cfg)  # float32 engine default
    assert arch.dtype_bytes == 4
    assert arch.bytes_per_token == cfg.kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4


# --- slots, pages, waste -----------------------------------------------------------------------

def test_design_example_utilisation():
    res = kvb.reserved_allocation(LENGTHS, 512)
    p16 = kvb.paged_allocation(LENGTHS, 16)
    p32 = kvb.paged_allocation(LENGTHS, 32)
    for rep in (res, p16, p32):
        assert rep.useful_slots == 968
    assert (res.allocated_slots, p16.allocated_slots, p32.allocated_slots) == (2560, 992, 1024)
    assert [round(100 * r.utilisation, 2) for r in (res, p16, p32)] == [37.81, 97.58, 94.53]
    assert res.utilisation_exact == Fraction(968, 2560)
    assert p16.tail_waste == (11, 5, 0, 7, 1)
    assert p16.total_tail_waste == 24 and p32.total_tail_waste == 56
    assert res.tail_waste == (475, 421, 384, 311, 1) and res.total_tail_waste == 1592
    assert all(0 <= w <= 15 for w in p16.tail_waste)


def test_pages_needed():
    assert kvb.pages_needed(LENGTHS, 16) == 3 + 6 + 8 + 13 + 32 == 62
    assert kvb.pages_needed(LENGTHS, 32) == 32
    assert kvb.pages_needed(16, 16) == 1 and kvb.pages_needed(17, 16) == 2
    assert kvb.pages_needed([1] * 7, 16) == 7
    for b in (1, 3, 16, 100):
        assert kvb.pages_needed(LENGTHS, b) == sum(math.ceil(t / b) for t in LENGTHS)
        assert kvb.pages_needed(LENGTHS, b) * b == kvb.paged_allocation(LENGTHS, b).allocated_slots


@pytest.mark.parametrize("m", [1, 7, 64, 100, 512, 513])
@pytest.mark.parametrize("b", [1, 2, 3, 16, 32, 48, 100, 512, 1000])
def test_mean_tail_waste_uniform_is_exact(m, b):
    brute = Fraction(sum(b * math.ceil(t / b) - t for t in range(1, m + 1)), m)
    assert kvb.mean_tail_waste_uniform(m, b) == brute
    assert kvb.mean_tail_waste_uniform(m, b) == kvb.mean_tail_waste(range(1, m + 1), b)
    if m % b == 0:
        assert kvb.mean_tail_waste_uniform(m, b) == Fraction(b - 1, 2)


def test_uniform_512_design_numbers():
    for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        assert kvb.mean_tail_waste_uniform(512, b) == Fraction(b - 1, 2)
    assert kvb.mean_reservation_waste_uniform(512) == Fraction(511, 2) == 255.5
    assert kvb.mean_reservation_waste_uniform(512, 1024) == 1024 - Fraction(513, 2)
    u = kvb.uniform_analysis(512, (16, 32), 512)
    waste = {p["label"]: p["mean_tail_waste_exact"] for p in u["policies"]}
    assert waste == {"pages of 16": "15/2", "pages of 32": "31/2", "reserve 512": "511/2"}


def test_bad_input():
    with pytest.raises(ValueError, match="num_kv_heads"):
        kvb.bytes_per_token(32, 0, 128, 2)
    with pytest.raises(ValueError, match="head_dim"):
        kvb.KVArchitecture(32, 8, -128, 2)
    with pytest.raises(ValueError, match="exceed the reservation"):
        kvb.reserved_allocation(LENGTHS, 256)
    with pytest.raises(ValueError, match="exceed the reservation"):
        kvb.mean_reservation_waste_uniform(512, 256)
    with pytest.raises(ValueError, match="page_size"):
        kvb.pages_needed(LENGTHS, 0)
    with pytest.raises(ValueError, match=r"lengths\[1\]"):
        kvb.pages_needed([3, 0], 16)
    with pytest.raises(ValueError, match="empty"):
        kvb.paged_allocation([], 16)
    with pytest.raises(ValueError):
        kvb.pages_needed([2.5], 16)


def test_architectures_file():
    archs = {a.name.split(" ")[0]: a for a in load_architectures()}
    assert archs["smollm2-135m"].bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert archs["llama-3-8b"].bytes_per_token == 131072
    assert archs["llama-2-7b"].bytes_per_token == 4 * 131072
    header, rows = kvb.gib_vs_context(list(archs.values()), [4096])
    assert header[0] == "context_tokens" and rows[0][0] == 4096
    assert rows[0][1:] == [30 * 3 * 64 * 4 * 2 * 4096 / kvb.GIB, 0.5, 2.0]


# --- CLI ---------------------------------------------------------------------------------------

def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve.cli.main", "kv_budget", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_cli_json_design_example():
    p = run_cli(*LLAMA3, "--lengths=37,91,128,201,511", "--reserve=512", "--page_sizes=16,32",
                "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["bytes_per_token"] == 131072
    s = out["lengths"]
    assert s["useful_slots"] == 968 and s["kv_bytes"] == 968 * 131072
    got = {p_["label"]: (p_["allocated_slots"], p_["utilisation_percent"], p_["total_tail_waste"])
           for p_ in s["policies"]}
    assert got == {"reserve 512": (2560, 37.81, 1592), "pages of 16": (992, 97.58, 24),
                   "pages of 32": (1024, 94.53, 56)}
    assert s["policies"][1]["tail_waste_per_request"] == [11, 5, 0, 7, 1]
    assert s["policies"][1]["pages"] == 62


def test_cli_json_uniform():
    p = run_cli(*LLAMA3, "--uniform_max=512", "--page_sizes=16,32,48", "--json")
    assert p.returncode == 0, p.stderr
    u = json.loads(p.stdout)["uniform"]
    waste = {p_["label"]: p_["mean_tail_waste_exact"] for p_ in u["policies"]}
    assert waste == {"pages of 16": "15/2", "pages of 32": "31/2", "pages of 48": "24",
                     "reserve 512": "511/2"}
    assert u["policies"][-1]["mean_tail_waste"] == 255.5


def test_cli_table_default_and_fp32_default():
    p = run_cli("--num_layers=32", "--num_kv_heads=8", "--head_dim=128", "--lengths=4096")
    assert p.returncode == 0, p.stderr
    assert "bytes per token: 262144" in p.stdout  # float32 default: 4 bytes
    assert "pages of 16" in p.stdout and "utilisation" in p.stdout


@pytest.mark.parametrize("args, message", [
    (["--num_layers=32", "--head_dim=128", "--lengths=5"], "--num_kv_heads"),
    (["--num_layers=0", "--num_kv_heads=8", "--head_dim=128", "--lengths=5"], "--num_layers"),
    (LLAMA3[:3] + ["--dtype_bytes=-2", "--lengths=5"], "--dtype_bytes"),
    (LLAMA3 + ["--lengths=5,-3"], "--lengths"),
    (LLAMA3 + ["--lengths=5,x"], "--lengths"),
    (LLAMA3 + ["--lengths=5", "--page_sizes=16,0"], "--page_sizes"),
    (LLAMA3 + ["--lengths=37,600", "--reserve=512"], "--reserve=512"),
    (LLAMA3 + ["--uniform_max=1024", "--reserve=512"], "--reserve=512"),
    (LLAMA3 + ["--uniform_max=0"], "--uniform_max"),
    (LLAMA3, "--lengths"),
    (LLAMA3 + ["--kv_cache_dtype=int8", "--lengths=5"], "--kv_cache_dtype"),
    (LLAMA3 + ["--lengths=5", "--num_speculative_tokens=17"], "--num_speculative_tokens"),
])
def test_cli_bad_input(args, message):
    p = run_cli(*args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    assert message in p.stderr and "error" in p.stderr


def test_cli_plots(tmp_path):
    p = run_cli(*LLAMA3, "--uniform_max=512", "--page_sizes=16,32", f"--plot_dir={tmp_path}",
                "--json")
    assert p.returncode == 0, p.stderr
    plots = json.loads(p.stdout)["plots"]
    for stem in ("kv_gib_vs_context", "tail_waste_vs_page_size"):
        for ext in ("png", "svg", "csv"):
            path = tmp_path / f"{stem}.{ext}"
            assert path.exists() and path.stat().st_size > 0, path
            assert plots[stem][ext] == str(path)
        assert (tmp_path / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(tmp_path / "tail_waste_vs_page_size.csv") as f:
        rows = {int(r["page_size"]): r for r in csv.DictReader(f)}
    assert rows[16]["mean_tail_waste_exact"] == "15/2"
    assert float(rows[16]["reserve_mean_waste"]) == 255.5
    with open(tmp_path / "kv_gib_vs_context.csv") as f:
        rows = {int(r["context_tokens"]): r for r in csv.DictReader(f)}
    assert float(rows[4096]["llama-3-8b (bf16) = this run_gib"]) == 0.5
    assert float(rows[4096]["llama-2-7b MHA (fp16)_gib"]) == 2.0


def test_plots_helpers(tmp_path):
    from jaxserve.tools import plots

    paths = plots.line_plot(str(tmp_path), "demo", [1, 2, 4], {"a": [1, 2, 3], "b": [3, 2, 1]},
                            title="t", xlabel="x", ylabel="y", logx=True)
    assert set(paths) == {"png", "svg", "csv"}
    assert all(os.path.getsize(p) > 0 for p in paths.values())
    with open(paths["csv"]) as f:
        assert f.read().splitlines()[0] == "x,a,b"


def test_cli_model_flag_without_weights_is_clear(tmp_path):
    # --model goes through jaxserve.weights.load_model; a bad name gives a clean error, exit 2.
    p = run_cli("--model", str(tmp_path / "no-such-model"), "--lengths=5")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and "model" in p.stderr


def test_cli_model_flag_reads_config_lazily():
    # A stub jaxserve.weights (so this does not depend on a model file): L, H_kv and d_head come
    # from load_model(name).config, dtype bytes default to 4, explicit flags override the config.
    code = """
import sys, types
from jaxserve.config import ModelConfig
stub = types.ModuleType("jaxserve.weights")
calls = []
def load_model(name):
    calls.append(name)
    return types.SimpleNamespace(config=ModelConfig(vocab_size=10, hidden_size=576,
        intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64))
stub.load_model = load_model
sys.modules["jaxserve.weights"] = stub
import jaxserve; jaxserve.weights = stub
from jaxserve.cli import main
main.run(["jaxserve"] + sys.argv[1:])
"""
    def run(*args):
        p = subprocess.run([sys.executable, "-c", code, "kv_budget", "--model=smol", *args,
                            "--lengths=4096", "--json"], cwd=REPO, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    out = run()
    assert out["architecture"]["name"] == "model smol"
    assert out["bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert run("--dtype_bytes=2")["bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    # int8 pages: one byte per scalar plus a float32 scale per token and KV head.
    assert run("--kv_cache_dtype=int8")["bytes_per_token"] == 2 * 30 * 3 * (64 + 4)
    assert run("--kv_cache_dtype=bfloat16")["bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert run("--num_layers=32", "--num_kv_heads=8", "--head_dim=128",
               "--dtype_bytes=2")["lengths"]["kv_gib"] == 0.5


def test_cli_does_not_import_weights_without_model_flag():
    code = ("import sys; from jaxserve.cli import main\n"
            "try:\n    main.run(['jaxserve'] + sys.argv[1:])\n"
            "finally:\n    print('WEIGHTS', 'jaxserve.weights' in sys.modules, 'JAX', "
            "'jax' in sys.modules, file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code, "kv_budget", *LLAMA3, "--lengths=5"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "WEIGHTS False JAX False" in p.stderr


def test_speculative_lookahead_pages():
    """A verification of k drafts holds ceil((T + k) / B) pages until it rolls back: lengths 16
    and 17 in pages of 16 with k = 4 peak at 2 + 2 pages instead of 1 + 2."""
    arch = kvb.KVArchitecture(num_layers=2, num_kv_heads=1, head_dim=4, dtype_bytes=4)
    out = kvb.analyse(arch, lengths=[16, 17], page_sizes=[16], lookahead=4)
    (la,) = out["lengths"]["speculative_lookahead"]
    assert (la["pages"], la["peak_pages"]) == (3, 4)
    assert la["extra_bytes"] == 16 * arch.bytes_per_token
    p = run_cli(*LLAMA3, "--lengths=16,17", "--page_sizes=16", "--num_speculative_tokens=4")
    assert p.returncode == 0 and "peak 4 pages (plain 3" in p.stdout, p.stderr


def test_sliding_window_pages_are_what_the_engine_holds():
    """With every layer windowed the engine releases pages wholly before the window: the
    analysis counts what KVManager.pages_to_hold does at decode, for every length and window
    around page boundaries, and the CLI reports it (lengths 100, 4096 and 20000, W = 4096,
    pages of 16: 7 + 256 + 257 pages instead of 7 + 256 + 1250)."""
    from jaxserve.core.kv_manager import KVManager
    from jaxserve.core.page_pool import PagePool

    for b in (1, 4, 16):
        for w in (1, 5, 16, 17, 33):
            kv = KVManager(PagePool(2), b, group_windows=(w,))
            for t in range(1, 120):
                assert kvb.window_pages(t, b, w) == kv.pages_to_hold(t, 1), (b, w, t)
    arch = kvb.KVArchitecture(num_layers=2, num_kv_heads=1, head_dim=4, dtype_bytes=4)
    out = kvb.analyse(arch, lengths=[100, 4096, 20000], page_sizes=[16], window=4096)
    (sw,) = out["lengths"]["sliding_window"]
    assert (sw["pages"], sw["window_pages"]) == (7 + 256 + 1250, 7 + 256 + 257)
    assert sw["window_bytes"] == 520 * 16 * arch.bytes_per_token
    p = run_cli(*LLAMA3, "--lengths=100,4096,20000", "--page_sizes=16", "--sliding_window=4096")
    assert p.returncode == 0 and "520 pages held (full length 1513" in p.stdout, p.stderr


def test_tensor_parallel_bytes_per_device():
    """SmolLM2's 3 KV heads: TP 3 gives each device one (a third of the bytes); TP 6 repeats
    each head on 2 devices, so each still holds one and 6 heads' bytes are held in all; TP 2
    fits neither way."""
    smol = ["--num_layers=30", "--num_kv_heads=3", "--head_dim=64", "--lengths=100,200", "--json"]
    per_token = 2 * 30 * 3 * 64 * 4
    for tp, heads, repeated in ((3, 1, 0), (6, 1, 3)):
        p = run_cli(*smol, f"--tensor_parallel_size={tp}")
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        d = out["per_device"]
        assert (d["kv_heads_per_device"], d["repeated_kv_heads"]) == (heads, repeated)
        assert d["bytes_per_token"] == per_token // 3
        assert d["all_devices_bytes_per_token"] == per_token // 3 * tp
        assert out["lengths"]["kv_bytes_per_device"] == 300 * per_token // 3
    p = run_cli(*smol, "--tensor_parallel_size=2")
    assert p.returncode == 2 and "must divide the model's 3 KV heads" in p.stderr
    assert "per_device" not in json.loads(run_cli(*smol).stdout)


@pytest.mark.slow
def test_memory_plan_counts_a_draft_model():
    """`--memory_budget_bytes` prints the plan the engine makes at start-up, speculation
    included: with the target's own float32 weights as the draft model, the plan's weights
    are twice the draft's, and each page holds the target's and the draft's KV."""
    p = run_cli("--model=smollm2-135m", "--memory_budget_bytes=3221225472",
                "--num_speculative_tokens=4", "--speculative_method=draft", "--max_num_seqs=4",
                "--max_num_batched_tokens=64", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    plan = out["memory_plan"]
    assert plan["weight_bytes"] == 2 * out["draft_weight_bytes"]
    assert plan["page_bytes"] == 2 * (2 * 30 * 3 * 64 * 4) * 16  # SmolLM2-135M, float32
    assert out["draft_kv_pool_bytes"] * 2 == plan["kv_pool_bytes"] == (
        plan["num_pages"] * plan["page_bytes"])
    assert plan["planned_bytes"] <= plan["budget_bytes"]
    assert "the draft model's" in out["summary"]
