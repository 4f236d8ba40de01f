"""pyext.vae's exact method: the tiled decode/encode is the untiled one, on small random VAEs
of several shapes, at odd sizes, and its schedule runs each segment k + 1 times."""
from fractions import Fraction

import pytest
import torch

from pyext.vae import TilingConfig, exact, stages, state, tiled_run
from pyext.vae.geometry import equal_cores
from pyext.vae.statistics import Moments

diffusers = pytest.importorskip("diffusers")
IN_MEMORY = TilingConfig(state_dir=None)  # for tests of the state in memory (the default may put it in a file)

SHAPES = {  # block_out_channels, norm_num_groups, layers_per_block, latent_channels, sample (tile) size
    "3 blocks, 8 groups": ((32, 64, 64), 8, 1, 4, 64),
    "2 blocks, 4 groups, 2 layers": ((16, 24), 4, 2, 4, 32),
    "4 blocks, 16 groups, 16 latent channels": ((32, 32, 64, 64), 16, 1, 16, 64),
}


def _vae(name, dtype=torch.float32, seed=0):
    channels, groups, layers, latent, sample = SHAPES[name]
    torch.manual_seed(seed)
    n = len(channels)
    vae = diffusers.AutoencoderKL(block_out_channels=channels, down_block_types=("DownEncoderBlock2D",) * n,
                                  up_block_types=("UpDecoderBlock2D",) * n, latent_channels=latent,
                                  norm_num_groups=groups, layers_per_block=layers, sample_size=sample)
    return vae.eval().to(dtype)


