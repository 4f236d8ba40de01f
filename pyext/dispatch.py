"""Backend selection for pyext ops, in the manner of xformers' fmha dispatch: validated, self-checked, cached.

Each op has an ordered list of backends. A backend declares whether it can run in this
process at all (`unavailable()` returns a reason or None); what it supports, as data, in the
manner of xformers' fmha ops (`devices`, `dtypes`, `limits` on named sizes such as the head
dim, and the `test_shapes` the tests run it on); whether it can take an input beyond that data
(`reasons(*args)`: from shapes, dtypes, strides and plain arguments only); what it refuses in
the input's values (`guard(*args)`: CPU tensors only, where reading them costs no device sync);
why automatic choice never picks it although it could run (`advisory(*args)`: "the interpreter
is for tests"), and a speed rule measured elsewhere that only the static order follows
(`slower(*args)`). Dispatch checks the data itself (`input_reasons`), so what a backend
declares and what it accepts cannot drift apart. Forcing a backend by name overrides
advisory, slower and the self-check.

Every call is validated first (`Op.check`), the same for the public function and the raw
`torch.ops.pyext.*` op: bad input is a PyextError before any backend is chosen, and it
changes nothing that dispatch keeps. A call whose signature (below) was validated before is
not validated again: the signature holds all that the validation reads.

The choice for a call signature (the op, the forced backend, every tensor's dtype, shape,
strides and device, the other arguments) is kept in memory: a repeated call does no
per-backend reasoning, reads no environment variable and takes no lock; only the chosen
backend's `guard` runs again. The slow path, taken once per signature, works as follows.

Automatic choice has two modes (`PYEXT_DISPATCH=measured|static`):
- measured, the default on every device: for each key (op, device identity, dtypes, shape
  bucket) the first call times every backend that can take the input on that input (a warm-up,
  then a few timed runs; CUDA events on a GPU), keeps the fastest, and caches the choice in
  memory and in a JSON file per device identity (`cache_dir()`), invalidated when the pyext,
  torch or Triton version changes. A CPU's identity is its model name, the ISA flags the kernels
  choose by and torch's thread count, so a cache made on one CPU never decides for another.
  The price is paid once per machine and key, not per process, and is bounded (`TIMED_RUNS`,
  `SLOWER_BY`, `LONG_CALL_S`).
  Nothing is measured while torch.compile traces or a CUDA graph is captured: the cached
  choice, else the static one, is used there.
- static: the first backend in registration order that can take the input and that neither
  `advisory` nor `slower` passes by; the `slower` rules were measured on other machines
  (bench/attention.py, bench/fp8.py) and serve where nothing can be timed.

Self-check, in both modes: before a backend is first chosen automatically for an op on a
device and variant (dtype, head dim, ...), it runs once on a small valid input of that
variant (`Op.sample`) and its result is compared with the op's reference backend
(`Op.close`). Only a backend that raises or misses the tolerance there is marked unusable,
for that variant, with its reason and time (`unusable()`, `python -m pyext info`); the mark
is saved with the device's cache and checked again once by the next process that would
choose it, and `clear_marks()` forgets every mark. A backend that raises on a user's
(validated) input marks nothing: the call runs on the next backend, with a warning once.
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import os
import re
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch


class PyextError(ValueError):
    """Bad input to a pyext op, or no backend that can run it."""


def _no_reasons(*args) -> list[str]:
    return []


@dataclass
class Backend:
    """One implementation of an op. What it supports is data, checked by dispatch:
    devices; dtypes, the compute dtypes it takes (None: not declared, any); limits, the values
    it takes of the op's named sizes (`Op.sizes`, e.g. {"head_dim": range(1, 257)}); notes,
    why, keyed by a refused dtype or a limit's name, appended to the reason dispatch gives;
    test_shapes, argument-shape specs (`Op.example`) the tests run it on in each of its dtypes.
    reasons must depend on shapes, dtypes, strides and plain arguments only (dispatch keeps its
    choice per signature); guard, on values, and it is asked on every call (CPU inputs only)."""

    name: str
    run: Callable
    reasons: Callable[..., list[str]] = _no_reasons
    unavailable: Callable[[], str | None] = lambda: None
    advisory: Callable[..., list[str]] = _no_reasons
    devices: tuple[str, ...] = ("cpu", "cuda")
    doc: str = ""
    slower: Callable[..., list[str]] = _no_reasons
    timed: bool = True  # measured mode may time it (False: the naive reference, O(seq^2) memory)
    dtypes: tuple[torch.dtype, ...] | None = None
    limits: dict[str, range | tuple[int, ...]] = field(default_factory=dict)
    notes: dict[Any, str] = field(default_factory=dict)
    test_shapes: tuple = ()
    guard: Callable[..., list[str]] | None = None


def _first_tensor(args) -> torch.Tensor | None:
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


def default_variant(args) -> tuple:
    """Self-check key: the dtype and last dimension of the first tensor (a head dim, an in-features)."""
    t = _first_tensor(args)
    return () if t is None else (str(t.dtype).removeprefix("torch."), t.shape[-1] if t.dim() else 0)


def bucket_dim(n: int) -> int:
    return n if n <= 256 else 1 << (n - 1).bit_length()  # small dims exact (kernels specialise on them)


def default_bucket(args) -> tuple:
    """Measurement key: every tensor's dtype and shape, dims above 256 rounded up to a power of two."""
    return tuple((str(a.dtype).removeprefix("torch."), tuple(bucket_dim(n) for n in a.shape))
                 if isinstance(a, torch.Tensor) else a for a in args if isinstance(a, (torch.Tensor, bool, int, str)))


