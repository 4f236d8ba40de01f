"""VAE memory: tiling only when the full decode would not fit, and slicing of batches."""
from __future__ import annotations

from pyext.dispatch import PyextError
from pyext.families import vae_kind
from pyext.techniques.base import Entry, Step, Technique, undo_by


class VAETiling(Technique):
    """AutoencoderKL-family 2-D VAEs get pyext's exact tiling (pyext.vae: the untiled decode's
    numbers, one tile on the device); other VAEs (3-D video VAEs, DC-AE, VQ) diffusers' own
    tiling, with their linear blend fused where they have it. Only when the decision says the
    full decode would not fit, or when asked."""

    name = "vae_tiling"

    def plan(self, pipe, d) -> list[Step]:
        return [self.will(name) if d.vae_tiling else self.wont(name, d.vae_tiling_reason) for name in d.components.vaes]

    def change(self, pipe, name: str, d) -> Entry:
        from pyext import vae as pvae

        vae = d.components.vaes[name]
        report = pvae.tile_vae(vae) if vae_kind(vae) == "kl2d" else None
        if report is not None and report["patched"]:
            return self.applied(name, f"pyext tiling (exact), {report['tile_sample_min_size']}-px tiles "
                                      f"({d.vae_tiling_reason})",
                                undo_by(pvae.untile_vae, vae, says="diffusers' decode again"))
        if getattr(vae, "use_tiling", False):
            return self.already(name, "diffusers' tiling was on")
        if not hasattr(vae, "enable_tiling"):
            return self.skipped(name, f"{type(vae).__name__} has no tiling")
        try:
            fused = pvae.tile_video_vae(vae)["fused_blends"]
        except PyextError as e:  # its default tiles would give the wrong size: left untiled
            return self.skipped(name, str(e))
        blend = f", {' and '.join(fused)} fused" if fused else ""
        return self.applied(name, f"diffusers' tiling for this {vae_kind(vae)} VAE{blend} ({d.vae_tiling_reason})",
                            undo_by(pvae.untile_video_vae, vae, says="tiling off"))


class VAESlicing(Technique):
    """Decode a batch one image (or video) at a time: "auto" does it when tiling or offload is on."""

    name = "vae_slicing"

    def plan(self, pipe, d) -> list[Step]:
        setting = d.options.vae_slicing
        if setting == "on" or (setting == "auto" and (d.vae_tiling or d.offload != "off")):
            return [self.will(name) for name in d.components.vaes]
        why = "vae_slicing='off'" if setting == "off" else "auto: neither tiling nor offload is on"
        return [self.wont(name, why) for name in d.components.vaes]

    def change(self, pipe, name: str, d) -> Entry:
        vae = d.components.vaes[name]
        if getattr(vae, "use_slicing", False):
            return self.already(name, "slicing was on")
        if not hasattr(vae, "enable_slicing"):
            return self.skipped(name, f"{type(vae).__name__} has no slicing")
        vae.enable_slicing()
        return self.applied(name, "batches decode one at a time", undo_by(vae.disable_slicing, says="slicing off"))
