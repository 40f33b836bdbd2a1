"""SeedVR2 restoration, file in, file out, under SP: the `ditsp upscale` job.

Every rank of the SP group runs :func:`rank_upscale` on the same request:

1. read the input as a stream (every rank decodes the same file, so no frames
   are broadcast), cut it into temporal windows of up to F = 4n+1 frames that
   share K frames (:mod:`.pipeline.windows`);
2. per window: area resize, crop to 16, ``2x - 1`` (:mod:`.pipeline.transform`);
   pad to 4n+1 frames (never to a multiple of the SP degree, so the result does
   not depend on it); VAE encode on the group (:class:`.vae.sharded.ParallelVAE`),
   posterior sample x 0.9152 with noise from the window's seed; the 33-channel
   input ``[noise | LQ latent | 1]``; one DiT step at t = 1000 under
   window-aligned SP; ``x0 = noise - v``; cast, divide by 0.9152, decode on the
   group; drop the padded frames; colour fix against the window's input;
3. cross-fade overlapping windows (:class:`.pipeline.windows.StreamingBlender`)
   and, on rank 0, write finished frames as they come (atomic: a temporary file
   renamed at the end; the input's audio is copied).

Noise comes from CPU generators seeded per window, so every rank and every SP
degree sees the same values. Memory is bounded by one window, not the clip.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict

import torch

from ...cpu import malloc as cpu_malloc
from ...config import ParallelConfig
from ...distributed.comm import Comm
from ...distributed.transport import Transport
from ...distributed.heartbeat import beat
from ...fixed_shape import shapes_for
from ...fixed_shape import use as use_kernel_shapes
from .compiled import compile_dit, compile_vae, describe, stance
from ...memory import PeakMemory
from ...windows.ownership import RowOwnership
from .parallelize import parallelize
from .pipeline import (
    StreamingBlender,
    seam_metric_from_steps,
    apply_color_fix,
    decoder_latent,
    dit_input,
    dit_timestep,
    frame_geometry,
    make_generator,
    make_noise,
    one_step_x0,
    pad_frames,
    plan_windows,
    to_uint8,
    transform_frames,
)
from .pipeline.padding import padded_length
from .request import UpscaleRequest  # noqa: F401 - the request lives in .request; re-exported
from .vae.modes import AUTO, SLAB_MODES
from .weights import load

from .restore_report import STAGES, format_report, plot_report, summarize  # noqa: F401 - re-exported
from ...io.probe import open_media
from ...io.write import VideoWriter, write_image
from ...io.write_behind import WriteBehind
from .vae.sharded import ParallelVAE
from ...io.probe import frame_times
from ...io.probe import count_frames
GiB = 2**30
DEFAULT_FPS = 24


class _Frames:
    """The input as a stream: frames are decoded as windows need them and dropped once passed."""

    def __init__(self, chunks):
        self._chunks = chunks
        self._buf: torch.Tensor | None = None
        self._start = 0  # clip index of self._buf[0]

    def take(self, start: int, stop: int) -> torch.Tensor:
        if self._buf is not None and start > self._start:
            self._buf = self._buf[start - self._start :]
            self._start = start
        parts = [] if self._buf is None else [self._buf]
        have = self._start + sum(p.shape[0] for p in parts)
        while have < stop:  # decode what the window still needs; one concatenation, not one per chunk
            chunk = next(self._chunks, None)
            if chunk is None:
                raise ValueError(f"the input ended after {have} frames; {stop} were expected")
            parts.append(chunk)
            have += chunk.shape[0]
        if len(parts) > 1 or self._buf is None:
            self._buf = torch.cat(parts)
        return self._buf[start - self._start : stop - self._start]


class _Stages:
    """Per-stage wall and CPU time, per-rank peak memory and a timeline (for the report and its picture)."""

    def __init__(self, device: torch.device):
        self.time = dict.fromkeys(STAGES, 0.0)
        self.cpu = dict.fromkeys(STAGES, 0.0)
        self.peak = dict.fromkeys(STAGES, 0)
        self.timeline: list[tuple[str, int, float, float]] = []
        self.mem = PeakMemory(device, settle=False)  # per stage: no collection between the stages of a job
        self.device = device
        self.t0 = time.perf_counter()

    def run(self, stage: str, window: int, fn, *args):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.mem.start()
        a, cpu = time.perf_counter(), time.process_time()
        out = fn(*args)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        b = time.perf_counter()
        beat()  # a stage ended: the launcher's stuck-rank check sees progress
        self.time[stage] += b - a
        self.cpu[stage] += time.process_time() - cpu
        self.peak[stage] = max(self.peak[stage], self.mem.peak_added())
        self.timeline.append((stage, window, a - self.t0, b - self.t0))
        return out

    def record(self, stage: str, window: int, start: float, end: float, cpu: float) -> None:
        """A stage another thread ran (``start``/``end`` from ``time.perf_counter``): time and timeline only."""
        self.time[stage] += end - start
        self.cpu[stage] += cpu
        self.timeline.append((stage, window, start - self.t0, end - self.t0))


def _geometry(req: UpscaleRequest, width: int, height: int):
    return frame_geometry(width, height, area=req.area, size=req.size)


def _transform(req: UpscaleRequest, frames: torch.Tensor) -> torch.Tensor:
    if req.size is not None:
        w, h = req.size
        return transform_frames(frames, size=(h, w))
    if req.area is not None:
        w, h = req.area
        return transform_frames(frames, h, w)
    return transform_frames(frames)


@torch.no_grad()
def rank_upscale(ctx, req: UpscaleRequest) -> dict:
    """One rank's share of a restoration; rank 0 writes the output and returns the full report."""
    with use_kernel_shapes(shapes_for(req.deterministic)), stance(req.compile):  # the VAE's calls; the DiT's
        report = _rank_upscale(ctx, req)                                      # come from its runtime
    report["kernel_shapes"] = shapes_for(req.deterministic).describe()
    report["cpu_allocator"] = cpu_malloc.describe()  # this rank's process: the policy, and whether it is in effect
    if req.compile:  # the models stay compiled in this process's cache: a server's next job reuses them
        models = load(req.weights, ctx.device)
        report["compile"] = describe(models.dit, models.vae)
    else:
        report["compile"] = "eager"
    return report


