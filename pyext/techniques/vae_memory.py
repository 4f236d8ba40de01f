"""VAE memory: tiling only when the full decode would not fit, and slicing of batches."""
from __future__ import annotations

from pyext.dispatch import PyextError
from pyext.families import vae_kind
from pyext.techniques.base import Entry, Technique, undo_by


class VAETiling(Technique):
    """AutoencoderKL-family 2-D VAEs get pyext's exact tiling (pyext.vae: the untiled decode's
    numbers, one tile on the device); other VAEs (3-D video VAEs, DC-AE, VQ) diffusers' own
    tiling, with their linear blend fused where they have it. Only when the decision says the
    full decode would not fit, or when asked."""

    name = "vae_tiling"

    def apply(self, pipe, d) -> list[Entry]:
        from pyext import vae as pvae

        entries = []
        for name, vae in d.components.vaes.items():
            report = None
            if not d.vae_tiling:
                entries.append(self.skipped(name, d.vae_tiling_reason))
                continue
            if vae_kind(vae) == "kl2d":
                report = pvae.tile_vae(vae)
            if report is not None and report["patched"]:
                entries.append(self.applied(name, f"pyext tiling (exact), {report['tile_sample_min_size']}-px tiles "
                                                  f"({d.vae_tiling_reason})",
                                            undo_by(pvae.untile_vae, vae, says="diffusers' decode again")))
            elif getattr(vae, "use_tiling", False):
                entries.append(self.already(name, "diffusers' tiling was on"))
            elif hasattr(vae, "enable_tiling"):
                try:
                    fused = pvae.tile_video_vae(vae)["fused_blends"]
                except PyextError as e:  # its default tiles would give the wrong size: left untiled
                    entries.append(self.skipped(name, str(e)))
                    continue
                blend = f", {' and '.join(fused)} fused" if fused else ""
                entries.append(self.applied(name, f"diffusers' tiling for this {vae_kind(vae)} VAE{blend} "
                                                  f"({d.vae_tiling_reason})",
                                            undo_by(pvae.untile_video_vae, vae, says="tiling off")))
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
                                            undo_by(vae.disable_slicing, says="slicing off")))
        return entries
