"""Multi-LoRA decode throughput against the base, and the two ways of computing the delta.

    PYTHONPATH=. python scripts/bench_lora.py                 # both parts
    PYTHONPATH=. python scripts/bench_lora.py --part engine --input_len=16 --output_len=64

engine: writes 8 random rank-16 adapters on all seven projections of --model (PEFT
directories) and runs `jaxserve bench --lora_modules ... --max_loras=8 --max_lora_rank=16` on
them (jaxserve/tools/bench/lora.py measures: base vs LoRA at 1 and 32 streams); other
arguments go to the bench.

delta: the two ways model/lora.py computes the delta (every slot's x @ A^T masked to the
token's slot, then @ B; or each token's A[slot] and B[slot] gathered), jitted on this host, for
T tokens over 9 slots of rank 16 at the 135M model's q (576 -> 576) and down (1536 -> 576)
projections."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

RANK, ADAPTERS = 16, 8
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: str, cfg, rng) -> None:
    """A PEFT LoRA directory of rank RANK on every projection, A and B random."""
    from safetensors.numpy import save_file

    from jaxserve.weights.lora import module_shapes

    os.makedirs(path, exist_ok=True)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, (fan_in, fan_out) in module_shapes(cfg).items():
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = rng.standard_normal((RANK, fan_in), np.float32) * .05
            tensors[f"{key}.lora_B.weight"] = rng.standard_normal((fan_out, RANK), np.float32) * .05
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK,
                   "target_modules": list(MODULES)}, f)


def engine_part(args, bench_args: list[str]) -> None:
    """ADAPTERS adapters for --model's shapes, then `jaxserve bench --lora_modules ...`."""
    from jaxserve.weights import load_model

    cfg = load_model(args.model).config
    root = tempfile.mkdtemp(prefix="lora-bench-")
    rng = np.random.default_rng(0)
    modules = []
    for i in range(ADAPTERS):
        write_adapter(f"{root}/a{i}", cfg, rng)
        modules.append(f"--lora_modules=a{i}={root}/a{i}")
    subprocess.check_call([sys.executable, "-m", "jaxserve.cli.main", "bench",
                           f"--model={args.model}", *modules, f"--max_loras={ADAPTERS}",
                           f"--max_lora_rank={RANK}", *bench_args])


def delta_part(args) -> None:
    import jax
    import jax.numpy as jnp

    def masked(x, a, b, slots):  # every slot's x @ A^T, the token's kept (model/lora.py)
        s, r, _ = a.shape
        shrunk = (x @ a.reshape(s * r, -1).T).reshape(-1, s, r)
        mine = (slots[:, None] == jnp.arange(s, dtype=slots.dtype)).astype(shrunk.dtype)
        return (shrunk * mine[:, :, None]).reshape(-1, s * r) @ b.reshape(s * r, -1)

    def gathered(x, a, b, slots):  # each token's own A and B (model/lora.py's small steps)
        return jnp.einsum("tr,tro->to", jnp.einsum("ti,tri->tr", x, a[slots]), b[slots])

    rng = np.random.default_rng(0)
    slots_n = ADAPTERS + 1
    for name, (fan_in, fan_out) in (("q 576->576", (576, 576)), ("down 1536->576", (1536, 576))):
        a = jnp.asarray(rng.standard_normal((slots_n, RANK, fan_in), np.float32))
        b = jnp.asarray(rng.standard_normal((slots_n, RANK, fan_out), np.float32))
        for t in (1, 32, 512):
            x = jnp.asarray(rng.standard_normal((t, fan_in), np.float32))
            slots = jnp.asarray(rng.integers(0, slots_n, t), jnp.int32)
            timings = {}
            for label, fn in (("masked", masked), ("gather", gathered)):
                f = jax.jit(fn)
                np.testing.assert_allclose(f(x, a, b, slots), jax.jit(masked)(x, a, b, slots),
                                           rtol=1e-3, atol=1e-2)
                f(x, a, b, slots).block_until_ready()
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < args.seconds:
                    f(x, a, b, slots).block_until_ready()
                    n += 1
                timings[label] = (time.perf_counter() - t0) / n * 1e6
            print(f"{name:15s} T={t:4d}: masked {timings['masked']:8.1f} us, "
                  f"gather {timings['gather']:8.1f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("engine", "delta", "both"), default="both")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seconds", type=float, default=1.0, help="per delta timing")
    args, bench_args = parser.parse_known_args()
    if args.part in ("delta", "both"):
        delta_part(args)
    if args.part in ("engine", "both"):
        engine_part(args, bench_args)


if __name__ == "__main__":
    main()
