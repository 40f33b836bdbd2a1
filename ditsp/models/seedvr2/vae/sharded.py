"""Parallel and memory-bounded execution of the VAE across an SP group.

Modes (all exact except ``tiled``; every rank returns the same full result unless asked to keep
its slab):

``replicated``     every rank runs the whole clip in one pass (small inputs; no communication).
``chunked``        every rank runs the whole clip as causal time chunks (``chunk`` latent frames
                   each) with each conv's tail carried over: memory bounded by one chunk.
``time``           temporal SP: rank r owns a consecutive range of latent frames (and the input
                   frames that map onto them); each causal conv receives its past frames from rank
                   r - 1 and forwards its own tail to rank r + 1 (:mod:`ditsp.distributed.halo`).
``height``         height slabs at multiples of one latent row (8 input rows; near-even, or in
                   proportion to the ranks' speeds where they differ); per-conv row halos,
                   GroupNorm statistics reduced over slabs per frame, mid-attention keys/values
                   gathered per frame.
``height+chunks``  height slabs, each rank walking its slab in causal time chunks.
``tiled``          one device, overlapping spatial tiles blended with a raised cosine
                   (:mod:`.tiled`): APPROXIMATE (each tile has its own GroupNorm statistics and
                   attention), for little memory only.

Ranks with nothing to hold (more ranks than latent rows or frames) still take part in every
collective and produce empty pieces. Every entry point first makes the ranks agree on mode,
shapes, dtype and chunking (:func:`ditsp.distributed.agree.agree`), so a mismatch raises on every rank
instead of hanging. ``mode="auto"`` picks, identically on every rank, the first exact mode of
:data:`.modes.AUTO_ORDER` whose modelled per-rank memory (:mod:`.memory`) fits the budget (on one
device skipping the modes that split across ranks), ``tiled`` only when none does.

Slab ownership for the hand-off to the DiT: after ``encode(..., keep_sharded=True)`` rank r holds
the latent rows ``layout.rank_rows(r) = (t0, t1, h0, h1)`` (all columns) in canonical latent
coordinates; :meth:`ParallelVAE.decode_slab` takes such a slab back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ....distributed.agree import agree
from ....distributed.comm import Comm
from ....fixed_shape import current
from .execution import Exec
from .layouts import SlabLayout, TimeLayout, even_split  # noqa: F401 - re-exported
from .model import Posterior, VideoVAE, check_video, decoder_pieces, encoder_pieces, time_pieces

from .modes import AUTO, EXACT_MODES, MODES, SLAB_MODES  # noqa: F401 - EXACT_MODES re-exported
from .memory import backend_of, choose_mode, counts_winograd
from .tiled import tiled_decode
from .tiled import tiled_encode


@dataclass
class Encoded:
    """Encoder result: the posterior (whole, or this rank's slab when ``layout`` is set)."""

    posterior: Posterior
    mode: str
    report: str
    layout: SlabLayout | None = None


def _gather(comm: Comm, x: torch.Tensor, dim: int, counts: list[int], kind: str) -> torch.Tensor:
    """Concatenate every rank's piece along ``dim`` (pieces of ``counts[r]`` along it), on every rank."""
    if comm.world_size == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    parts = comm.all_gather_rows(moved, counts, kind=kind)
    return torch.cat(parts, 0).movedim(0, dim)


class ParallelVAE:
    """Runs a :class:`VideoVAE` on an SP group (``comm``; ``None`` = one device).

    ``chunk``: latent frames per causal chunk in the chunked modes. ``budget_bytes``: per-rank memory
    budget for ``mode="auto"`` (``None``: no limit). ``tile``/``overlap``: latent tile size and
    overlap of the tiled mode. Kernel calls follow the caller's kernel-shape policy
    (:func:`ditsp.fixed_shape.use`; the restoration enters its request's): under ``DETERMINISTIC`` every
    exact mode equals one device bit for bit, under the default plain calls within tolerance.
    """

    def __init__(self, vae: VideoVAE, comm: Comm | None = None, *, chunk: int = 1, budget_bytes: int | None = None,
                 tile: int = 32, overlap: int = 8, speeds: tuple[float, ...] | None = None):
        self.vae, self.cfg = vae, vae.cfg
        self.comm = comm or Comm.single()
        self.chunk, self.budget, self.tile, self.overlap = chunk, budget_bytes, tile, overlap
        # per rank, ranks of unequal speed: height slabs cut in proportion (None: even; :class:`.layouts.SlabLayout`)
        self.speeds = None if speeds is None or len(set(speeds)) <= 1 else tuple(float(v) for v in speeds)
        if self.speeds is not None and len(self.speeds) != self.comm.world_size:
            raise ValueError(f"{len(self.speeds)} rank speeds for an SP group of {self.comm.world_size}")

    # -- mode choice -----------------------------------------------------------------

    def choose(self, shape: tuple[int, int, int]):
        """What ``auto`` picks for a clip of pixel shape (T, H, W) on this group (no collective; see :mod:`.modes`)."""

        device, deterministic = next(self.vae.parameters()).device, current().deterministic
        return choose_mode(self.cfg, shape, self.comm.world_size, self.budget, self.vae.dtype, self.chunk,
                           tile=self.tile, overlap=self.overlap, winograd_filters=counts_winograd(device, deterministic),
                           backend=backend_of(device, deterministic))

    def resolve(self, op: str, shape: tuple[int, int, int], mode: str) -> tuple[str, str]:
        """(mode, report) for ``op`` ("encode"/"decode") of a clip with pixel shape (T, H, W)."""
        agree(self.comm, f"vae.{op} request", {"mode": mode, "shape": list(shape), "dtype": str(self.vae.dtype),
                                               "chunk": self.chunk, "budget": self.budget, "tile": [self.tile, self.overlap],
                                               "widths": list(self.cfg.widths), "speeds": self.speeds})
        if mode == AUTO:
            choice = self.choose(shape)
            mode, why = choice.mode, choice.report
        elif mode not in MODES:
            raise ValueError(f"unknown VAE mode {mode!r}; choose one of {MODES} or 'auto'")
        else:
            why = "requested"
        T, H, W = shape
        if mode in SLAB_MODES and H < self.cfg.spatial_factor:
            raise ValueError(f"height sharding needs at least {self.cfg.spatial_factor} rows")
        report = f"VAE {op} mode {mode} (SP={self.comm.world_size}, {why})"
        return mode, report

    # -- encode ------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, video: torch.Tensor, mode: str = "auto", keep_sharded: bool = False) -> Encoded:
        """Posterior of ``video`` (B, 3, T, H, W), given whole on every rank.

        ``keep_sharded`` (height modes): return only this rank's latent slab and its layout.
        """
        x = check_video(video, self.cfg).to(self.vae.dtype)
        T, H, W = x.shape[2:]
        mode, report = self.resolve("encode", (T, H, W), mode)
        t, h, w = self.cfg.latent_shape(T, H, W)
        comm, r, n = self.comm, self.comm.rank, self.comm.world_size
        layout = None
        if mode in ("replicated", "chunked"):
            pieces = encoder_pieces(T, self.chunk if mode == "chunked" else None, self.cfg.temporal_factor)
            m = self.vae.run_encoder(x, Exec(carry={} if len(pieces) > 1 else None), pieces)
        elif mode == "time":
            tl = TimeLayout(t, n, self.cfg.temporal_factor)
            p, q = tl.latents[r]
            a, b = tl.frames(p, q)
            m = self.vae.encoder(x[:, :, a:b], Exec(comm, time_chain=True, image_fast_path=T == 1).begin(a))
            m = _gather(comm, m, 2, [q_ - p_ for p_, q_ in tl.latents], "output_gather")
        elif mode in SLAB_MODES:
            layout = SlabLayout(t, h, w, H, W, n, self.speeds)
            prow = layout.pixel_rows(self.cfg.spatial_factor)
            a, b = prow[r]
            pieces = encoder_pieces(T, self.chunk if mode == "height+chunks" else None, self.cfg.temporal_factor)
            ex = Exec(comm, carry={} if len(pieces) > 1 else None)
            local = x[:, :, :, a:b]
            m = self.vae.run_encoder_rows(local, ex, pieces, prow, H)
            if not keep_sharded:
                m = _gather(comm, m, 3, [q_ - p_ for p_, q_ in layout.rows], "output_gather")
        else:  # tiled

            m = tiled_encode(self.vae, x, self.tile, self.overlap, self.chunk)
        post = Posterior.from_moments(m, self.cfg.logvar_range)
        return Encoded(post, mode, report, layout if keep_sharded and layout is not None else None)

    @torch.no_grad()
    def encode_latent(self, video: torch.Tensor, mode: str = "auto", noise: torch.Tensor | None = None,
                      generator: torch.Generator | None = None, keep_sharded: bool = False):
        """The DiT's latent (posterior sample x scale, (B, 16, t, h, w)) and the slab layout (or None).

        ``noise``/``generator`` give the canonical (whole-latent) draw; a sharded rank uses its rows of it.
        """
        enc = self.encode(video, mode, keep_sharded)
        mean = enc.posterior.mean
        if noise is None:
            T, H, W = video.shape[2:]
            t, h, w = self.cfg.latent_shape(T, H, W)
            noise = torch.randn((mean.shape[0], mean.shape[1], t, h, w), generator=generator, dtype=mean.dtype)
        if enc.layout is not None:
            _, _, h0, h1 = enc.layout.rank_rows(self.comm.rank)
            noise = noise[:, :, :, h0:h1]
        return self.vae.to_latent(enc.posterior.sample(noise)), enc

    # -- decode ------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, z: torch.Tensor, mode: str = "auto") -> torch.Tensor:
        """Video of an unscaled latent ``z`` (B, 16, t, h, w), given whole on every rank."""
        t, h, w = z.shape[2:]
        T, H, W = self.cfg.decoded_shape(t, h, w)
        mode, report = self.resolve("decode", (T, H, W), mode)
        self.last_report = report
        comm, r, n = self.comm, self.comm.rank, self.comm.world_size
        z = z.to(self.vae.dtype)
        if mode in ("replicated", "chunked"):
            pieces = decoder_pieces(t, self.chunk if mode == "chunked" else None)
            return self.vae.run_decoder(z, Exec(carry={} if len(pieces) > 1 else None), pieces)
        if mode == "time":
            tl = TimeLayout(t, n, self.cfg.temporal_factor)
            p, q = tl.latents[r]
            out = self.vae.decoder(z[:, :, p:q], Exec(comm, time_chain=True, image_fast_path=t == 1).begin(p))
            counts = [tl.frames(p_, q_)[1] - tl.frames(p_, q_)[0] for p_, q_ in tl.latents]
            return _gather(comm, out, 2, counts, "output_gather")
        if mode in SLAB_MODES:
            layout = SlabLayout.for_latent(t, h, w, n, self.cfg.spatial_factor, self.speeds)
            _, _, h0, h1 = layout.rank_rows(r)
            return self._decode_rows(z[:, :, :, h0:h1], layout, mode, gather=True)

        return tiled_decode(self.vae, z, self.tile, self.overlap, self.chunk)

    @torch.no_grad()
    def decode_slab(self, z_slab: torch.Tensor, layout: SlabLayout, chunked: bool = True,
                    gather: bool = True) -> torch.Tensor:
        """Decode from this rank's latent slab (rows ``layout.rank_rows(rank)``); every rank calls it.

        Returns the whole video on every rank, or with ``gather=False`` this rank's pixel rows
        ``[8 h0, 8 h1)``.
        """
        mode = "height+chunks" if chunked else "height"
        T, H, W = self.cfg.decoded_shape(layout.t, layout.h, layout.w)
        self.resolve("decode_slab", (T, H, W), mode)
        agree(self.comm, "vae.decode_slab layout", [layout.t, layout.h, layout.w, layout.world, layout.rows])
        _, _, h0, h1 = layout.rank_rows(self.comm.rank)
        if z_slab.shape[3] != h1 - h0:
            raise ValueError(f"rank {self.comm.rank} holds {z_slab.shape[3]} latent rows, layout says {h1 - h0}")
        return self._decode_rows(z_slab.to(self.vae.dtype), layout, mode, gather)

    @torch.no_grad()
    def decode_continued(self, z: torch.Tensor, start: int, carry: dict | None, mode: str,
                         layout: SlabLayout | None = None, last: bool = False) -> tuple[torch.Tensor, dict]:
        """Latent frames ``[start, start + t)`` of one long clip whose earlier frames earlier calls decoded:
        (their video, the causal state to continue from). ``carry`` is the state a previous call returned
        (None at ``start == 0``); it is never changed, so a failed call can be run again with it.

        Bitwise the decode of the whole latent at once in every exact mode (each conv's past frames are the
        carried ones). ``mode``: a slab mode decodes this rank's rows (``z`` holds the rows
        ``layout.rank_rows(rank)`` of a latent with ``layout``'s rows and width) and returns its pixel rows;
        the others decode whole frames on every rank in causal chunks (``time``'s split needs the whole
        clip's frames at once, so it runs as ``chunked`` here). ``tiled`` cannot continue: ValueError.
        ``last``: these are the clip's last frames (a clip of one latent frame then takes the image path,
        as a whole decode does).
        """
        if mode not in MODES:
            raise ValueError(f"unknown VAE mode {mode!r}; choose one of {MODES}")
        if mode == "tiled":
            raise ValueError("a continued decode needs an exact VAE mode: the tiled one cannot carry its state")
        if (start == 0) != (carry is None):
            raise ValueError("a continued decode starts at latent frame 0 without a state, later with one")
        t = z.shape[2]
        slab = mode in SLAB_MODES
        if slab and layout is None:
            raise ValueError(f"VAE mode {mode} decodes a slab: give its layout")
        h = layout.h if slab else z.shape[3]
        T, H, W = self.cfg.decoded_shape(t, h, z.shape[4])
        self.resolve("decode_continued", (T, H, W), mode)
        agree(self.comm, "vae.decode_continued", [start, t, carry is None, last] + ([layout.h, layout.w, layout.world]
                                                                          if slab else []))
        chunked = mode in ("chunked", "time", "height+chunks")
        if start == 0:
            pieces = decoder_pieces(t, self.chunk if chunked else None)
        else:
            pieces = time_pieces(t, self.chunk, self.chunk) if chunked else [(0, t)]
        ex = Exec(self.comm if slab else None, carry=dict(carry or {}), image_fast_path=last)
        z = z.to(self.vae.dtype)
        if slab:
            _, _, h0, h1 = layout.rank_rows(self.comm.rank)
            if z.shape[3] != h1 - h0:
                raise ValueError(f"rank {self.comm.rank} holds {z.shape[3]} latent rows, layout says {h1 - h0}")
        outs = [self.vae.decoder(z[:, :, a:b], ex.begin(start + a, layout.rows if slab else None,
                                                        layout.h if slab else None)) for a, b in pieces]
        return (outs[0] if len(outs) == 1 else torch.cat(outs, 2)), ex.carry

    def _decode_rows(self, z_local: torch.Tensor, layout: SlabLayout, mode: str, gather: bool) -> torch.Tensor:
        pieces = decoder_pieces(layout.t, self.chunk if mode == "height+chunks" else None)
        ex = Exec(self.comm, carry={} if len(pieces) > 1 else None)
        out = self.vae.run_decoder_rows(z_local, ex, pieces, layout.rows, layout.h)
        if not gather:
            return out
        s = self.cfg.spatial_factor
        return _gather(self.comm, out, 3, [s * (b - a) for a, b in layout.rows], "output_gather")
