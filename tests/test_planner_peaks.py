"""The memory planner's peak estimates against measured peaks (CPU, torch's memory profiler)."""
import pytest
import torch

from bench.planner_peaks import ARCHS, measure, measure_tiled_vae, profile_peaks

pytestmark = pytest.mark.independent  # make test spreads its tests over the workers

TOLERANCE = 0.25


def test_profile_peaks_measures_live_allocations():
    def work():
        a = torch.empty(1 << 20, dtype=torch.uint8)  # 1 MiB live ...
        b = torch.empty(3 << 20, dtype=torch.uint8)  # ... with 3 MiB: a 4 MiB peak
        del a, b
        torch.empty(2 << 20, dtype=torch.uint8)  # freed at once: below the peak

    class Grow(torch.nn.Module):
        def forward(self, x):
            return torch.cat([x, x])

    grow = Grow()
    peak, per = profile_peaks(lambda: (work(), grow(torch.empty(1 << 18))), {"grow": grow})
    assert peak == 4 << 20
    assert per == {"grow": 2 << 20}  # its own allocation, above what was live when it began


# Both sides of dtype="auto" on every CPU: bf16 where oneDNN computes it natively, fp32 elsewhere.
# (Elsewhere bf16 is emulated: slower, and its CPU convolutions take other paths, which the planner
# asks torch about.)
DTYPES = (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_planner_peak_matches_the_measured_peak(arch, dtype):
    row = measure(arch, dtype=dtype)
    assert abs(row["ratio"] - 1) <= TOLERANCE, (
        f"{arch} in {dtype}: estimated {row['estimate_bytes']} bytes, measured {row['measured_bytes']} "
        f"(ratio {row['ratio']:.2f}); per component: {row['components']}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_planner_tiled_vae_estimate_matches_the_measured_decode(dtype):
    row = measure_tiled_vae(side=512, dtype=dtype)  # several tiles of the tiny VAE; the bench runs 1024
    for mode in ("off", "on"):
        assert abs(row[f"tiling_{mode}"]["ratio"] - 1) <= TOLERANCE, row
    assert row["tiling_on"]["measured_bytes"] < row["tiling_off"]["measured_bytes"]