def _smooth(shape, seed, coarse=4):
    gen = torch.Generator().manual_seed(seed)
    low = torch.randn(*shape[:-2], -(-shape[-2] // coarse), -(-shape[-1] // coarse), generator=gen)
    return 2 * torch.nn.functional.interpolate(low, size=shape[-2:], mode="bilinear", align_corners=False)


def psnr(a, ref):
    mse = float(((a.double() - ref.double()) ** 2).mean())
    return float("inf") if mse == 0 else 10 * torch.log10((ref.max() - ref.min()).double() ** 2 / mse).item()


def _full(vae, kind, x):
    if kind == "decode":
        return vae.decoder(vae.post_quant_conv(x))
    return vae.quant_conv(vae.encoder(x))


@torch.no_grad()
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_exact_equals_the_untiled_run(name, kind):
    """fp32, odd sizes, several tiles per axis, white-noise and smooth inputs: the tiled result
    is the untiled one to fp32 rounding (and far from what per-tile statistics give)."""
    vae = _vae(name)
    tile = vae.tile_latent_min_size if kind == "decode" else vae.tile_sample_min_size
    side = (2 * tile + 5, tile + 3)  # 3 x 2 tiles, the last ones odd-sized
    channels = vae.config.latent_channels if kind == "decode" else 3
    for seed, x in enumerate((torch.randn(1, channels, *side), _smooth((1, channels, *side), 1))):
        full = _full(vae, kind, x)
        got = tiled_run(vae, x, kind)
        assert got.shape == full.shape
        assert psnr(got, full) >= 100, (seed, psnr(got, full))
        torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4 * float(full.abs().max()))
    if kind == "decode" and name == "3 blocks, 8 groups":  # per-tile statistics are visibly different
        per_tile = tiled_run(vae, x, kind, TilingConfig(method="tiles"))
        assert psnr(per_tile, full) < 80


@torch.no_grad()
@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_exact_with_tiles_shrunk_by_the_element_budget(kind, monkeypatch):
    """With a small TILE_ELEMENTS, segments at higher resolution or with wider tensors run on
    finer grids than the configured tile (so one segment's tiles read across several bands of
    the previous one's state), and the result is still the untiled one."""
    monkeypatch.setattr(exact, "TILE_ELEMENTS", 2 ** 14)
    vae = _vae("3 blocks, 8 groups")
    tile = vae.tile_latent_min_size if kind == "decode" else vae.tile_sample_min_size
    side = (2 * tile + 5, tile + 3)
    x = torch.randn(1, vae.config.latent_channels if kind == "decode" else 3, *side)
    grids = []
    real = exact.Segment.grid
    monkeypatch.setattr(exact.Segment, "grid",
                        lambda seg, n, t, b, e: grids.append((n, t, real(seg, n, t, b, e))) or grids[-1][2])
    got = tiled_run(vae, x, kind)
    assert any(len(spans) > -(-n // t) for n, t, spans in grids)  # the budget bound somewhere
    full = _full(vae, kind, x)
    assert psnr(got, full) >= 100
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4 * float(full.abs().max()))


@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_tiles_hold_a_share_of_the_vaes_own_tile_and_at_most_tile_elements(kind):
    """The element budget is TILE_SHARE of the widest tensor that a tile of the VAE's size makes
    in any segment (so the run's tile and the state's chunks it holds stay under one VAE tile),
    and never above TILE_ELEMENTS."""
    vae = _vae("3 blocks, 8 groups")
    segs = exact.plan(stages.split(stages.steps_of(vae, kind), kind, exact=True)[1])
    tile = vae.tile_latent_min_size if kind == "decode" else vae.tile_sample_min_size
    widest, res = 0, Fraction(1)
    for seg in segs:
        widest = max(widest, (tile * res) ** 2 * seg.width)
        res *= seg.scale
    assert widest * exact.TILE_SHARE < exact.TILE_ELEMENTS
    assert exact.element_budget(segs, tile, 1) == int(widest * exact.TILE_SHARE)
    assert exact.element_budget(segs, tile, 3) == int(3 * widest * exact.TILE_SHARE)
    assert exact.element_budget(segs, 64 * tile, 1) == exact.TILE_ELEMENTS


@torch.no_grad()
@pytest.mark.parametrize("name", ["3 blocks, 8 groups", "4 blocks, 16 groups, 16 latent channels"])
@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_compact_state_is_float16_rounding_of_the_exact_run(name, kind, monkeypatch):
    """compact_state keeps the float32 state in float16 (half the bytes) and stays far closer
    to the untiled run than per-tile statistics: float16 rounding of the state only."""
    vae = _vae(name)
    tile = vae.tile_latent_min_size if kind == "decode" else vae.tile_sample_min_size
    x = _smooth((1, vae.config.latent_channels if kind == "decode" else 3, 2 * tile + 5, tile + 3), 1)
    stored, inputs = [], []  # (bands, dtype) of each band written; the bands of the tiled part's input
    real_write, real_of = state.Bands.write, state.Bands.of.__func__
    monkeypatch.setattr(state.Bands, "write", lambda self, r, xs, t: real_write(self, r, xs, t) or stored.append(
        (id(self), self.parts[r][0].dtype)))
    monkeypatch.setattr(state.Bands, "of", classmethod(lambda cls, t, rows: inputs.append(real_of(cls, t, rows)) or inputs[-1]))
    full, exact_run = _full(vae, kind, x), tiled_run(vae, x, kind, IN_MEMORY)
    assert {d for _, d in stored} == {torch.float32}
    stored.clear()
    compact = tiled_run(vae, x, kind, TilingConfig(compact_state=True, state_dir=None))
    assert {d for b, d in stored if b == id(inputs[-1])} == {torch.float32}  # the input, small, as it is
    assert {d for b, d in stored if b != id(inputs[-1])} == {torch.float16}
    assert psnr(exact_run, full) >= 100
    assert 70 <= psnr(compact, full) < psnr(exact_run, full)


def test_compact_bands_round_trip_within_float16_rounding():
    """Per (sample, channel) power-of-two scales: values up to 1e30 do not overflow, each value
    is within 2^-11 of its tile-channel's largest magnitude, and inf/nan stay non-finite."""
    torch.manual_seed(0)
    t = torch.randn(2, 3, 10, 12) * torch.tensor([1e-20, 1.0, 1e30]).view(1, 3, 1, 1)
    t[1, 1, 4, 5], t[1, 2, 0, 0] = float("inf"), float("nan")
    rows = [(0, 4), (4, 10)]
    bands = state.Bands(rows, 12, pin=False, compact=True)
    for r, (a, b) in enumerate(rows):
        for xs in ((0, 5), (5, 12)):
            bands.write(r, xs, (t[..., a:b, xs[0]:xs[1]],))
    assert all(p[0].dtype == torch.float16 for p in bands.parts)
    back, = bands.read((2, 9), (3, 11))
    want = t[..., 2:9, 3:11]
    assert back.dtype == torch.float32 and back.shape == want.shape
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(back), finite)
    tol = want.abs().where(finite, torch.zeros(())).amax(dim=(-2, -1), keepdim=True) * 2.0 ** -11
    assert ((back - want).abs().where(finite, torch.zeros(())) <= tol).all()
    whole_back, = bands.whole()
    assert torch.equal(whole_back[..., 2:9, 3:11], back)
    assert torch.equal(torch.isnan(whole_back), torch.isnan(t)) and torch.equal(torch.isinf(whole_back), torch.isinf(t))


def test_empty_tiles_are_not_written():
    """A downsampling maps a one-pixel last span to no pixels: writing it is a no-op."""
    bands = state.Bands([(0, 4), (4, 4)], 6, pin=False, compact=True)
    bands.write(0, (0, 6), (torch.ones(1, 2, 4, 6),))
    bands.write(0, (6, 6), (torch.ones(1, 2, 4, 0),))
    bands.write(1, (0, 6), (torch.ones(1, 2, 0, 6),))
    assert bands.parts[1] is None and list(bands.scales[0]) == [(0, 6)]
    assert torch.equal(bands.whole()[0], torch.ones(1, 2, 4, 6))


@torch.no_grad()
@pytest.mark.parametrize("dtype,min_db", [(torch.bfloat16, 30.0), (torch.float16, 45.0)])
def test_exact_in_half_precision_is_as_close_as_the_untiled_runs_own_rounding(dtype, min_db):
    """16-bit: the exact tiled decode is within the rounding the untiled decode itself has in
    that dtype (both against the fp32 decode)."""
    vae32 = _vae("3 blocks, 8 groups")
    vae = _vae("3 blocks, 8 groups").to(dtype)
    z = _smooth((1, 4, 37, 21), 3)
    ref = _full(vae32, "decode", z)
    full = _full(vae, "decode", z.to(dtype))
    got = tiled_run(vae, z.to(dtype), "decode")
    assert got.dtype == dtype
    assert psnr(got, ref) >= min(min_db, psnr(full, ref) - 3.0), (psnr(got, ref), psnr(full, ref))


@torch.no_grad()
def test_batch_of_two_gets_per_sample_statistics():
    vae = _vae("2 blocks, 4 groups, 2 layers")
    z = torch.cat([torch.randn(1, 4, 35, 19), 3 * torch.randn(1, 4, 35, 19) + 1])
    torch.testing.assert_close(tiled_run(vae, z, "decode"), _full(vae, "decode", z), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_moments_merge_equals_the_whole(dtype, layout):
    """Chan's merge of tile moments gives the whole tensor's mean and variance per (sample, group),
    from crops of the tensor, channels-last ones read in place by the C++ kernel."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 23, 17, generator=gen, dtype=torch.float64) * 5 + 100  # offset: cancellation
    x = x.to(dtype).contiguous(memory_format=layout)
    m = Moments()
    for a, b in ((0, 5), (5, 6), (6, 23)):
        for c, d in ((0, 9), (9, 17)):
            m.add(x[..., a:b, c:d], 4)
    mean, var = m.result()
    want_var, want_mean = torch.var_mean(x.double().reshape(2, 4, -1), dim=-1, correction=0)
    torch.testing.assert_close(mean, want_mean, rtol=1e-6, atol=1e-6)  # tiles reduce in fp32
    torch.testing.assert_close(var, want_var, rtol=1e-4, atol=1e-6)
    per_channel = Moments()  # gathered per channel, then grouped as GroupNorm groups channels
    for a, b in ((0, 11), (11, 23)):
        per_channel.add(x[..., a:b, :], 8)
    for groups in (4, 2, 8):
        mean, var = per_channel.grouped(groups).result()
        want_var, want_mean = torch.var_mean(x.double().reshape(2, groups, -1), dim=-1, correction=0)
        torch.testing.assert_close(mean, want_mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(var, want_var, rtol=1e-4, atol=1e-6)


def _group_norm_calls(steps) -> int:
    return sum(isinstance(m, torch.nn.GroupNorm) for s in steps for m in s.module.modules())


@torch.no_grad()
@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_each_segment_runs_once_per_group_norm_plus_once(kind, monkeypatch):
    """The schedule: a segment with k GroupNorm calls runs k + 1 times over the tiles (k passes
    stopped at a GroupNorm, one to the end), once less where it starts with a GroupNorm of its
    input (whose moments the previous segment gathered while writing it), and every window is
    one tile plus the margins."""
    vae = _vae("3 blocks, 8 groups")
    x = torch.randn(1, 4, 37, 30) if kind == "decode" else torch.randn(1, 3, 150, 121)
    runs, windows, attended = [], [], []
    real_run, real_read, real_attend = stages.run, state.Bands.read, exact._attend
    # a segment by the layers it runs (split_resnets makes new containers on every call)
    key = lambda steps: tuple(id(m) for s in steps for m in s.module.modules() if not list(m.children()))  # noqa: E731
    layouts = set()  # whether each tile a segment runs is dense channels-last, as its convs take it best

    def run(steps, *tensors):
        if steps:  # not the empty part before the tiles
            runs.append(key(steps))
            layouts.update(t.is_contiguous(memory_format=torch.channels_last) for t in tensors)
        return real_run(steps, *tensors)

    monkeypatch.setattr(stages, "run", run)

    def read(self, ys, xs, device=None):
        if not attended or attended[-1] is not None:  # not inside the whole-image attention
            windows.append((self.height, ys[1] - ys[0], xs[1] - xs[0]))
        return real_read(self, ys, xs, device)

    def attend(attn, *args, **kwargs):
        attended.append(None)  # its reads are whole rows
        done = real_attend(attn, *args, **kwargs)
        attended[-1] = attn
        return done

    written, real_write = set(), state.Bands.write
    monkeypatch.setattr(state.Bands, "write", lambda self, row, xs, t: written.add(len(t)) or real_write(self, row, xs, t))
    monkeypatch.setattr(state.Bands, "read", read)
    monkeypatch.setattr(exact, "_attend", attend)
    plan_steps = stages.split(stages.steps_of(vae, kind), kind, exact=True)[1]
    segs = exact.plan(plan_steps)
    tiled_run(vae, x, kind, IN_MEMORY)
    assert attended == [m for m in (vae.decoder if kind == "decode" else vae.encoder).mid_block.attentions]
    assert written == {1}  # one tensor per state: no resnet's input is written again as its residual
    assert layouts == {True}
    tile = vae.tile_latent_min_size if kind == "decode" else vae.tile_sample_min_size
    elements = exact.element_budget(segs, tile, 1)
    n, size, res = x.shape[-2], list(x.shape[-2:]), Fraction(1)
    for seg in segs:  # each segment on its own grid of abutting tiles
        if seg.steps[0].attends_whole:  # once over the whole image, not by tiles
            assert len(seg.steps) == 1 and runs.count(key(seg.steps)) == 0
            continue
        tiles = len(seg.grid(size[0], int(tile * res), 1, elements)) * len(seg.grid(size[1], int(tile * res), 1, elements))
        assert tiles >= 4
        # minus the reading pass where the previous segment gathered this one's input moments
        gathered = seg is not segs[0] and seg.steps[0].input_norm is not None
        assert runs.count(key(seg.steps)) == (_group_norm_calls(seg.steps) + 1 - gathered) * tiles
        size, res = [int(s * seg.scale) for s in size], res * seg.scale
    assert sum(_group_norm_calls(s.steps) for s in segs) == _group_norm_calls(plan_steps) > 0
    margin = max(s.margin for s in segs)
    for height, h, w in windows[:-1]:  # the last read is the whole output
        res = height / n  # this segment's pixels per pixel of the input
        assert max(h, w) <= tile * res + 2 * margin, (height, h, w)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_a_cheap_head_joins_the_first_segment_with_its_resnet_whole(kind, monkeypatch):
    """The convs before the first GroupNorm (from the image or the latent: few channels) run again
    in each pass of the first segment, whose resnet is whole, instead of being kept as two
    whole-image states; a head that reads more than HEAD_CHANNELS is a segment of its own. Both
    give the untiled result."""
    vae = _vae("4 blocks, 16 groups, 16 latent channels")
    steps = stages.split(stages.steps_of(vae, kind), kind, exact=True)[1]
    coder = vae.decoder if kind == "decode" else vae.encoder
    first = exact.plan(steps)[0]
    assert coder.conv_in in [s.module for s in first.steps]
    assert _group_norm_calls(first.steps) == 2 and not any(s.passes_input for s in first.steps)
    tile = vae.tile_latent_min_size if kind == "decode" else vae.tile_sample_min_size
    x = _smooth((1, vae.config.latent_channels if kind == "decode" else 3, 2 * tile + 5, tile + 3), 1)
    states, real_init = [], state.Bands.__init__
    monkeypatch.setattr(state.Bands, "__init__", lambda self, *a, **k: states.append(a[0]) or real_init(self, *a, **k))
    full, folded = _full(vae, kind, x), tiled_run(vae, x, kind, IN_MEMORY)
    folded_states = len(states)
    monkeypatch.setattr(exact, "HEAD_CHANNELS", 2)  # fewer than the 16 latent channels and the 3 of the image
    segs = exact.plan(steps)
    assert _group_norm_calls(segs[0].steps) == 0 and segs[1].steps[-1].passes_input
    states.clear()
    apart = tiled_run(vae, x, kind, IN_MEMORY)
    assert len(states) == folded_states + 2  # the head's output and the first conv1's
    assert psnr(folded, full) >= 100 and psnr(apart, full) >= 100


@torch.no_grad()
def test_bands_are_freed_once_no_tile_reads_them():
    whole = torch.arange(80.0).view(1, 2, 8, 5)
    bands = state.Bands.of(whole, [(0, 3), (3, 6), (6, 8)])
    torch.testing.assert_close(bands.read((2, 7), (1, 4))[0], whole[..., 2:7, 1:4])
    bands.free_above(5)
    assert bands.parts[0] is None and bands.parts[1] is not None
    vae = _vae("3 blocks, 8 groups")
    before = state.Bands.of(torch.randn(1, 64, 48, 20), equal_cores(48, 16))
    first_half = exact.segments(stages.split_resnets(stages.split(stages.steps_of(vae, "decode"), "decode")[1]))[1]
    assert first_half.steps[-1].passes_input
    run = lambda keep: exact._run_segment(first_half, before, before.rows, equal_cores(20, 16),  # noqa: E731
                                          torch.device("cpu"), lambda rows, width: state.Bands(rows, width, pin=False),
                                          keep=keep)[0]
    out = run(keep=True)  # its input is read again by the second half: nothing of it is freed
    assert all(p is not None for p in before.parts)
    assert all(len(p) == 1 for p in out.parts)  # conv1's output only: the residual is the input, kept
    run(keep=False)
    assert before.parts[0] is None and before.parts[-1] is not None  # the last pass freed what it had read


def test_segments_start_at_group_norms_and_carry_what_follows_them():
    vae = _vae("3 blocks, 8 groups")
    tiled = stages.split_resnets(stages.split(stages.steps_of(vae, "decode"), "decode")[1])
    segs = exact.segments(tiled)
    # upsampler | resnet to norm2 | norm2 on | ... | resnet from norm2 + upsampler | ... | norm + act + conv
    assert [len(s.steps) for s in segs] == [1, 1, 1, 1, 2, 1, 1, 1, 1, 3]
    assert [s.scale for s in segs] == [2, 1, 1, 1, 2, 1, 1, 1, 1, 1]
    assert [s.margin for s in segs] == [1, 1, 1, 1, 2, 1, 1, 1, 1, 1]  # an upsampler's conv reaches half a pixel
    assert [_group_norm_calls(s.steps) for s in segs] == [0] + [1] * 9


@torch.no_grad()
@pytest.mark.parametrize("channels, scale, act", [((8, 8), 2.0, "silu"), ((8, 16), 1.0, "silu"), ((8, 8), 1.0, "mish")])
def test_resnet_halves_are_the_resnet(channels, scale, act):
    """The two halves a resnet is cut into give its forward bit for bit, shortcut or not (their
    activation and sum run in place where they can)."""
    from diffusers.models.resnet import ResnetBlock2D
    torch.manual_seed(0)
    r = ResnetBlock2D(in_channels=channels[0], out_channels=channels[1], temb_channels=None, groups=4,
                      output_scale_factor=scale, non_linearity=act).eval()
    first, second = stages.split_resnets([stages.Step(lambda x: r(x, None), r)])
    x = torch.randn(2, channels[0], 9, 7)
    assert first.passes_input and not second.passes_input
    kept = x.clone()
    assert torch.equal(second.call(first.call(x), x), r(x, None))
    assert torch.equal(stages.whole_resnet(stages.Step(lambda x: r(x, None), r)).call(x), r(x, None))
    assert torch.equal(x, kept)  # the input, which the run keeps for the second half, is not written
    with torch.enable_grad():  # out of place where autograd records
        assert torch.equal(second.call(first.call(x), x), r(x, None))
    # the 1x1 shortcut runs in the second half, on the block's input, which the run keeps
    assert second.module[-1] is r.conv_shortcut or channels[0] == channels[1]
