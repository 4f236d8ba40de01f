"""Bad inputs to every op, through the public functions (the fuzz suite's) and the raw
`torch.ops.pyext.*` ops (below): each must be a PyextError naming the op.

    python -m tests.bad_inputs feed    # what dispatch picks for valid inputs, then every bad input
    python -m tests.bad_inputs         # what dispatch picks, and the marks, as a later process sees them

tests/test_dispatch_poisoning.py runs that in one process and checks that a later process on
the same dispatch cache still has every backend usable.
"""
from __future__ import annotations

import json
import random
import sys
from typing import Callable

import torch

from pyext.dispatch import PyextError
from pyext.ops import fp8_quantize
from tests.fuzz_cases import FUZZERS

P = torch.ops.pyext


def _codes(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    w, s = fp8_quantize(torch.randn(n, k))
    return w.view(torch.uint8), s


def raw_cases() -> dict[str, list[tuple[str, Callable]]]:
    """{op: [(what, call)]}: raw-op calls that no backend may see."""
    q = torch.randn(1, 2, 5, 8)
    w, s = _codes(6, 8)
    cw, cs = _codes(4, 2 * 3 * 3)
    cw = cw.view(4, 2, 3, 3)
    x4 = torch.randn(1, 2, 6, 6)
    tile, out = torch.randn(1, 3, 4, 4), torch.zeros(1, 3, 8, 8)
    empty = torch.empty(1, 3, 0, 0)
    gx = torch.randn(2, 6, 4, 4)
    return {
        "attention": [
            ("no keys", lambda: P.attention(q, q[:, :, :0], q[:, :, :0], None, None)),
            ("3-D k and v", lambda: P.attention(q, q[0], q[0], None, None)),
            ("q's heads not a multiple of k's", lambda: P.attention(q, torch.cat([q, q[:, :1]], 1),
                                                                    torch.cat([q, q[:, :1]], 1), None, None)),
            ("mask does not broadcast", lambda: P.attention(q, q, q, None, None, torch.ones(5, 4, dtype=torch.bool))),
            ("5-D mask", lambda: P.attention(q, q, q, None, None, torch.ones(1, 1, 1, 5, 5, dtype=torch.bool))),
            ("int mask", lambda: P.attention(q, q, q, None, None, torch.ones(5, 5, dtype=torch.int32))),
            ("float64 bias", lambda: P.attention(q, q, q, None, None, torch.zeros(5, 5, dtype=torch.float64))),
            ("lse, mask does not broadcast", lambda: P.attention_lse(q, q, q, None, None, torch.zeros(2, 5))),
            ("k and v differ", lambda: P.attention(q, q, q[:, :, :3], None, None)),
            ("head_dim 0", lambda: P.attention(q[..., :0], q[..., :0], q[..., :0], None, None)),
            ("int dtype", lambda: P.attention(q.int(), q.int(), q.int(), None, None)),
            ("nan scale", lambda: P.attention(q, q, q, float("nan"), None)),
            ("forced cpp, no keys", lambda: P.attention(q, q[:, :, :0], q[:, :, :0], None, "cpp")),
        ],
        "fp8_linear": [
            ("k mismatch", lambda: P.fp8_linear(torch.randn(3, 9), w, s, None, None)),
            ("float weight", lambda: P.fp8_linear(torch.randn(3, 8), w.float(), s, None, None)),
            ("3-D weight", lambda: P.fp8_linear(torch.randn(3, 8), w[None], s, None, None)),
            ("scale size", lambda: P.fp8_linear(torch.randn(3, 8), w, s[:2], None, None)),
            ("bias shape", lambda: P.fp8_linear(torch.randn(3, 8), w, s, torch.ones(5), None)),
            ("int x", lambda: P.fp8_linear(torch.ones(3, 8, dtype=torch.int32), w, s, None, None)),
            ("forced cpp, k mismatch", lambda: P.fp8_linear(torch.randn(3, 9), w, s, None, "cpp")),
        ],
        "fp8_linear_dynamic": [
            ("k mismatch", lambda: P.fp8_linear_dynamic(torch.randn(3, 9), w, s, None, None)),
            ("no features", lambda: P.fp8_linear_dynamic(torch.randn(3, 0), w[:, :0], s, None, None)),
            ("float weight", lambda: P.fp8_linear_dynamic(torch.randn(3, 8), w.float(), s, None, None)),
            ("scale size", lambda: P.fp8_linear_dynamic(torch.randn(3, 8), w, s[:2], None, None)),
            ("forced scaled_mm, 8 features", lambda: P.fp8_linear_dynamic(torch.randn(3, 8).bfloat16(), w, s, None,
                                                                          "scaled_mm")),
        ],
        "fp8_upcast": [
            ("out shape", lambda: P.fp8_upcast_out(w, s, torch.empty(8, 6), None)),
            ("out strided", lambda: P.fp8_upcast_out(w, s, torch.empty(6, 16)[:, ::2], None)),
            ("out dtype", lambda: P.fp8_upcast_out(w, s, torch.empty(6, 8, dtype=torch.float64), None)),
            ("int dtype", lambda: P.fp8_upcast(w, s, torch.int32, None)),
            ("scale float64", lambda: P.fp8_upcast(w, s.double(), torch.float32, None)),
            ("scalar weight", lambda: P.fp8_upcast(w[0, 0], s[:1], torch.float32, None)),
        ],
        "fp8_conv2d": [
            ("stride [1]", lambda: P.fp8_conv2d(x4, cw, cs, None, [1], [1, 1], [1, 1], 1, None)),
            ("stride 0", lambda: P.fp8_conv2d(x4, cw, cs, None, [0, 0], [1, 1], [1, 1], 1, None)),
            ("negative padding", lambda: P.fp8_conv2d(x4, cw, cs, None, [1, 1], [-1, 0], [1, 1], 1, None)),
            ("groups 0", lambda: P.fp8_conv2d(x4, cw, cs, None, [1, 1], [1, 1], [1, 1], 0, None)),
            ("channels", lambda: P.fp8_conv2d(x4[:, :1], cw, cs, None, [1, 1], [1, 1], [1, 1], 1, None)),
            ("kernel too big", lambda: P.fp8_conv2d(x4[..., :1, :1], cw, cs, None, [1, 1], [0, 0], [1, 1], 1,
                                                    None)),
            ("3-D x", lambda: P.fp8_conv2d(x4[0], cw, cs, None, [1, 1], [1, 1], [1, 1], 1, None)),
        ],
        "tile_blend": [
            ("past the output", lambda: P.tile_blend(tile, out, 6, 0, 1, [0, 0, 0, 0], None, None, empty,
                                                     empty.clone(), None)),
            ("negative position", lambda: P.tile_blend(tile, out, -1, 0, 1, [0, 0, 0, 0], None, None, empty,
                                                       empty.clone(), None)),
            ("overlap too big", lambda: P.tile_blend(tile, out, 0, 0, 1, [5, 0, 0, 0], None, None, empty,
                                                     empty.clone(), None)),
            ("mode 7", lambda: P.tile_blend(tile, out, 0, 0, 7, [0, 0, 0, 0], None, None, empty, empty.clone(),
                                            None)),
            ("strided tile", lambda: P.tile_blend(tile.transpose(-1, -2), out, 0, 0, 1, [0, 0, 0, 0], None, None,
                                                  empty, empty.clone(), None)),
            ("crop too big", lambda: P.tile_blend(tile, out, 0, 0, 0, [5, 4], None, None,
                                                  torch.empty(1, 3, 0, 4), torch.empty(1, 3, 4, 0), None)),
            ("keep too big", lambda: P.tile_blend(tile, out, 0, 0, 0, [4, 4], None, None,
                                                  torch.empty(1, 3, 5, 4), torch.empty(1, 3, 4, 0), None)),
            ("above width", lambda: P.tile_blend(tile, out, 0, 0, 0, [4, 4], torch.empty(1, 3, 2, 5), None,
                                                 torch.empty(1, 3, 0, 4), torch.empty(1, 3, 4, 0), None)),
        ],
        "group_norm": [
            ("groups not dividing", lambda: P.group_norm(gx, 4, None, None, None, 1e-5, False, None)),
            ("eps 0", lambda: P.group_norm(gx, 2, None, None, None, 0.0, False, None)),
            ("weight shape", lambda: P.group_norm(gx, 2, torch.ones(3), None, None, 1e-5, False, None)),
            ("shift shape", lambda: P.group_norm(gx, 2, None, None, torch.ones(2, 6, 1), 1e-5, True, None)),
            ("1-D x", lambda: P.group_norm(torch.randn(6), 2, None, None, None, 1e-5, False, None)),
        ],
        "geglu": [
            ("odd last dim", lambda: P.geglu(torch.randn(3, 5), None)),
            ("0-D x", lambda: P.geglu(torch.tensor(1.0), None)),
            ("integer x", lambda: P.geglu(torch.ones(3, 4, dtype=torch.int32), None)),
            ("float64 x", lambda: P.geglu(torch.randn(3, 4, dtype=torch.float64), None)),
        ],
        "group_moments": [
            ("groups not dividing", lambda: P.group_moments(gx, 4, None)),
            ("3-D x", lambda: P.group_moments(gx[0], 2, None)),
            ("groups 0", lambda: P.group_moments(gx, 0, None)),
        ],
        "winograd_conv3x3": [
            ("5x5 weight", lambda: P.winograd_conv3x3(x4, torch.randn(4, 2, 5, 5), None, None)),
            ("channels", lambda: P.winograd_conv3x3(x4, torch.randn(4, 3, 3, 3), None, None)),
            ("bias shape", lambda: P.winograd_conv3x3(x4, torch.randn(4, 2, 3, 3), torch.ones(5), None)),
            ("dtypes differ", lambda: P.winograd_conv3x3(x4, torch.randn(4, 2, 3, 3).double(), None, None)),
        ],
    }


def public_cases(per_op: int = 3) -> dict[str, list[tuple[str, Callable]]]:
    """{fuzzer: [(what, call)]}: every bad input of the fuzz suite, on `per_op` drawn cases."""
    cases = {}
    for name, fuzzer in FUZZERS.items():
        r = random.Random(f"bad/{name}")
        drawn = [fuzzer.draw(r) for _ in range(per_op)]
        cases[name] = [(f"{what} #{i}", lambda p=p, bad=bad: bad(p)) for i, p in enumerate(drawn)
                       for what, bad in sorted(fuzzer.bad.items())]
    return cases


def feed_all() -> dict[str, list[str]]:
    """Runs every bad call; returns {op: [what raised something other than a PyextError naming it]}."""
    problems: dict[str, list[str]] = {}
    for source in (raw_cases(), public_cases()):
        for op, calls in source.items():
            for what, call in calls:
                try:
                    call()
                    problems.setdefault(op, []).append(f"{what}: accepted")
                except PyextError as err:
                    if not str(err).startswith("pyext."):
                        problems.setdefault(op, []).append(f"{what}: PyextError not naming the op: {err}")
                except Exception as err:  # noqa: BLE001 - the finding
                    problems.setdefault(op, []).append(f"{what}: {type(err).__name__}: {str(err)[:200]}")
    return problems


def valid_choices() -> dict[str, str]:
    """{"op dtype spec": backend}: what automatic dispatch picks for each op's test shapes in each dtype."""
    from pyext import dispatch

    chosen = {}
    for name, op in dispatch.ops().items():
        if name.startswith("_test"):
            continue
        for spec in {spec for b in op.backends for spec in b.test_shapes}:
            for dtype in dispatch.reference(op).dtypes:
                args = op.example(spec, dtype, "cpu")
                try:
                    chosen[f"{name} {dtype} {spec}"] = dispatch.select(name, args).name
                except PyextError as err:  # a declared case no CPU backend takes here: the same in both runs
                    chosen[f"{name} {dtype} {spec}"] = f"none: {str(err).splitlines()[0]}"
    return chosen


if __name__ == "__main__":
    # `feed`: choices, then every bad input; `check`: choices and marks, as a later process sees them
    from pyext import dispatch

    before = valid_choices()
    result = {"choices": before, "unusable": dispatch.unusable()}
    if sys.argv[1:] == ["feed"]:
        result["problems"] = feed_all()
    print(json.dumps(result))