def _rank_upscale(ctx, req: UpscaleRequest) -> dict:
    from tqdm import tqdm  # local: read when the job runs (serve/workers.py swaps in its progress reporter first)

    entered = time.time()  # wall clock: the job's launcher compares it with its own start
    group = ctx.group if ctx.world_size > 1 else None
    device = ctx.device
    # The job's one Comm of the group: the weights' load, the VAE, every DiT runtime and the writer's rows.
    comm = Comm.of(group)
    models = load(req.weights, device, comm=comm)  # a bad checkpoint: the same error on every rank
    loaded = time.time()
    comm.stats.reset()  # the report counts the restoration's traffic, not the weights' load
    if req.compile:
        compile_dit(models.dit)
        compile_vae(models.vae)
    vae = models.vae
    info, chunks = open_media(req.input)
    frames_total = info.frames
    if frames_total is None:
        frames_total = count_frames(req.input)
    geo = _geometry(req, info.width, info.height)
    window = req.window_frames or padded_length(frames_total)
    plan = plan_windows(frames_total, window, min(req.overlap, window - 1), req.seed)
    budget = int(req.budget_gib * GiB) if req.budget_gib else None
    pvae = ParallelVAE(vae, comm, chunk=req.vae_chunk, budget_bytes=budget)
    runtimes: dict = {}
    st = _Stages(device)
    blender = StreamingBlender(plan, out_dtype=torch.float32)
    writer = None
    is_image = info.kind == "image"
    rank0 = ctx.rank == 0
    digest = hashlib.sha256()
    steps: list[float] = []  # mean |frame[k+1] - frame[k]| of the written frames, for the seam measure
    last_frame = None
    written = 0
    samples_in, samples_out = [], []
    vae_reports, dit_report = set(), ""
    media_notes = [f"rotation {info.rotation} degrees (display matrix) applied to the frames"] if info.rotation else []
    frames = _Frames(chunks)
    bar = tqdm(total=len(plan) * 4, desc="upscale", unit="step", disable=not (rank0 and req.progress), leave=False)
    try:
        if rank0 and not is_image:
            fps = req.fps or info.rate or info.fps or DEFAULT_FPS
            times = _input_times(req, info, frames_total, media_notes)
            writer = WriteBehind(VideoWriter(req.output, fps, crf=req.crf, times=times,
                                             audio_from=req.input if info.has_audio else None,
                                             overwrite=req.overwrite))
        for win in plan:
            bar.set_postfix_str(f"window {win.index + 1}/{len(plan)} read+encode")
            u8 = st.run("read", win.index, frames.take, win.start, win.stop)
            x = _transform(req, u8)  # (3, T, h, w) fp32 in [-1, 1]: also the colour-fix reference
            n = x.shape[1]
            xp = pad_frames(x, dim=1)[None]  # (1, 3, 4n+1, h, w)
            g = make_generator(win.seed)

            # the step follows the mode auto will pick (a pure choice, no collective); the VAE is asked for
            # req.vae_mode itself, so its report says why
            mode = pvae.choose(tuple(xp.shape[2:])).mode if req.vae_mode == AUTO else req.vae_mode
            step = _sharded_window if req.handoff and mode in SLAB_MODES and ctx.world_size > 1 else _whole_window
            decoded, dit_report = step(ctx, models, pvae, runtimes, req, st, win.index, xp, mode, g, vae_reports, bar)
            bar.update()
            if not rank0:
                _all_ok(comm)
                continue
            content = decoded[0, :, :n].permute(1, 0, 2, 3)  # (T, 3, H, W), padding dropped
            fixed = st.run("color_fix", win.index, apply_color_fix, content, x.permute(1, 0, 2, 3), req.color_fix)
            ready = blender.push(win.index, fixed.float())
            bar.update()
            if ready.shape[0]:
                out = to_uint8(ready)
                digest.update(out.numpy().tobytes())
                steps += _frame_steps(last_frame, out)
                last_frame = out[-1]
                if len(samples_out) < req.sample_frames:
                    k = min(req.sample_frames - len(samples_out), out.shape[0])
                    idx = torch.linspace(0, out.shape[0] - 1, k).round().long()
                    samples_out += [out[i] for i in idx]
                    src = to_uint8(x.permute(1, 0, 2, 3))
                    samples_in += [src[written - win.start + i] for i in idx]
                if is_image:
                    st.run("write", win.index, lambda: write_image(req.output, out[0], overwrite=req.overwrite))
                else:
                    writer.write(out, tag=win.index)  # encoded behind the next window (its own thread)
                written += out.shape[0]
            if writer is not None:
                writer.check()  # an earlier window's write error: raised here, before every rank's boundary
            _all_ok(comm)
        if rank0:
            blender.flush()
        if writer is not None:
            writer.finish()
            for index, start, end, cpu in writer.busy:
                st.record("write", index, start, end, cpu)
            st.timeline.sort(key=lambda entry: entry[2])
            st.run("write", len(plan), writer.writer.close)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        bar.close()
    report = {
        "rank": ctx.rank,
        "stage_s": st.time,
        "stage_cpu_s": st.cpu,
        "cpu_s": time.process_time(),  # the rank's whole process: start-up, weights, every stage
        "entered_at": entered, "load_s": loaded - entered, "done_at": time.time(),
        "stage_peak_bytes": st.peak,
        "bytes_sent": comm.stats.bytes_sent,
        "collectives": comm.stats.as_dict(),
    }
    if rank0:
        report.update({
            "input": req.input, "output": req.output, "request": asdict(req),
            "frames": frames_total, "frames_written": written, "fps": info.fps, "audio": info.has_audio,
            "written_behind": writer is not None,
            "geometry": geo.describe(), "output_size": [geo.out_width, geo.out_height],
            "windows": [[w.start, w.stop] for w in plan], "dit_path": dit_report, "media_notes": media_notes,
            "vae_modes": sorted(vae_reports), "sha256": digest.hexdigest(), "timeline": st.timeline,
            "seams": seam_metric_from_steps(steps, plan.seam_transitions()) if len(plan) > 1 and steps else None,
            "samples": (torch.stack(samples_in), torch.stack(samples_out)) if samples_out else None,
        })
    return report