@dataclass
class Op:
    """An op's backends and what its validation, self-check and measurement need (set by `define`).

    check(*args) raises PyextError for input no backend may see (the op's validation);
    sample(args) -> small valid args of the same variant, on the same device (None: no
        self-check); the check runs backend and reference each on a copy;
    close(out, ref, args) -> None when `out` matches the reference's `ref`, else the reason;
    output(args, returned) -> the result to compare (an out= op returns None and writes args);
    pure: the op reads its inputs only, so measurement may run it repeatedly on them and a
        failed run may be retried on another backend;
    signature(args) -> what the choice for args depends on beyond the op (default: every
        tensor's dtype, shape, strides and device, and the plain arguments but floats);
    dtype(args) -> the compute dtype that backends' `dtypes` are checked against;
    sizes(args) -> {name: int}, the sizes that backends' `limits` are checked against;
    example(spec, dtype, device) -> args of a backend's test shape `spec` (the op tests).
    """

    name: str
    backends: list[Backend] = field(default_factory=list)
    reference: str = "reference"
    check: Callable | None = None
    sample: Callable | None = None
    close: Callable | None = None
    output: Callable = lambda args, returned: returned
    variant: Callable = default_variant
    bucket: Callable = default_bucket
    pure: bool = True
    signature: Callable | None = None
    dtype: Callable = lambda args: _first_tensor(args).dtype
    sizes: Callable = lambda args: {}
    example: Callable | None = None


_OPS: dict[str, Op] = {}


def register(op_name: str, backend: Backend) -> None:
    """Append a backend to an op; earlier registrations are preferred."""
    op = _OPS.setdefault(op_name, Op(op_name))
    if any(b.name == backend.name for b in op.backends):
        raise RuntimeError(f"pyext: backend {backend.name!r} registered twice for {op_name}")
    op.backends.append(backend)
    with _LOCK:
        _forget_choices()


def define(op_name: str, **fields) -> None:
    """Set an op's validation, self-check and measurement fields (see Op)."""
    op = _OPS.setdefault(op_name, Op(op_name))
    for key, value in fields.items():
        if not hasattr(op, key) or key in ("name", "backends"):
            raise RuntimeError(f"pyext: Op has no settable field {key!r}")
        setattr(op, key, value)
    with _LOCK:
        _forget_choices()


