"""Analytic KV-cache memory accounting (docs/design.md, "KV memory accounting").

Pure Python (fractions for exact means, no JAX, no numpy needed): what a set of requests costs in
KV memory, and how much of what a policy allocates is tail waste.

- Bytes per retained token: ``2 * L * H_kv * d_head * b`` (keys and values); an int8 pool adds
  its scales, ``2 * L * H_kv * s`` (one float32 scale, s = 4, per token and KV head).
- Paged allocation with pages of B slots: a length-T request holds ``B * ceil(T / B)`` slots, so
  its tail waste is in ``[0, B - 1]``.
- Fixed reservation of R slots: every request holds R slots (T must be <= R); waste ``R - T``.
- Slot utilisation ``U = sum(T_i) / sum(allocated_i)``.
- For lengths uniform on 1..M the mean tail waste is computed exactly (a ``Fraction``) for any B;
  it is ``(B - 1) / 2`` when B divides M, and reserving R slots wastes ``R - (M + 1) / 2``.

These count KV only; weights, activations, workspaces and page tables are separate terms.
``pages_needed`` excludes the engine's reserved scratch page 0.
"""

from __future__ import annotations

import dataclasses
import numbers
from fractions import Fraction
from typing import Any, Iterable, Sequence

from jaxserve.config import kv_heads_per_device
from jaxserve.core.kv_groups import group_layers

GIB = 1 << 30
DEFAULT_PAGE_SIZES = (16, 32)
DEFAULT_DTYPE_BYTES = 4  # the engine's default dtype is float32
DEFAULT_CONTEXTS = tuple(2 ** k for k in range(7, 18))  # 128 .. 131072 tokens

__all__ = [
    "GIB", "KVArchitecture", "AllocationReport", "bytes_per_token", "kv_bytes", "to_gib",
    "pages_needed", "slots_paged", "paged_allocation", "reserved_allocation",
    "mean_tail_waste", "mean_tail_waste_uniform", "mean_reservation_waste_uniform",
    "uniform_analysis", "analyse", "window_pages", "gib_vs_context", "tail_waste_vs_page_size",
]


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _lengths(lengths: int | Iterable[int], name: str = "lengths") -> tuple[int, ...]:
    if isinstance(lengths, numbers.Integral) and not isinstance(lengths, bool):
        lengths = (lengths,)
    out = tuple(_positive_int(t, f"{name}[{i}]") for i, t in enumerate(lengths))
    if not out:
        raise ValueError(f"{name} must not be empty")
    return out


# ---------------------------------------------------------------------------------------------
# Bytes