def _input_times(req: UpscaleRequest, info, frames: int, notes: list[str]) -> list[float] | None:
    """The input's frame times when its frame rate varies (kept in the output), else None; says which."""
    if info.kind != "video":
        return None

    times = frame_times(req.input, info.rate)
    if times is None:
        return None
    if req.fps:
        notes.append(f"variable frame rate re-timed to the --fps {req.fps:g} asked for")
        return None
    if len(times) != frames:
        notes.append(f"variable frame rate: {len(times)} timestamps for {frames} frames, so re-timed to "
                     f"{float(info.rate or DEFAULT_FPS):g} fps")
        return None
    notes.append(f"variable frame rate: each frame's time kept ({len(times)} frames over {times[-1]:.3f} s)")
    return times


def _runtime(runtimes: dict, comm: Comm, dit, grid, planner: str | None, deterministic: bool):
    """The DiT's runtime of ``grid`` on the job's Comm (built once per grid)."""
    if grid not in runtimes:
        pc = ParallelConfig.window(comm.world_size, window_planner=planner, deterministic=deterministic)
        runtimes[grid] = parallelize(dit.cfg, pc, grid, comm)
    return runtimes[grid]


def _whole_window(ctx, models, pvae, runtimes, req, st, index, xp, mode, g, reports, bar):
    """Every rank holds the whole latent (replicated / chunked / time VAE modes): the DiT scatters and gathers."""
    dit, vae = models.dit, models.vae

    def encode():
        enc = pvae.encode(xp, req.vae_mode)
        eps = make_noise(enc.posterior.mean.shape, g, dtype=torch.float32)
        reports.add(enc.report)
        z = vae.to_latent(enc.posterior.sample(eps.to(enc.posterior.mean.dtype)))
        return vae.channels_last(z)[0]  # (t, h', w', 16)

    latent = st.run("vae_encode", index, encode)
    bar.update()
    noise = make_noise(latent.shape, g, dtype=torch.float32)
    vid = dit_input(noise, latent.float())
    rt = _runtime(runtimes, pvae.comm, dit, dit.grid_of(vid.shape), req.planner, req.deterministic)
    v = st.run("dit", index, lambda: dit(vid.to(dit.dtype), models.text, dit_timestep(ctx.device), runtime=rt))
    bar.update()
    z = decoder_latent(one_step_x0(noise, v), dtype=vae.dtype)
    z = z if z.dim() == 5 else z.unsqueeze(2)
    decoded = st.run("vae_decode", index, lambda: pvae.decode(z, req.vae_mode))
    reports.add(pvae.last_report)
    return decoded, rt.report(heads=dit.cfg.heads)


