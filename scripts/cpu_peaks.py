"""The CPU's arithmetic peaks, measured: f32 FMAs (AVX-512, else AVX2) and, where the CPU has
AMX, bf16 tile products. Each is a register-only loop (no memory traffic) built with the
machine's C++ compiler and run on every core at once; the sum is the machine's peak.
perf_report's compute bound uses the f32 matmul rate XLA reaches; this says how far that and the
engine's kernels are from the silicon, and what an AMX path could buy.

  python scripts/cpu_peaks.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxserve.backends.cpu import kernels as cpu_kernels  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_float("seconds", 1.5, "Roughly how long each loop runs.")

# Independent accumulators enough to cover the FMA latency on both ports: 16 of AVX-512's 32
# registers, or 12 of AVX2's 16 (Zen 3 needs 8: 4 cycles' latency on 2 ports).
FMA = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#if defined(__AVX512F__)
using V = __m512;
constexpr int kAcc = 16, kLanes = 16;
inline V Set(float x) { return _mm512_set1_ps(x); }
inline V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float Sum(V a) { return _mm512_reduce_add_ps(a); }
#else
using V = __m256;
constexpr int kAcc = 12, kLanes = 8;
inline V Set(float x) { return _mm256_set1_ps(x); }
inline V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float Sum(V a) {
  float l[8];
  _mm256_storeu_ps(l, a);
  return l[0] + l[1] + l[2] + l[3] + l[4] + l[5] + l[6] + l[7];
}
#endif
int main(int argc, char** argv) {
  const long n = atol(argv[1]);
  V a[kAcc];
  for (int i = 0; i < kAcc; ++i) a[i] = Set(1.0f + i * 1e-7f);
  const V b = Set(0.9999999f), c = Set(1e-8f);
  const auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < n; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kAcc; ++i) a[i] = Fma(a[i], b, c);
  }
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float s = 0;
  for (int i = 0; i < kAcc; ++i) s += Sum(a[i]);
  printf("%.6g %g\n", n * kAcc * 2.0 * kLanes / dt / 1e9, s);
}
"""

# Four 16x16 f32 accumulator tiles, each += a 16x32 bf16 tile times a 32x16 one per instruction.
AMX = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
struct alignas(64) TileConfig { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
int main(int argc, char** argv) {
  const long n = atol(argv[1]);
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    printf("0 denied\n");
    return 0;
  }
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  alignas(64) static uint16_t ones[16 * 32];
  alignas(64) static float out[16 * 16];
  for (auto& v : ones) v = 0x3f80;  // bf16 1.0
  _tile_loadd(4, ones, 64); _tile_loadd(5, ones, 64); _tile_loadd(6, ones, 64); _tile_loadd(7, ones, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  const auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < n; ++it) {
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  _tile_stored(0, out, 64);
  _tile_release();
  printf("%.6g %g\n", n * 4.0 * 16 * 16 * 32 * 2 / dt / 1e9, out[0]);
}
"""


def _build(source: str, name: str, workdir: str) -> str:
    cxx = cpu_kernels.compiler()
    if cxx is None:
        sys.exit("no C++ compiler (g++/c++ or $CXX)")
    src, exe = os.path.join(workdir, name + ".cc"), os.path.join(workdir, name)
    Path(src).write_text(source)
    done = subprocess.run([cxx, "-O2", "-march=native", src, "-o", exe], capture_output=True,
                          text=True)
    if done.returncode != 0:
        sys.exit(f"building {name} failed:\n{done.stderr[-2000:]}")
    return exe


def _rate(exe: str, iterations: int, copies: int) -> list[float]:
    """GFLOP/s of each of `copies` simultaneous runs."""
    procs = [subprocess.Popen([exe, str(iterations)], stdout=subprocess.PIPE, text=True)
             for _ in range(copies)]
    return [float(p.communicate()[0].split()[0]) for p in procs]


def _measure(exe: str, flops_per_iteration: int, cores: int) -> tuple[float, float]:
    """(one core alone, all cores at once) in GFLOP/s, each loop sized to ~FLAGS.seconds."""
    probe = _rate(exe, 200_000, 1)[0]
    if probe == 0:
        return 0.0, 0.0
    iterations = int(FLAGS.seconds * probe * 1e9 / flops_per_iteration)
    return _rate(exe, iterations, 1)[0], sum(_rate(exe, iterations, cores))


def main(argv):
    del argv
    cpu = cpu_kernels.cpu_flags()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as workdir:
        rows = []
        if "avx512f" in cpu:
            rows.append(("AVX-512 f32 FMA", *_measure(_build(FMA, "fma", workdir), 16 * 32, cores)))
        elif {"avx2", "fma"} <= cpu:
            rows.append(("AVX2 f32 FMA", *_measure(_build(FMA, "fma", workdir), 12 * 16, cores)))
        else:
            print("no AVX-512 or AVX2 FMA on this CPU: FMA loop skipped")
        if {"amx_tile", "amx_bf16"} <= cpu:
            one, total = _measure(_build(AMX, "amx", workdir), 4 * 16 * 16 * 32 * 2,
                                  cores)
            if one == 0:
                print("AMX present but the kernel refused this process its tile state")
            else:
                rows.append(("AMX bf16 tiles", one, total))
        else:
            print("no AMX-BF16 on this CPU: tile loop skipped")
    print(f"{'peak':<20}{'one core':>14}{f'{cores} cores':>14}  GFLOP/s")
    for name, one, total in rows:
        print(f"{name:<20}{one:>14.0f}{total:>14.0f}")
    if len(rows) == 2:
        print(f"AMX bf16 / {rows[0][0]}: x{rows[1][2] / rows[0][2]:.1f}")


if __name__ == "__main__":
    app.run(main)