@dataclasses.dataclass(frozen=True)
class KVArchitecture:
    """The four numbers that fix KV bytes per token (and a quantized pool's scale bytes per token
    and KV head), plus a display name."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = DEFAULT_DTYPE_BYTES
    name: str = ""
    scale_bytes: int = 0

    def __post_init__(self):
        for field in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            _positive_int(getattr(self, field), field)
        if self.scale_bytes:
            _positive_int(self.scale_bytes, "scale_bytes")

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes,
                               self.scale_bytes)

    @classmethod
    def from_model_config(cls, config: Any, dtype_bytes: int = DEFAULT_DTYPE_BYTES,
                          name: str = "") -> "KVArchitecture":
        """From a ``jaxserve.config.ModelConfig`` (or anything with the same three fields)."""
        return cls(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                   head_dim=config.head_dim, dtype_bytes=dtype_bytes, name=name)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["bytes_per_token"] = self.bytes_per_token
        return d


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                    scale_bytes: int = 0) -> int:
    """``2 * L * H_kv * (d_head * b + s)``: 32, 8, 128, 2 -> 131072 bytes (128 KiB); int8 with
    float32 scales, 32, 8, 128, 1, 4 -> 67584 bytes."""
    per_head = _positive_int(head_dim, "head_dim") * _positive_int(dtype_bytes, "dtype_bytes")
    return (2 * _positive_int(num_layers, "num_layers") * _positive_int(num_kv_heads, "num_kv_heads")
            * (per_head + scale_bytes))


def kv_bytes(lengths: int | Iterable[int], bytes_per_token: int) -> int:
    """KV bytes retained by requests of these lengths (sum of lengths times bytes per token)."""
    return sum(_lengths(lengths)) * _positive_int(bytes_per_token, "bytes_per_token")


def to_gib(nbytes: int | float) -> float:
    return nbytes / GIB


# ---------------------------------------------------------------------------------------------
# Slots, pages and waste for a concrete set of lengths


def slots_paged(length: int, page_size: int) -> int:
    """Slots a length-T request holds in pages of B slots: ``B * ceil(T / B)``."""
    t, b = _positive_int(length, "length"), _positive_int(page_size, "page_size")
    return b * (-(-t // b))


def window_pages(length: int, page_size: int, window: int) -> int:
    """Pages a decoding sequence holds once pages wholly before its window are released
    (KVManager.pages_to_hold at a chunk of one token)."""
    return min(-(-length // page_size), -(-window // page_size) + 1)


def pages_needed(lengths: int | Iterable[int], page_size: int) -> int:
    """Total pages ``sum(ceil(T_i / B))`` for requests of these lengths held at the same time.

    This is the analytic peak to compare with the engine's measured peak pages for a batch that
    is resident at once (without prefix sharing; the reserved scratch page 0 is not counted).
    """
    b = _positive_int(page_size, "page_size")
    return sum(-(-t // b) for t in _lengths(lengths))


@dataclasses.dataclass(frozen=True)
class AllocationReport:
    """What one allocation policy holds for a set of lengths."""

    policy: str  # "paged" or "reserve"
    block: int  # page size B, or the reservation R
    lengths: tuple[int, ...]
    allocated: tuple[int, ...]  # slots per request
    pages: int | None  # paged only: sum(ceil(T_i / B))

    @property
    def label(self) -> str:
        return f"pages of {self.block}" if self.policy == "paged" else f"reserve {self.block}"

    @property
    def tail_waste(self) -> tuple[int, ...]:
        return tuple(a - t for a, t in zip(self.allocated, self.lengths))

    @property
    def useful_slots(self) -> int:
        return sum(self.lengths)

    @property
    def allocated_slots(self) -> int:
        return sum(self.allocated)

    @property
    def total_tail_waste(self) -> int:
        return self.allocated_slots - self.useful_slots

    @property
    def mean_tail_waste(self) -> Fraction:
        return Fraction(self.total_tail_waste, len(self.lengths))

    @property
    def utilisation_exact(self) -> Fraction:
        return Fraction(self.useful_slots, self.allocated_slots)

    @property
    def utilisation(self) -> float:
        return float(self.utilisation_exact)

    def to_dict(self, bytes_per_token: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "policy": self.policy,
            "page_size" if self.policy == "paged" else "reserve": self.block,
            "label": self.label,
            "pages": self.pages,
            "allocated_per_request": list(self.allocated),
            "tail_waste_per_request": list(self.tail_waste),
            "total_tail_waste": self.total_tail_waste,
            "mean_tail_waste": float(self.mean_tail_waste),
            "mean_tail_waste_exact": str(self.mean_tail_waste),
            "useful_slots": self.useful_slots,
            "allocated_slots": self.allocated_slots,
            "utilisation": self.utilisation,
            "utilisation_exact": str(self.utilisation_exact),
            "utilisation_percent": round(100 * self.utilisation, 2),
        }
        if bytes_per_token is not None:
            d["allocated_bytes"] = self.allocated_slots * bytes_per_token
            d["allocated_gib"] = to_gib(d["allocated_bytes"])
            d["wasted_bytes"] = self.total_tail_waste * bytes_per_token
        return d


def paged_allocation(lengths: int | Iterable[int], page_size: int) -> AllocationReport:
    ls = _lengths(lengths)
    b = _positive_int(page_size, "page_size")
    return AllocationReport("paged", b, ls, tuple(slots_paged(t, b) for t in ls),
                            pages_needed(ls, b))


def reserved_allocation(lengths: int | Iterable[int], reserve: int) -> AllocationReport:
    """Every request reserves ``reserve`` slots; a longer request is an error."""
    ls = _lengths(lengths)
    r = _positive_int(reserve, "reserve")
    too_long = [t for t in ls if t > r]
    if too_long:
        raise ValueError(f"{len(too_long)} length(s) exceed the reservation of {r} slots "
                         f"(longest {max(too_long)}); raise the reservation or shorten them")
    return AllocationReport("reserve", r, ls, (r,) * len(ls), None)


# ---------------------------------------------------------------------------------------------
# Exact means


def mean_tail_waste(lengths: int | Iterable[int], page_size: int) -> Fraction:
    """Mean tail waste over these lengths (each length equally likely), exact."""
    return paged_allocation(lengths, page_size).mean_tail_waste


def mean_tail_waste_uniform(max_len: int, page_size: int) -> Fraction:
    """Exact mean of ``B*ceil(T/B) - T`` for T uniform on 1..M, any B.

    M = q*B + r: each of the q full pages contributes wastes 0..B-1 (sum B(B-1)/2); the r lengths
    of the last, partial page waste B-1, ..., B-r (sum rB - r(r+1)/2). When B divides M this is
    exactly (B-1)/2.
    """
    m, b = _positive_int(max_len, "max_len"), _positive_int(page_size, "page_size")
    q, r = divmod(m, b)
    total = q * b * (b - 1) // 2 + r * b - r * (r + 1) // 2
    return Fraction(total, m)


def mean_reservation_waste_uniform(max_len: int, reserve: int | None = None) -> Fraction:
    """Exact mean of ``R - T`` for T uniform on 1..M: ``R - (M+1)/2`` (255.5 for R = M = 512)."""
    m = _positive_int(max_len, "max_len")
    r = m if reserve is None else _positive_int(reserve, "reserve")
    if m > r:
        raise ValueError(f"uniform lengths up to {m} exceed the reservation of {r} slots")
    return r - Fraction(m + 1, 2)


def _frac(x: Fraction) -> dict[str, Any]:
    return {"value": float(x), "exact": str(x)}


def uniform_analysis(max_len: int, page_sizes: Sequence[int] = DEFAULT_PAGE_SIZES,
                     reserve: int | None = None, bytes_per_token: int | None = None
                     ) -> dict[str, Any]:
    """Exact expectations for lengths uniform on 1..M, per page size and for a reservation.

    Utilisation here is the long-run ratio E[T] / E[allocated slots] (ratio of means).
    """
    m = _positive_int(max_len, "max_len")
    r = m if reserve is None else _positive_int(reserve, "reserve")
    mean_len = Fraction(m + 1, 2)
    policies = []
    for b in page_sizes:
        w = mean_tail_waste_uniform(m, b)
        policies.append(("paged", _positive_int(b, "page_size"), w))
    policies.append(("reserve", r, mean_reservation_waste_uniform(m, r)))
    rows = []
    for policy, block, w in policies:
        alloc = mean_len + w
        row = {
            "policy": policy,
            "page_size" if policy == "paged" else "reserve": block,
            "label": f"pages of {block}" if policy == "paged" else f"reserve {block}",
            "mean_tail_waste": float(w),
            "mean_tail_waste_exact": str(w),
            "mean_allocated_slots": float(alloc),
            "mean_allocated_slots_exact": str(alloc),
            "utilisation": float(mean_len / alloc),
            "utilisation_exact": str(mean_len / alloc),
            "utilisation_percent": round(100 * float(mean_len / alloc), 2),
        }
        if policy == "paged":
            row["divides_max_len"] = m % block == 0
            row["half_page_minus_half"] = str(Fraction(block - 1, 2))
        if bytes_per_token is not None:
            row["mean_wasted_bytes"] = float(w * bytes_per_token)
        rows.append(row)
    return {"distribution": f"uniform on 1..{m}", "max_len": m, "reserve": r,
            "mean_length": float(mean_len), "mean_length_exact": str(mean_len),
            "policies": rows}


def analyse(arch: KVArchitecture, lengths: Iterable[int] | None = None,
            uniform_max: int | None = None, page_sizes: Sequence[int] = DEFAULT_PAGE_SIZES,
            reserve: int | None = None, lookahead: int = 0,
            tensor_parallel_size: int = 1, window: int | None = None,
            layer_windows: Sequence[int | None] | None = None) -> dict[str, Any]:
    """Everything the CLI reports, as a JSON-able dict.

    ``lookahead`` (speculative decoding's drafts per step, k): a verification writes KV for
    k positions past a sequence's length before the rejected ones are rolled back, so at its
    peak a length-T request holds ``ceil((T + k) / B)`` pages; reported per page size beside
    the plain ``ceil(T / B)``.

    If ``reserve`` is None it defaults to the longest given length (for ``lengths``) and to M
    (for the uniform distribution); ``reserve_source`` says which.

    ``tensor_parallel_size`` (tp): each device holds every page for its H_kv / tp KV heads, or
    for one head when H_kv < tp (each head repeated on tp / H_kv devices, counted on each);
    reported under "per_device".

    ``window`` (W, every layer windowed): a request holds ``window_pages`` pages however long it
    grows; reported per page size beside the full ``ceil(T / B)``.

    ``layer_windows`` (each layer's window, None: full attention): a model of several layer
    groups (core/kv_groups.py) holds per group ``ceil(T / B)`` pages (full) or ``window_pages``
    (sliding), each page of ``size`` layers; reported per request and page size as
    "layer_groups" beside the bytes of keeping every page on every layer.
    """
    page_sizes = tuple(_positive_int(b, "page_size") for b in page_sizes)
    if not page_sizes:
        raise ValueError("page_sizes must not be empty")
    if reserve is not None:
        _positive_int(reserve, "reserve")
    if lengths is None and uniform_max is None:
        raise ValueError("give lengths or uniform_max (or both)")
    bpt = arch.bytes_per_token
    out: dict[str, Any] = {
        "architecture": arch.to_dict(),
        "bytes_per_token": bpt,
        "bytes_per_page": {str(b): b * bpt for b in page_sizes},
        "page_sizes": list(page_sizes),
    }
    tp = _positive_int(tensor_parallel_size, "tensor_parallel_size")
    if tp > 1:
        heads = kv_heads_per_device(arch.num_kv_heads, tp)
        per_device = bpt * heads // arch.num_kv_heads
        out["per_device"] = {
            "tensor_parallel_size": tp, "kv_heads_per_device": heads,
            "repeated_kv_heads": heads * tp - arch.num_kv_heads,
            "bytes_per_token": per_device,
            "bytes_per_page": {str(b): b * per_device for b in page_sizes},
            "all_devices_bytes_per_token": per_device * tp}
    if lengths is not None:
        ls = _lengths(lengths)
        r = max(ls) if reserve is None else reserve
        reports = [reserved_allocation(ls, r)] + [paged_allocation(ls, b) for b in page_sizes]
        out["lengths"] = {
            "lengths": list(ls),
            "num_requests": len(ls),
            "useful_slots": sum(ls),
            "kv_bytes": kv_bytes(ls, bpt),
            "kv_gib": to_gib(kv_bytes(ls, bpt)),
            "kv_bytes_per_request": [t * bpt for t in ls],
            **({"kv_bytes_per_device": kv_bytes(ls, out["per_device"]["bytes_per_token"])}
               if tp > 1 else {}),
            "reserve": r,
            "reserve_source": "flag" if reserve is not None else "default: longest length",
            "policies": [rep.to_dict(bpt) for rep in reports],
        }
        if lookahead:
            k = _positive_int(lookahead, "lookahead")
            out["lengths"]["speculative_lookahead"] = [
                {"page_size": b, "lookahead": k, "pages": pages_needed(ls, b),
                 "peak_pages": pages_needed([t + k for t in ls], b),
                 "extra_bytes": (pages_needed([t + k for t in ls], b) - pages_needed(ls, b))
                 * b * bpt} for b in page_sizes]
        if window is not None:
            w = _positive_int(window, "window")
            held = {b: sum(window_pages(t, b, w) for t in ls) for b in page_sizes}
            out["lengths"]["sliding_window"] = [
                {"page_size": b, "window": w, "pages": pages_needed(ls, b), "window_pages": n,
                 "window_bytes": n * b * bpt} for b, n in held.items()]
        groups = group_layers(tuple(layer_windows)) if layer_windows else None
        if groups is not None and groups.num_groups > 1:
            layer_bytes = lambda n, b: n * b * bpt * groups.size // arch.num_layers  # noqa: E731
            out["lengths"]["layer_groups"] = [
                {"page_size": b, "length": t, "layers_per_page": groups.size,
                 "groups": [{"window": w, "layers": list(layers),
                             "pages": pages_needed(t, b) if w is None else window_pages(t, b, w)}
                            for w, layers in zip(groups.windows, groups.layers)],
                 "every_page_kept_bytes": pages_needed(t, b) * b * bpt} for b in page_sizes
                for t in ls]
            for r in out["lengths"]["layer_groups"]:
                r["pages"] = sum(g["pages"] for g in r["groups"])
                r["bytes"] = layer_bytes(r["pages"], r["page_size"])
                for g in r["groups"]:
                    g["bytes"] = layer_bytes(g["pages"], r["page_size"])
    if uniform_max is not None:
        u = uniform_analysis(uniform_max, page_sizes, reserve, bpt)
        u["reserve_source"] = "flag" if reserve is not None else "default: max length"
        out["uniform"] = u
    return out


# ---------------------------------------------------------------------------------------------
# Plot data (rows for CSV and for jaxserve.tools.plots)


def gib_vs_context(architectures: Sequence[KVArchitecture],
                   contexts: Sequence[int] = DEFAULT_CONTEXTS) -> tuple[list[str], list[list]]:
    """Header and rows: retained context (tokens) then KV GiB of one sequence per architecture."""
    ctx = _lengths(contexts, "contexts")
    names = [a.name or f"L{a.num_layers}-H{a.num_kv_heads}-d{a.head_dim}-b{a.dtype_bytes}"
             for a in architectures]
    header = ["context_tokens"] + [f"{n}_gib" for n in names]
    rows = [[t] + [to_gib(t * a.bytes_per_token) for a in architectures] for t in ctx]
    return header, rows


def tail_waste_vs_page_size(page_sizes: Sequence[int], *, uniform_max: int | None = None,
                            lengths: Iterable[int] | None = None,
                            reserve: int | None = None) -> tuple[list[str], list[list], Fraction]:
    """Header, rows (page size, exact mean waste as float and fraction) and the reservation's
    mean waste, for lengths uniform on 1..M or for the given lengths (exactly one)."""
    if (uniform_max is None) == (lengths is None):
        raise ValueError("give exactly one of uniform_max and lengths")
    rows = []
    if uniform_max is not None:
        r = uniform_max if reserve is None else reserve
        ref = mean_reservation_waste_uniform(uniform_max, r)
        for b in sorted(set(page_sizes)):
            w = mean_tail_waste_uniform(uniform_max, b)
            rows.append([b, float(w), str(w), float(Fraction(b - 1, 2))])
    else:
        ls = _lengths(lengths)
        r = max(ls) if reserve is None else reserve
        ref = reserved_allocation(ls, r).mean_tail_waste
        for b in sorted(set(page_sizes)):
            w = mean_tail_waste(ls, b)
            rows.append([b, float(w), str(w), float(Fraction(b - 1, 2))])
    header = ["page_size", "mean_tail_waste", "mean_tail_waste_exact", "half_page_minus_half"]
    return header, rows, ref