def _sharded_window(ctx, models, pvae, runtimes, req, st, index, xp, mode, g, reports, bar):
    """Height-sharded VAE: each rank's latent slab goes straight to the DiT's windows and back, then its
    decoded pixel rows go to rank 0 (the writer). The whole latent is never held by one rank."""
    dit, vae = models.dit, models.vae
    T, H, W = xp.shape[2:]
    t, h, w = vae.cfg.latent_shape(T, H, W)

    def encode():
        eps = make_noise((1, vae.cfg.latent_channels, t, h, w), g, dtype=torch.float32)  # canonical draw
        latent, enc = pvae.encode_latent(xp, req.vae_mode, noise=eps.to(vae.dtype), keep_sharded=True)
        reports.add(enc.report)
        return vae.channels_last(latent)[0], enc.layout  # (t, rows, w, 16)

    latent, layout = st.run("vae_encode", index, encode)
    bar.update()
    _, _, h0, h1 = layout.rank_rows(ctx.rank)
    noise = make_noise((t, h, w, vae.cfg.latent_channels), g, dtype=torch.float32)[:, h0:h1]
    slabs = RowOwnership.slabs((t, h, w), [layout.rank_rows(r) for r in range(ctx.world_size)], "VAE slabs")
    rows = dit_input(noise, latent.float()).reshape(-1, noise.shape[-1] * 2 + 1)
    rt = _runtime(runtimes, pvae.comm, dit, dit.grid_of((t, h, w)), req.planner, req.deterministic)
    v = st.run("dit", index, lambda: dit(rows.to(dit.dtype), models.text, dit_timestep(ctx.device), runtime=rt,
                                         rows=slabs))
    bar.update()
    x0 = one_step_x0(noise.reshape(-1, noise.shape[-1]), v).reshape(noise.shape)
    z = decoder_latent(x0, dtype=vae.dtype)
    z = z if z.dim() == 5 else z.unsqueeze(2)

    def decode():
        mine = pvae.decode_slab(z, layout, chunked=mode == "height+chunks", gather=False)  # (1, 3, T, rows, W)
        counts = [b - a for a, b in layout.pixel_rows(vae.cfg.spatial_factor)]
        return _rows_to_rank0(rt.transport, mine, counts)

    decoded = st.run("vae_decode", index, decode)
    reports.add(f"VAE decode mode {mode} (SP={ctx.world_size}, slabs handed from the DiT's windows)")
    return decoded, rt.report(heads=dit.cfg.heads)


def _rows_to_rank0(link: Transport, video: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
    """Every rank's pixel rows (dim 3) of ``video`` to rank 0 only: an all-to-all whose only target is
    rank 0, moved by the runtime's transport (agreed once per row counts and shape)."""
    if link.world_size == 1:
        return video
    rows = video.movedim(3, 0).contiguous()
    me, n = link.rank, link.world_size
    key = ("decode_to_writer", tuple(counts), tuple(rows.shape[1:]))
    got = link.all_to_all(rows, [rows.shape[0] if d == 0 else 0 for d in range(n)],
                          counts if me == 0 else [0] * n, "decode_to_writer", key=key)
    return got.movedim(0, 3) if me == 0 else None


def _frame_steps(last: torch.Tensor | None, frames: torch.Tensor) -> list[float]:
    """Mean absolute change of each step into ``frames`` (uint8), starting from the previous chunk's last frame."""
    x = frames.double() if last is None else torch.cat([last[None], frames]).double()
    if x.shape[0] < 2:  # a single image, or one frame so far
        return []
    return (x[1:] - x[:-1]).abs().reshape(x.shape[0] - 1, -1).mean(dim=1).tolist()


def _all_ok(comm: Comm) -> None:
    """A window boundary every rank passes together (rank 0's write errors surface on every rank)."""
    comm.all_gather_object(True)