def ops() -> dict[str, Op]:
    return dict(_OPS)


def check(op_name: str, args: tuple) -> None:
    """The op's validation of `args` (PyextError when bad); the fake kernels call it too."""
    op = _OPS[op_name]
    if op.check is not None:
        op.check(*args)


def describe(x) -> str:
    if isinstance(x, torch.Tensor):
        layout = "contiguous" if x.is_contiguous() else f"strides={tuple(x.stride())}"
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)} on {x.device} ({layout})"
    return repr(x)


def _device(args) -> torch.device:
    t = _first_tensor(args)
    return t.device if t is not None else torch.device("cpu")


def _names(values) -> str:
    return "/".join(str(v).removeprefix("torch.") for v in values)


def _refused(backend: Backend, what, message: str) -> str:
    note = backend.notes.get(what)
    return f"{message}: {note}" if note else message


def input_reasons(op: Op, backend: Backend, args: tuple, values: bool = True) -> list[str]:
    """Why `backend` cannot take `args`, whether or not it can run in this process (empty: it can):
    its declared devices, dtypes and limits, its own reasons(), then its guard on CPU values."""
    device = _device(args).type
    if device not in backend.devices:
        return [f"runs on {_names(backend.devices)}, not {device}"]
    reasons = []
    dtype = op.dtype(args)
    if backend.dtypes is not None and dtype not in backend.dtypes:
        reasons.append(_refused(backend, dtype, f"computes in {_names(backend.dtypes)} only, got {_names([dtype])}"))
    sizes = op.sizes(args)
    for name, allowed in backend.limits.items():
        if sizes[name] not in allowed:
            shown = f"{allowed.start}..{allowed.stop - 1}" if isinstance(allowed, range) else _names(allowed)
            reasons.append(_refused(backend, name, f"{name} {sizes[name]} is not in {shown}"))
    reasons += backend.reasons(*args)
    return reasons or (_guard_reasons(backend, args) if values else [])


def asks_guard(backend: Backend, args: tuple) -> bool:
    """Whether dispatch asks the backend's guard about these inputs' values: for CPU inputs only
    (on a GPU reading values would sync the device)."""
    return backend.guard is not None and _device(args).type == "cpu"


def _guard_reasons(backend: Backend, args: tuple) -> list[str]:
    return backend.guard(*args) if asks_guard(backend, args) else []


def why_not(op: Op, backend: Backend, args: tuple, values: bool = True) -> list[str]:
    """Why `backend` cannot run `args` here; `values=False` leaves out its guard on the values."""
    missing = backend.unavailable()
    return [missing] if missing else input_reasons(op, backend, args, values)


# ----------------------------------------------------------------------------- modes and devices

MODES = ("measured", "static")


def mode(device: torch.device) -> str:
    """PYEXT_DISPATCH if set, else measured: the machine at hand decides, not a rule from another."""
    value = os.environ.get("PYEXT_DISPATCH", "")
    if value and value not in MODES:
        raise PyextError(f"PYEXT_DISPATCH={value!r} is not a dispatch mode; use one of {', '.join(MODES)}")
    return value or "measured"


def can_measure(device: torch.device) -> bool:
    """False while torch.compile traces or a CUDA graph is being captured: no timing, no self-check."""
    if torch.compiler.is_compiling():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


# The /proc/cpuinfo flags that change which kernel path runs or how fast torch's own is (oneDNN
# takes AMX where it exists): two CPUs that differ in them are different machines to dispatch.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vbmi", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


@functools.lru_cache(maxsize=None)  # no /proc read on every slow-path choice
def cpu_model() -> tuple[str, tuple[str, ...]]:
    """(model name, the CPU_FLAGS it has) from /proc/cpuinfo; ("unknown", ()) where there is none."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model or "unknown", tuple(f for f in CPU_FLAGS if f in flags)


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str:
    """The device's identity, which cache files and keys are per: a GPU's model; a CPU's model,
    ISA flags and torch's thread count now (the same cores with fewer threads time differently)."""
    if device.type == "cuda":
        return _cuda_name(device.index)
    if device.type == "cpu":
        model, flags = cpu_model()
        return f"cpu {model} [{' '.join(flags) or 'no simd flags'}] {torch.get_num_threads()} threads"
    return device.type


