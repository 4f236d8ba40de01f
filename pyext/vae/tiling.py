"""tiled_run: one tiled decode (latents -> image) or encode (image -> latent moments)."""
from __future__ import annotations

import math

import torch

from pyext.vae import exact, stages
from pyext.vae.config import TilingConfig, fail
from pyext.vae.geometry import diffusers_tiling_mismatch, grid, overlapping_cores, window
from pyext.vae.streaming import diffusers_blend, normalized_blend


class Plan:
    """The network split for one run (the untiled parts before and after the tiles, the tiled
    steps) and the tile geometry, from the VAE's tile settings and the config."""

    def __init__(self, vae, kind: str, config: TilingConfig):
        self.kind, self.config = kind, config
        self.n_down = len(vae.config.block_out_channels) - 1
        self.factor = 2 ** self.n_down
        self.unit = 1 if kind == "decode" else self.factor  # input pixels per output step
        if kind == "decode":
            self.tile_in, self.tile_out = vae.tile_latent_min_size, vae.tile_sample_min_size
        else:
            self.tile_in, self.tile_out = vae.tile_sample_min_size, vae.tile_latent_min_size
        self.overlap = vae.tile_overlap_factor
        if config.method == "diffusers":  # each tile runs the whole network, as diffusers' tiles do
            whole = (lambda x: vae.decoder(vae.post_quant_conv(x) if vae.post_quant_conv is not None else x)) \
                if kind == "decode" else \
                (lambda x: vae.quant_conv(vae.encoder(x)) if vae.quant_conv is not None else vae.encoder(x))
            self.before, self.tiled, self.after = [], [stages.Step(whole, vae)], []
        else:
            self.before, self.tiled, self.after = stages.split(stages.steps_of(vae, kind), kind, config.method == "exact")

    def out_extent(self, n: int) -> int:
        """Output pixels of n input pixels: x factor when decoding; encoding floors each halving
        (Downsample2D pads (0, 1) and runs a stride-2 3x3 conv)."""
        if self.kind == "decode":
            return n * self.factor
        for _ in range(self.n_down):
            n //= 2
        return n

    def context(self) -> int:
        """Input pixels of real neighbourhood around each tile ("tiles")."""
        latent = self.config.context
        if latent is None:
            latent = math.ceil(stages.radius(self.tiled) / self.unit - 1e-9)
        return latent * self.unit

    def run_window(self, h: torch.Tensor, ys, xs, margin: int) -> torch.Tensor:
        """The tiled steps on the spans plus `margin` of neighbours, cropped back to the spans."""
        (y0, y1), (x0, x1) = window(ys, h.shape[-2], margin), window(xs, h.shape[-1], margin)
        t = stages.run(self.tiled, h[..., y0:y1, x0:x1])
        want = (self.out_extent(ys[1] - ys[0]), self.out_extent(xs[1] - xs[0]))
        cy, cx = self.out_extent(ys[0] - y0), self.out_extent(xs[0] - x0)
        t = t[..., cy:cy + want[0], cx:cx + want[1]] if margin else t
        if tuple(t.shape[-2:]) != want:
            fail(f"a {ys[1] - ys[0]}x{xs[1] - xs[0]} input tile gave a {tuple(t.shape[-2:])} output, expected {want}; "
                 f"this VAE's {self.kind}r does not scale like AutoencoderKL's")
        return t.contiguous()


def _tiles(plan: Plan, h: torch.Tensor) -> torch.Tensor:
    """Per-tile statistics: overlapping cores whose windows (context included) fit one tile,
    blended with symmetric ramps."""
    ctx = plan.context()
    rows, cols = (overlapping_cores(n, plan.tile_in, ctx, plan.overlap, plan.unit) for n in h.shape[-2:])
    at = lambda spans: [(plan.out_extent(a), plan.out_extent(a) + plan.out_extent(b - a)) for a, b in spans]  # noqa: E731
    return normalized_blend(lambda ys, xs: plan.run_window(h, ys, xs, ctx), at(rows), at(cols), rows, cols)


def _diffusers(plan: Plan, h: torch.Tensor) -> torch.Tensor:
    sample, latent = (plan.tile_out, plan.tile_in) if plan.kind == "decode" else (plan.tile_in, plan.tile_out)
    why = diffusers_tiling_mismatch("tile_size", sample, latent, plan.overlap)
    if why is not None:
        fail(f"method 'diffusers': {why}")
    stride = int(plan.tile_in * (1 - plan.overlap))  # as diffusers: overlap_size
    rows, cols = (grid(n, plan.tile_in, stride) for n in h.shape[-2:])
    return diffusers_blend(lambda ys, xs: plan.run_window(h, ys, xs, 0), rows, cols, plan.out_extent,
                           plan.tile_out, int(plan.tile_out * plan.overlap))


def tiled_run(vae, x: torch.Tensor, kind: str, config: TilingConfig = TilingConfig()) -> torch.Tensor:
    """Tiled decode (kind "decode": latents -> image, before the VAE's scaling) or encode
    ("encode": image -> latent moments) of x with one AutoencoderKL, as `config` says."""
    if kind not in ("decode", "encode"):
        fail(f"kind must be 'decode' or 'encode', got {kind!r}")
    plan = Plan(vae, kind, config)
    h = stages.run(plan.before, x)
    if config.method == "exact":
        if stages.has_attention(plan.tiled):
            fail("method 'exact' needs a tiled part without attention (its attention spans the whole image); "
                 "this VAE's up/down blocks have attention layers: use method 'tiles' or 'diffusers'")
        out = exact.run(plan.tiled, h, plan.tile_in, config)
    elif config.method == "tiles":
        out = _tiles(plan, h)
    else:
        out = _diffusers(plan, h)
    del h
    return stages.run(plan.after, out)
