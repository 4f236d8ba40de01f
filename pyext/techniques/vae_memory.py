"""VAE memory: tiling only when the full decode would not fit, and slicing of batches."""
from __future__ import annotations

from pyext.families import vae_kind
from pyext.techniques.base import Entry, Technique


class VAETiling(Technique):
    """AutoencoderKL-family 2-D VAEs get pyext's tiling (pyext.vae: exact borders, whole-image
    statistics, streamed tiles); other VAEs (3-D video VAEs, DC-AE, VQ) diffusers' own
    enable_tiling. Only when the decision says the full decode would not fit, or when asked."""

    name = "vae_tiling"

    def apply(self, pipe, d) -> list[Entry]:
        entries = []
        for name, vae in d.components.vaes.items():
            if not d.vae_tiling:
                entries.append(self.skipped(name, d.vae_tiling_reason))
            elif vae_kind(vae) == "kl2d":
                from pyext import vae as pvae

                report = pvae.tile_vae(vae)
                entries.append(self.applied(name, f"pyext tiling, {report['tile_sample_min_size']}-px tiles "
                                                  f"({d.vae_tiling_reason})",
                                            lambda v=vae: (pvae.untile_vae(v), "diffusers' decode again")[1]))
            elif getattr(vae, "use_tiling", False):
                entries.append(self.already(name, "diffusers' tiling was on"))
            elif hasattr(vae, "enable_tiling"):
                vae.enable_tiling()
                entries.append(self.applied(name, f"diffusers' tiling for this {vae_kind(vae)} VAE ({d.vae_tiling_reason})",
                                            lambda v=vae: (v.disable_tiling(), "tiling off")[1]))
            else:
                entries.append(self.skipped(name, f"{type(vae).__name__} has no tiling"))
        return entries


class VAESlicing(Technique):
    """Decode a batch one image (or video) at a time: "auto" does it when tiling or offload is on."""

    name = "vae_slicing"

    def apply(self, pipe, d) -> list[Entry]:
        setting = d.options.vae_slicing
        want = setting == "on" or (setting == "auto" and (d.vae_tiling or d.offload != "off"))
        entries = []
        for name, vae in d.components.vaes.items():
            if not want:
                entries.append(self.skipped(name, "vae_slicing='off'" if setting == "off"
                                            else "auto: neither tiling nor offload is on"))
            elif getattr(vae, "use_slicing", False):
                entries.append(self.already(name, "slicing was on"))
            elif not hasattr(vae, "enable_slicing"):
                entries.append(self.skipped(name, f"{type(vae).__name__} has no slicing"))
            else:
                vae.enable_slicing()
                entries.append(self.applied(name, "batches decode one at a time",
                                            lambda v=vae: (v.disable_slicing(), "slicing off")[1]))
        return entries