def _versions() -> dict[str, str]:
    from pyext import _ext

    versions = {"pyext": _package_version(), "torch": torch.__version__, "build": str(_ext.BUILD_INFO)}
    try:
        versions["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        versions["triton"] = "none"
    return versions


def _package_version() -> str:
    import pyext

    return getattr(pyext, "__version__", "unknown")


def cache_dir() -> str:
    """PYEXT_CACHE_DIR, else ~/.cache/pyext/dispatch."""
    return os.environ.get("PYEXT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pyext", "dispatch")


# ----------------------------------------------------------------------------- the per-device cache

CACHE_FORMAT = 3  # 2: marks per variant, with their time; 3: decisions with theirs, per CPU identity


@dataclass
class _DeviceCache:
    """What dispatch knows about one device: measured choices, marks, passed self-checks."""

    name: str
    decisions: dict[str, dict] = field(default_factory=dict)  # key -> {op, key, backend, timings}
    unusable: dict[str, dict] = field(default_factory=dict)  # "op|backend|variant" -> {op, backend, variant, reason, time}
    checked: set[str] = field(default_factory=set)  # "op|backend|variant" that passed
    confirmed: set[str] = field(default_factory=set)  # marks this process made or checked again

    def path(self) -> str:
        return os.path.join(cache_dir(), re.sub(r"[^A-Za-z0-9._-]+", "_", self.name) + ".json")

    def load(self) -> None:
        try:
            with open(self.path()) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return
        if data.get("versions") != _versions() or data.get("format") != CACHE_FORMAT:
            return  # another pyext, torch, Triton or file format: measure and check anew
        self.decisions = data.get("decisions", {})
        self.unusable = data.get("unusable", {})
        self.checked = set(data.get("checked", []))

    def save(self) -> None:
        data = {"device": self.name, "format": CACHE_FORMAT, "versions": _versions(), "decisions": self.decisions,
                "unusable": self.unusable, "checked": sorted(self.checked)}
        try:
            os.makedirs(cache_dir(), exist_ok=True)
            tmp = f"{self.path()}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, self.path())
        except OSError:  # a read-only home: the in-memory cache still serves this process
            pass


_CACHES: dict[str, _DeviceCache] = {}
_LOCK = threading.RLock()
# Call signature -> (the backend chosen for it (wrapped by _guarded), whether its guard runs on
# every call). Read without the lock: a dict lookup is atomic, and an entry, once written, is
# never changed (only dropped).
_CHOSEN: dict[tuple, tuple[Backend, bool]] = {}


_ON_FORGET: list[Callable[[], None]] = []


def on_forget(fn: Callable[[], None]) -> None:
    """Call fn whenever the kept choices are dropped: a C++ fast path that holds copies of
    some of them (armed through when_kept) drops its own."""
    _ON_FORGET.append(fn)


def _forget_choices() -> None:
    _CHOSEN.clear()
    for fn in _ON_FORGET:
        fn()


def when_kept(op_name: str, args: tuple, chosen: Backend, fn: Callable[[], None]) -> None:
    """Calls fn() if `chosen` is the automatic choice kept for args' signature and its guard does
    not run (so that every call of the signature takes it without looking at values). Under the
    lock that forgetting the choices takes: a fast path that fn arms is never left holding a
    choice dispatch has dropped."""
    with _LOCK:
        kept, guarded = _CHOSEN.get(_signature(_OPS[op_name], None, args), (None, True))
        if kept is chosen and not guarded:
            fn()


def _cache(device: torch.device) -> _DeviceCache:
    name = device_name(device)
    if name not in _CACHES:
        cache = _DeviceCache(name)
        cache.load()
        _CACHES[name] = cache
    return _CACHES[name]


def reset() -> None:
    """Forget every in-memory choice, decision and mark (the files stay): as a new process would start."""
    with _LOCK:
        _CACHES.clear()
        _forget_choices()
        _GUARDED.clear()
        _WARNED.clear()


def decisions() -> list[dict]:
    """[{op, key, backend, timings: {backend: seconds}, time, device}] for every measured key known here."""
    _load_all()
    return [dict(d, device=c.name) for c in _CACHES.values() for d in c.decisions.values()]


def marked_unusable(op_name: str, backend_name: str, device: torch.device) -> bool:
    """Whether a backend is marked unusable on this device for any variant (this process's view)."""
    prefix = f"{op_name}|{backend_name}|"
    with _LOCK:
        return any(key.startswith(prefix) for key in _cache(device).unusable)


def unusable() -> list[dict]:
    """[{op, backend, variant, reason, time, device}]: backends whose self-check failed, per variant."""
    _load_all()
    return [dict(u, device=c.name) for c in _CACHES.values() for u in c.unusable.values()]


def clear_marks() -> int:
    """Forget every unusable mark, in memory and in the cache files of every device; returns how many.
    The next automatic choice of each backend runs its self-check again."""
    _load_all()
    with _LOCK:
        count = 0
        for cache in _CACHES.values():
            if cache.unusable:  # (a file of another pyext or torch loads empty: it stays as it is)
                count += len(cache.unusable)
                cache.unusable.clear()
                cache.confirmed.clear()
                cache.save()
        _forget_choices()
        return count


def _load_all() -> None:
    """Also the caches other processes wrote (`python -m pyext info` runs in a fresh one)."""
    with _LOCK:
        try:
            files = [f for f in os.listdir(cache_dir()) if f.endswith(".json")]
        except OSError:
            return
        for file in files:
            try:
                with open(os.path.join(cache_dir(), file)) as f:
                    name = json.load(f).get("device")
            except (OSError, ValueError):
                continue
            if name and name not in _CACHES:
                cache = _DeviceCache(name)
                cache.load()
                _CACHES[name] = cache


# ----------------------------------------------------------------------------- self-check and timing

def run_on_copy(op: Op, backend: Backend, args: tuple):
    """The op's result (`Op.output`) of `backend` on a copy of args: out= ops write into their arguments."""
    copy = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    return op.output(copy, backend.run(*copy))


def reference(op: Op) -> Backend:
    return next(b for b in op.backends if b.name == op.reference)


def _self_check(op: Op, backend: Backend, args: tuple) -> str | None:
    """None when `backend` matches the reference on a small valid input of args' variant, else why not."""
    small = op.sample(args)
    try:
        out = run_on_copy(op, backend, small)
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # a kernel that cannot compile or launch here, or that refuses a valid input
        return f"self-check raised {type(err).__name__}: {str(err)[:200]}"
    problem = op.close(out, run_on_copy(op, reference(op), small), small)
    return None if problem is None else f"self-check against {op.reference}: {problem}"


def _usable(op: Op, backend: Backend, args: tuple, cache: _DeviceCache, checking: bool) -> bool:
    """Whether `backend` may be chosen for args' variant: it passed its self-check here or in an
    earlier process, or passes it now. A mark from an earlier process is checked again once."""
    if backend.name == op.reference or op.sample is None:
        return True
    key = f"{op.name}|{backend.name}|{op.variant(args)}"
    marked = key in cache.unusable
    if marked and (key in cache.confirmed or not checking):
        return False
    if not marked and (key in cache.checked or not checking):
        return True
    problem = _self_check(op, backend, args)
    if problem is None:
        cache.checked.add(key)
        cache.unusable.pop(key, None)
    else:
        cache.unusable[key] = {"op": op.name, "backend": backend.name, "variant": str(op.variant(args)),
                               "reason": problem, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        cache.confirmed.add(key)
        cache.checked.discard(key)
    cache.save()
    return problem is None


def time_call(fn: Callable[[], Any], device: torch.device, warmup: int = 1, runs: int = 3) -> float:
    """Median seconds of fn() after `warmup` calls; CUDA events on a GPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


# What measuring a key costs on a CPU, at most: each candidate runs once to be checked (its warm-up),
# then up to TIMED_RUNS times; once if that first call alone took SLOWER_BY times the fastest first
# call (it cannot win), and twice if it took over LONG_CALL_S (its median of one is enough).
TIMED_RUNS, SLOWER_BY, LONG_CALL_S = 3, 4.0, 0.2


def _cpu_timings(runs: dict[str, Callable[[], Any]], first_s: dict[str, float], rejected: dict) -> dict:
    """Seconds per candidate from the first calls' times `first_s`: the median of its timed runs, taken
    in rounds of one call of each candidate in turn (A, B, A, B, ...), so that a slow spell of a shared
    machine falls on every candidate rather than on the one timed during it."""
    fastest = min(first_s.values())
    timings = {label: s for label, s in first_s.items() if s > SLOWER_BY * fastest}
    times = {label: [] for label in first_s if label not in timings}
    for round_ in range(TIMED_RUNS):
        for label in list(times):
            if round_ and first_s[label] > LONG_CALL_S:
                continue
            try:
                start = time.perf_counter()
                runs[label]()
                times[label].append(time.perf_counter() - start)
            except (PyextError, torch.OutOfMemoryError):
                raise
            except Exception as err:
                rejected[label] = f"raised while timed: {type(err).__name__}: {str(err)[:200]}"
                del times[label]
    return timings | {label: sorted(ts)[len(ts) // 2] for label, ts in times.items()}


def known_choice(what: str, key: str, device: torch.device) -> dict | None:
    """The decision measured_choice keeps for (what, key) on `device`; None before it is measured
    (a caller whose candidates have one-time costs, a first packing, pays them before measuring)."""
    with _LOCK:
        return _cache(device).decisions.get(f"{what}|{key}")


def measured_choice(what: str, key: str, device: torch.device, runs: dict[str, Callable[[], Any]],
                    close: Callable | None = None, check: Callable | None = None) -> dict:
    """The decision {op, key, backend, timings, time[, rejected]} for the fastest of `runs` on
    `device`, measured on the first call for (what, key) and cached. A run that raises, whose
    output misses the first run's (`close(out, first)`), or that fails `check(out)` on its own
    (the first too), is rejected with its reason and not timed."""
    cache = _cache(device)
    full_key = f"{what}|{key}"
    with _LOCK:
        known = cache.decisions.get(full_key)
        if known and known["backend"] in runs:
            return known
        timings, rejected, first = {}, {}, None  # first: (label, output) of the first run that succeeds
        first_s = {}  # on a CPU: each checked candidate's first call, seconds
        for label, fn in runs.items():
            try:
                start = time.perf_counter()
                out = fn()
                elapsed = time.perf_counter() - start
                if check is not None:
                    problem = check(out)
                elif close is not None and first is not None:
                    differs = close(out, first[1])
                    problem = differs and f"output differs from {first[0]}'s: {differs}"
                else:
                    problem = None
                first = first or (label, out)
                if problem:
                    rejected[label] = problem
                    continue
                if device.type != "cpu":  # the first call compiled or autotuned: warm up again, on events
                    timings[label] = time_call(fn, device)
                else:
                    first_s[label] = elapsed
            except (PyextError, torch.OutOfMemoryError):
                raise
            except Exception as err:
                rejected[label] = f"raised while timed: {type(err).__name__}: {str(err)[:200]}"
        if first_s:
            timings = _cpu_timings(runs, first_s, rejected)
        if not timings:
            raise PyextError(f"pyext.{what}: every candidate failed: "
                             + "; ".join(f"{k}: {v}" for k, v in rejected.items()))
        decision = {"op": what, "key": key, "backend": min(timings, key=timings.get), "timings": timings,
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        if rejected:
            decision["rejected"] = rejected
        cache.decisions[full_key] = decision
        cache.save()
        return decision


def _measure(op: Op, candidates: list[Backend], args: tuple) -> Backend:
    decision = measured_choice(op.name, str(op.bucket(args)), _device(args),
                               {b.name: _as_called(b, args) for b in candidates})
    return next(b for b in candidates if b.name == decision["backend"])


def _as_called(backend: Backend, args: tuple) -> Callable[[], Any]:
    """A call of backend as every call of the signature will make it once chosen: its guard (asked on
    every call, on the values) and then its run, so that a guard's pass over the inputs counts."""
    if not asks_guard(backend, args):
        return lambda: backend.run(*args)
    return lambda: (backend.guard(*args), backend.run(*args))[1]


# ----------------------------------------------------------------------------- selection

def _forced(op: Op, forced: str, args: tuple) -> Backend:
    match = [b for b in op.backends if b.name == forced]
    if not match:
        names = ", ".join(b.name for b in op.backends)
        raise PyextError(f"pyext.{op.name}: unknown backend {forced!r}; backends are: {names}")
    reasons = why_not(op, match[0], args)
    if reasons:
        raise PyextError(
            f"pyext.{op.name}: backend {forced!r} cannot run this input: {'; '.join(reasons)}"
            f"\n  inputs: {', '.join(describe(a) for a in args)}"
        )
    return match[0]


def _automatic(op: Op, args: tuple, exclude: frozenset = frozenset()) -> tuple[Backend, bool]:
    """The backend automatic choice takes for args, and whether that choice holds for every call of
    the same signature (False when it rests on values, on a failure of this call, or on a trace)."""
    device = _device(args)
    cache = _cache(device)
    measuring = can_measure(device)
    keep = measuring and not exclude
    report, able = [], []
    for backend in op.backends:
        if backend.name in exclude:
            report.append(f"  {backend.name}: raised on this input")
            continue
        reasons = why_not(op, backend, args, values=False)
        if not reasons:
            reasons = _guard_reasons(backend, args)
            keep = keep and not reasons  # refused for the values of this call only
        reasons = reasons or backend.advisory(*args)
        if reasons:
            report.append(f"  {backend.name}: {'; '.join(reasons)}")
        else:
            able.append(backend)
    if mode(device) == "measured":
        known = cache.decisions.get(f"{op.name}|{op.bucket(args)}")
        chosen = next((b for b in able if known and b.name == known["backend"]), None)
        if chosen is not None and f"{op.name}|{chosen.name}|{op.variant(args)}" not in cache.unusable:
            return chosen, keep
        timed = [b for b in able if b.timed]
        if measuring and op.pure and len(timed) > 1:
            checked = [b for b in timed if _usable(op, b, args, cache, True)]
            if checked:
                return _measure(op, checked, args), keep
    for backend in able:  # static order (also measured mode's fallback where it cannot measure)
        slower = backend.slower(*args)
        if slower:
            report.append(f"  {backend.name}: {'; '.join(slower)}")
        elif _usable(op, backend, args, cache, measuring):
            return backend, keep
        else:
            mark = cache.unusable[f"{op.name}|{backend.name}|{op.variant(args)}"]
            report.append(f"  {backend.name}: unusable for this variant since {mark['time']}: {mark['reason']}")
    raise PyextError(
        f"pyext.{op.name}: no backend can run these inputs: {', '.join(describe(a) for a in args)}\n"
        + "\n".join(report)
    )


_WARNED: set[tuple] = set()


def _fall_back(op: Op, backend: Backend, args: tuple, err: Exception, exclude: frozenset):
    """Run args on the next backend after `backend` raised on them, and keep that choice for their
    signature; nothing is marked (the input was valid, and the backend passed its self-check): a
    warning says so, once per variant."""
    what = (op.name, backend.name, str(op.variant(args)))
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(f"pyext.{op.name}: backend {backend.name!r} raised {type(err).__name__} on "
                      f"{', '.join(describe(a) for a in args)} ({str(err)[:200]}); this call and any like it run "
                      "on the next backend", RuntimeWarning, stacklevel=4)
    exclude = exclude | {backend.name}
    with _LOCK:
        nxt, _ = _automatic(op, args, exclude)
        chosen = _guarded(op, nxt, exclude)
        if can_measure(_device(args)):
            _keep(_signature(op, None, args), chosen, args)
    return chosen.run(*args)


_GUARDED: dict[tuple, tuple[Backend, Backend]] = {}  # (op, backend, exclude) -> (backend, its wrapper)


def _guarded(op: Op, backend: Backend, exclude: frozenset = frozenset()) -> Backend:
    """The backend, with a run that moves on to the next backend if it raises on a valid input
    (one wrapper per op, backend and exclusions, shared by the signatures that choose it)."""
    if backend.name == op.reference or not op.pure:
        return backend
    known = _GUARDED.get((op.name, backend.name, exclude))
    if known is not None and known[0] is backend:
        return known[1]

    def run(*args):
        try:
            return backend.run(*args)
        except (PyextError, torch.OutOfMemoryError):  # the caller's input, or its size: not the kernel
            raise
        except Exception as err:
            return _fall_back(op, backend, args, err, exclude)

    wrapper = replace(backend, run=run)
    _GUARDED[(op.name, backend.name, exclude)] = backend, wrapper  # new, or the op was registered again
    return wrapper


def _signature(op: Op, forced, args: tuple) -> tuple:
    """What the choice for args depends on. With the default signature it is also all that the
    op's validation reads: a float is keyed as `float` when finite and positive (every positive
    scale or eps is as valid as another), by its value otherwise."""
    if op.signature is not None:
        return (op.name, forced, *op.signature(args))
    key = [op.name, forced]
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.shape, a.stride(), a.device))
        elif isinstance(a, list):
            key.append(tuple(a))
        elif isinstance(a, float):  # a scale, an eps: no backend's reasons read them
            key.append(float if 0 < a < math.inf else ("float", repr(a)))
        else:
            key.append(a)
    return tuple(key)


CHOSEN_MAX = 4096  # signatures kept; a server meeting many shapes drops the oldest


def _keep(key: tuple, chosen: Backend, args: tuple) -> None:
    """Under the lock. Kept with whether its guard reads these inputs' values (CPU inputs only)."""
    if len(_CHOSEN) >= CHOSEN_MAX:
        _CHOSEN.pop(next(iter(_CHOSEN)))
    _CHOSEN[key] = chosen, asks_guard(chosen, args)


def select(op_name: str, args: tuple, forced: str | None = None) -> Backend:
    """The backend to run `args` on: `forced` if given (it must be able to), else the automatic
    choice. Validates args first; raises one PyextError showing the input and every backend's
    reasons if none can take them."""
    op = _OPS[op_name]
    if op.signature is not None and op.check is not None:
        op.check(*args)  # an op's own signature may leave out what its validation reads
    try:
        key = _signature(op, forced, args)
        chosen, guarded = _CHOSEN.get(key, (None, False))
    except TypeError:  # an argument that cannot be a key: the validation says what is wrong with it
        key, chosen, guarded = None, None, False
    if chosen is not None:  # (a kept signature passed the validation)
        if not guarded or not chosen.guard(*args):
            return chosen
    elif op.signature is None and op.check is not None:
        op.check(*args)
    with _LOCK:
        if forced is not None:
            chosen, keep = _forced(op, forced, args), True
        else:
            backend, keep = _automatic(op, args)
            chosen = _guarded(op, backend)
        if keep and key is not None:
            _keep(key, chosen, args)
        return chosen


def status(device: str) -> dict[str, list[dict]]:
    """For `python -m pyext info`: every op's backends and whether each can run on `device`."""
    out = {}
    for name, op in _OPS.items():
        rows = []
        for b in op.backends:
            reason = b.unavailable()
            if reason is None and device not in b.devices:
                reason = f"runs on {'/'.join(b.devices)} only"
            rows.append({"backend": b.name, "available": reason is None, "reason": reason or "", "doc": b.doc})
        out[name] = rows
    return out
