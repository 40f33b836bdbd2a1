"""SeedVR2 restoration, file in, file out, under SP: the `ditsp upscale` job.

Every rank of the SP group runs :func:`rank_upscale` on the same request:

1. read the input as a stream (every rank decodes the same file, so no frames
   are broadcast), in the temporal windows of the request's plan
   (:mod:`.plan`: windows of up to F = kn+1 frames sharing K frames, k the VAE's
   time factor);
2. per window: resize, crop (:mod:`..pipeline.transform`) to the plan's
   geometry, ``2x - 1``; pad to the plan's kn+1 frames (never to a multiple of
   the SP degree, so the result does not depend on it); VAE encode on the group
   in the plan's mode (:class:`..vae.sharded.ParallelVAE`), posterior sample x
   the VAE's scaling factor with noise from the window's seed; the DiT's input
   ``[noise | LQ latent | 1]``; one DiT step at t = 1000 under window-aligned
   SP; ``x0 = noise - v``; unscale, decode on the group (:class:`.stitch.WindowDecoder`: the window alone,
   or the latent stitch's final frames of the clip's one latent timeline); drop the padded frames;
   colour fix against the window's input;
3. cross-fade overlapping windows (:class:`.pipeline.windows.StreamingBlender`; the latent stitch needs
   none) and, on rank 0, measure the seams and the colour drift (:mod:`..pipeline.seams`,
   :mod:`..pipeline.color_drift`) and write finished frames as they come (atomic: a temporary file
   renamed at the end; the input's audio is copied).

A window's encode, DiT and decode run as one attempt on the job's own group
(:class:`ditsp.distributed.recoverable.RecoverableGroup`): an allocation failure on any rank is known to
every rank at once, memory is released, and the window runs again under the next leaner plan
(:mod:`.recovery`: a leaner exact VAE mode, then tiled, then windows of fewer frames with the clip
restarted), each step in the report; when none is left, every rank raises one line naming what would fit.

A request whose input is held in memory (``req.frames``: a host such as the
ComfyUI nodes) reads those frames in place of the file and writes nothing:
rank 0 returns the restored frames in its report. The plan and every step
between reading and writing are the same, so are the frames.

Noise comes from CPU generators seeded per window, so every rank and every SP
degree sees the same values. Memory is bounded by one window, not the clip.
The kernel policy (``plan.deterministic``) is read once, here: the VAE's calls
run under it and the DiT's runtime is built with it.

Progress: rank 0 calls ``progress(done, total, label)`` as the job advances
(four steps a window); without a callback a terminal bar is drawn when the
request asks for one.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import time
from dataclasses import asdict, replace
from typing import Callable

import torch

from ....cpu import malloc as cpu_malloc
from ....config import ParallelConfig
from ....distributed.comm import Comm
from ....distributed.recoverable import RecoverableGroup
from ....distributed.transport import Transport
from ....distributed.heartbeat import beat
from ....fixed_shape import shapes_for
from ....fixed_shape import use as use_kernel_shapes
from ..compiled import compile_dit, compile_vae, describe, stance
from ....memory import PeakMemory
from ....windows.ownership import RowOwnership
from ..parallelize import parallelize
from ..pipeline import (
    PIXEL_STITCHES,
    SeamMeter,
    StreamingBlender,
    apply_color_fix,
    decoder_latent,
    dit_input,
    dit_timestep,
    make_generator,
    make_noise,
    one_step_x0,
    pad_frames,
    to_uint8,
    transform_frames,
)
from ..pipeline.color_drift import ColorDrift
from .stitch import WindowDecoder
from .request import UpscaleRequest, frames_info  # noqa: F401 - the request lives in .request; re-exported
from ..vae.modes import BY_NAME, SLAB_MODES
from ..weights import load

from .recovery import Injector, Recovery, Restart, faults_from_env
from .report import STAGES, format_report, plot_report, summarize  # noqa: F401 - re-exported
from ....io.probe import open_media
from ....io.write import VideoWriter, write_image
from ....io.write_behind import WriteBehind
from ..vae.sharded import ParallelVAE
from ....io.probe import frame_times
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
    """Per-stage wall and CPU time, per-rank peak memory and a timeline (for the report and its picture); the
    stage running now (what an allocation failure is reported in), and the failures tests inject into it
    (``faults(stage, window)``: a context manager, :meth:`.recovery.Injector.stage`)."""

    def __init__(self, device: torch.device, faults=None):
        self.faults = faults or (lambda stage, window: contextlib.nullcontext())
        self.current = ""
        self.time = dict.fromkeys(STAGES, 0.0)
        self.cpu = dict.fromkeys(STAGES, 0.0)
        self.peak = dict.fromkeys(STAGES, 0)
        self.timeline: list[tuple[str, int, float, float]] = []
        self.mem = PeakMemory(device, settle=False)  # per stage: no collection between the stages of a job
        self.device = device
        self.t0 = time.perf_counter()

    def run(self, stage: str, window: int, fn, *args):
        self.current = stage
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.mem.start()
        a, cpu = time.perf_counter(), time.process_time()
        with self.faults(stage, window):
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


Progress = Callable[[int, int, str], None]


class _TerminalBar:
    """The terminal's progress bar (tqdm, on stderr) as a progress callback."""

    def __init__(self, total: int):
        from tqdm import tqdm  # local: only a terminal run draws one

        self.bar = tqdm(total=total, desc="upscale", unit="step", leave=False, file=sys.stderr, dynamic_ncols=True)

    def __call__(self, done: int, total: int, label: str) -> None:
        self.bar.n = done
        self.bar.set_postfix_str(label, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _transform(geo, frames: torch.Tensor) -> torch.Tensor:
    """uint8 frames -> the plan's geometry: resized to its size, cropped to its multiple, in [-1, 1]."""
    return transform_frames(frames, size=geo.resized_hw, multiple=geo.multiple)


@torch.no_grad()
def rank_upscale(ctx, req: UpscaleRequest, progress: Progress | None = None) -> dict:
    """One rank's share of a restoration; rank 0 writes the output and returns the full report.

    ``progress(done, total, label)``: called on rank 0 as the job advances (None: a terminal bar if the
    request asks for one)."""
    policy = shapes_for(req.plan.deterministic)  # the one read of the kernel policy: the VAE's calls run under
    # it, the DiT's runtime is built with it. The job's own group: a window that runs out of memory on any rank
    # is retried by every rank under a leaner plan (.recovery); tests inject the failures (recovery.FAULT_ENV).
    recovery = Recovery(req, ctx.device, Injector(faults_from_env(), ctx.rank))
    group = RecoverableGroup(ctx.group if ctx.world_size > 1 else None)
    try:
        with use_kernel_shapes(policy), stance(req.compile):
            while True:
                try:
                    report = _rank_upscale(ctx, req, policy.deterministic, progress, group, recovery)
                    break
                except Restart as r:  # windows of fewer frames: the clip again from its first frame
                    req = replace(req, plan=r.plan)
    finally:
        group.close()
    report["recovery"] = recovery.steps
    report["kernel_shapes"] = policy.describe()
    report["cpu_allocator"] = cpu_malloc.describe()  # this rank's process: the policy, and whether it is in effect
    if req.compile:  # the models stay compiled in this process's cache: a server's next job reuses them
        models = load(req.weights, ctx.device)
        report["compile"] = describe(models.dit, models.vae)
    else:
        report["compile"] = "eager"
    return report


def _check_plan(ctx, comm: Comm, plan) -> None:
    """The ranks run the plan they were given for their degree, and all the same one (a torchrun job's ranks
    each build it): a clear error on every rank otherwise."""
    if ctx.world_size != plan.sp:
        raise ValueError(f"the restoration was planned for SP={plan.sp} but runs on {ctx.world_size} ranks")
    if ctx.world_size > 1:
        prints = comm.all_gather_object(plan.fingerprint())
        if len(set(prints)) > 1:
            raise ValueError(f"the ranks planned different restorations (plan digests {', '.join(prints)}): "
                             f"give every rank the same input, options and --max-memory")


class _Progress:
    """Rank 0's progress: four steps a window, called back as they are done (a retried window's count again)."""

    def __init__(self, total: int, callback: Progress | None):
        self.done, self.total, self.callback = 0, total, callback

    def __call__(self, label: str) -> None:
        self.done += 1
        if self.callback is not None:
            self.callback(self.done, self.total, label)


class _Job:
    """What one rank's windows share: the models, the job's group, what is built on the group's current
    generation (the VAE's executor, the DiT's runtimes, the window decoder's VAE), the stages, the recovery."""

    def __init__(self, ctx, req: UpscaleRequest, models, group: RecoverableGroup, recovery: Recovery, st: _Stages,
                 deterministic: bool):
        self.ctx, self.req, self.models, self.group, self.recovery = ctx, req, models, group, recovery
        self.st, self.deterministic = st, deterministic
        self._generation = None
        self.parts()
        self.decoder = WindowDecoder(self.pvae, req.plan.windows)

    def parts(self) -> tuple[ParallelVAE, dict]:
        """The VAE's executor and the DiT's runtimes (per grid) on the group's current generation."""
        if self._generation != self.group.generation:
            plan = self.req.plan  # the slabs cut by speed where the ranks are unequal
            self.pvae = ParallelVAE(self.models.vae, self.group.comm, chunk=plan.vae_chunk, speeds=plan.vae_speeds)
            self.runtimes: dict = {}
            if self._generation is not None:
                self.decoder.pvae = self.pvae
            self._generation = self.group.generation
        return self.pvae, self.runtimes


def _window(job: _Job, plan, i: int, xp: torch.Tensor, progress: _Progress, of: str):
    """Window ``i``'s VAE encode, DiT and VAE decode, one attempt on the job's group; after an allocation failure
    on any rank, again under the leaner plan :meth:`.recovery.Recovery.next_plan` gives (or its Restart, or its
    MemoryError). Returns the step's (decoded, clip frame of the first, DiT report) and the plan it ran under."""
    ctx = job.ctx
    while True:
        win = plan.steps[i]
        handed = job.req.handoff and win.vae_mode in SLAB_MODES and ctx.world_size > 1
        step = _sharded_window if handed else _whole_window
        pvae, runtimes = job.parts()
        g = make_generator(win.seed)
        done, started = progress.done, time.perf_counter()
        attempt = job.group.attempt(
            lambda comm: step(ctx, job.models, pvae, runtimes, plan, job.deterministic, job.st, win, xp, g,
                              lambda stage: progress(f"{of} {stage}"), job.decoder),
            lambda e: job.recovery.record(e, ctx.rank, job.st.current))
        if not attempt.failed:
            return attempt.result, plan
        progress.done = done
        plan = job.recovery.next_plan(plan, i, attempt.failures, time.perf_counter() - started)


def _rank_upscale(ctx, req: UpscaleRequest, deterministic: bool, progress: Progress | None,
                  group: RecoverableGroup, recovery: Recovery) -> dict:
    entered = time.time()  # wall clock: the job's launcher compares it with its own start
    device = ctx.device
    plan = req.plan
    # The job's group: the weights' load, the VAE, every DiT runtime and the writer's rows go through its Comm.
    _check_plan(ctx, group.comm, plan)
    models = load(req.weights, device, comm=group.comm)  # a bad checkpoint: the same error on every rank
    loaded = time.time()
    group.stats.reset()  # the report counts the restoration's traffic, not the weights' load
    if req.compile:
        compile_dit(models.dit)
        compile_vae(models.vae)
    vae = models.vae
    info, chunks = _source(req)
    geo, windows = plan.geometry, plan.windows
    frames_total = plan.frames
    if (info.width, info.height) != (geo.in_width, geo.in_height):
        raise ValueError(f"{req.input}: is {info.width}x{info.height} now, planned as {geo.in_width}x{geo.in_height}")
    st = _Stages(device, lambda stage, window: recovery.injector.stage(stage, window, models))
    job = _Job(ctx, req, models, group, recovery, st, deterministic)
    blender = StreamingBlender(windows, out_dtype=torch.float32) if windows.stitch in PIXEL_STITCHES else None
    writer = None
    kept: list[torch.Tensor] | None = [] if req.frames is not None else None  # the in-memory output (rank 0)
    is_image = info.kind == "image"
    rank0 = ctx.rank == 0
    digest = hashlib.sha256()
    seams = SeamMeter(windows.seams())  # measured on the written frames as they go
    drift = ColorDrift()  # against the input's upscale, per window
    written = 0
    samples_in, samples_out = [], []
    vae_reports, dit_report = set(), ""
    media_notes = [f"rotation {info.rotation} degrees (display matrix) applied to the frames"] if info.rotation else []
    frames = _Frames(chunks)
    total = len(plan.steps) * 4
    bar = None
    if rank0 and progress is None and req.progress:
        bar = progress = _TerminalBar(total)
    advance = _Progress(total, progress if rank0 else None)

    try:
        if rank0 and not is_image and kept is None:
            fps = req.fps or info.rate or info.fps or DEFAULT_FPS
            times = _input_times(req, info, frames_total, media_notes)
            writer = WriteBehind(VideoWriter(req.output, fps, crf=req.crf, times=times,
                                             audio_from=req.input if info.has_audio else None,
                                             overwrite=req.overwrite))
        for i in range(len(plan.steps)):  # (a window that ran out of memory changes the plan from it on)
            win = plan.steps[i]
            of = f"window {win.index + 1}/{len(plan.steps)}"
            u8 = st.run("read", win.index, frames.take, win.start, win.stop)
            x = _transform(geo, u8).to(device)  # (3, T, h, w) fp32 in [-1, 1]: also the colour-fix reference
            n = x.shape[1]
            xp = pad_frames(x, vae.cfg.temporal_factor, dim=1)[None]  # (1, 3, kn+1, h, w)
            if tuple(xp.shape[2:]) != (win.padded, *geo.out_hw):
                raise RuntimeError(f"{of}: {tuple(xp.shape[2:])} frames/rows/columns, planned "
                                   f"{(win.padded, *geo.out_hw)}")
            (decoded, first, dit_report), plan = _window(job, plan, i, xp, advance, of)
            win = plan.steps[i]
            handed = req.handoff and win.vae_mode in SLAB_MODES and ctx.world_size > 1
            via = "; slabs handed to and from the DiT's windows" if handed else ""
            vae_reports.update(f"VAE {op} mode {win.vae_mode} (SP={ctx.world_size}, {win.vae_reason}{via})"
                               for op in ("encode", "decode"))
            advance(f"{of} decoded")
            if not rank0:
                _all_ok(group.comm)
                continue
            a = first - win.start  # the decoded frames are the window's [a, a + count): the padding dropped
            count = min(decoded.shape[2], n - a)
            content = decoded[0, :, :count].permute(1, 0, 2, 3)  # (T, 3, H, W)
            fixed = st.run("color_fix", win.index, apply_color_fix, content, x[:, a:a + count].permute(1, 0, 2, 3),
                           req.color_fix)
            ready = fixed.float() if blender is None else blender.push(win.index, fixed.float())
            advance(f"{of} colour fixed")
            if ready.shape[0]:
                out = to_uint8(ready).cpu()
                digest.update(out.numpy().tobytes())
                at = written - win.start  # the input's upscale of the same frames: the colour drift's reference
                src = to_uint8(x[:, at:at + out.shape[0]].permute(1, 0, 2, 3)).cpu()
                seams.add(out)
                drift.add(win.index, out, src)
                if len(samples_out) < req.sample_frames:
                    k = min(req.sample_frames - len(samples_out), out.shape[0])
                    idx = torch.linspace(0, out.shape[0] - 1, k).round().long()
                    samples_out += [out[i] for i in idx]
                    samples_in += [src[i] for i in idx]
                if kept is not None:
                    kept.append(out)
                elif is_image:
                    st.run("write", win.index, lambda: write_image(req.output, out[0], overwrite=req.overwrite))
                else:
                    writer.write(out, tag=win.index)  # encoded behind the next window (its own thread)
                written += out.shape[0]
            if writer is not None:
                writer.check()  # an earlier window's write error: raised here, before every rank's boundary
            _all_ok(group.comm)
        if rank0 and blender is not None:
            blender.flush()
        if writer is not None:
            writer.finish()
            for index, start, end, cpu in writer.busy:
                st.record("write", index, start, end, cpu)
            st.timeline.sort(key=lambda entry: entry[2])
            st.run("write", len(plan.steps), writer.writer.close)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    report = {
        "rank": ctx.rank,
        "stage_s": st.time,
        "stage_cpu_s": st.cpu,
        "cpu_s": time.process_time(),  # the rank's whole process: start-up, weights, every stage
        "entered_at": entered, "load_s": loaded - entered, "done_at": time.time(),
        "stage_peak_bytes": st.peak,
        "bytes_sent": group.stats.bytes_sent,
        "collectives": group.stats.as_dict(),
    }
    if rank0:
        report.update({
            "input": req.input, "output": req.output, "request": _request_record(req),
            "random_weights": req.weights.random, "plan": plan.describe(),
            "frames": frames_total, "frames_written": written, "fps": info.fps, "audio": info.has_audio,
            "written_behind": writer is not None,
            "geometry": geo.describe(), "output_size": [geo.out_width, geo.out_height],
            "windows": [[w.start, w.stop] for w in plan.steps], "dit_path": dit_report, "media_notes": media_notes,
            "vae_modes": sorted(vae_reports), "sha256": digest.hexdigest(), "timeline": st.timeline,
            "seams": seams.report(), "color_drift": drift.report(),
            "approximate": any(not BY_NAME[w.vae_mode].exact for w in plan.steps),
            "samples": (torch.stack(samples_in), torch.stack(samples_out)) if samples_out else None,
        })
        if kept is not None:
            report["output_frames"] = torch.cat(kept)  # uint8 (T, H, W, 3), what a file would have been given
    return report


def _source(req: UpscaleRequest):
    """The input's info and its frames as a stream of chunks: the request's frames in memory, else the file."""
    if req.frames is None:
        return open_media(req.input)
    return frames_info(req.input, req.frames), iter(req.frames.split(16))


def _request_record(req: UpscaleRequest) -> dict:
    """The request as the report keeps it: its settings and the plan's choices, as plain values."""
    d = {k: v for k, v in asdict(replace(req, frames=None)).items() if k not in ("plan", "frames")}
    p = req.plan
    d.update(sp=p.sp, deterministic=p.deterministic, planner=p.planner, vae_chunk=p.vae_chunk,
             window_frames=p.window_frames, overlap=p.windows.overlap, stitch=p.windows.stitch,
             seed=p.steps[0].seed if p.steps else None,
             output_size=[p.geometry.out_width, p.geometry.out_height])
    return d


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


def _runtime(runtimes: dict, comm: Comm, dit, grid, planner: str | None, deterministic: bool, shares=None):
    """The DiT's runtime of ``grid`` on the job's Comm (built once per grid; ``shares``: unequal ranks)."""
    if grid not in runtimes:
        pc = ParallelConfig.window(comm.world_size, window_planner=planner, deterministic=deterministic)
        runtimes[grid] = parallelize(dit.cfg, pc, grid, comm, shares)
    return runtimes[grid]


def _grid(dit, win, latent_shape) -> tuple[int, int, int]:
    """The window's token grid as planned (a disagreement with the model's patching is a bug, said so)."""
    grid = dit.grid_of(latent_shape)
    if grid != win.grid:
        raise RuntimeError(f"window {win.index + 1}: the DiT's grid {grid} is not the planned {win.grid}")
    return grid


def _whole_window(ctx, models, pvae, runtimes, plan, deterministic, st, win, xp, g, advance, decoder):
    """Every rank holds the whole latent (replicated / chunked / time VAE modes): the DiT scatters and gathers."""
    dit, vae = models.dit, models.vae

    def encode():
        enc = pvae.encode(xp, win.vae_mode)
        eps = make_noise(enc.posterior.mean.shape, g, dtype=torch.float32).to(enc.posterior.mean.device)
        z = vae.to_latent(enc.posterior.sample(eps.to(enc.posterior.mean.dtype)))
        return vae.channels_last(z)[0]  # (t, h', w', c)

    latent = st.run("vae_encode", win.index, encode)
    advance("encoded")
    noise = make_noise(latent.shape, g, dtype=torch.float32).to(latent.device)  # drawn on the CPU: any device
    vid = dit_input(noise, latent.float())
    rt = _runtime(runtimes, pvae.comm, dit, _grid(dit, win, vid.shape), plan.planner, deterministic, plan.dit_shares)
    v = st.run("dit", win.index, lambda: dit(vid.to(dit.dtype), models.text, dit_timestep(ctx.device), runtime=rt))
    advance("DiT done")
    z = decoder_latent(one_step_x0(noise, v), dtype=vae.dtype)
    z = z if z.dim() == 5 else z.unsqueeze(2)
    decoded, first = st.run("vae_decode", win.index, lambda: decoder.whole(win, z))
    return decoded, first, rt.report(heads=dit.cfg.heads)


def _sharded_window(ctx, models, pvae, runtimes, plan, deterministic, st, win, xp, g, advance, decoder):
    """Height-sharded VAE: each rank's latent slab goes straight to the DiT's windows and back, then its
    decoded pixel rows go to rank 0 (the writer). The whole latent is never held by one rank."""
    dit, vae = models.dit, models.vae
    t, h, w = win.latent
    mode = win.vae_mode

    def encode():
        eps = make_noise((1, vae.cfg.latent_channels, t, h, w), g, dtype=torch.float32).to(xp.device)  # canonical
        latent, enc = pvae.encode_latent(xp, mode, noise=eps.to(vae.dtype), keep_sharded=True)
        return vae.channels_last(latent)[0], enc.layout  # (t, rows, w, c)

    latent, layout = st.run("vae_encode", win.index, encode)
    advance("encoded")
    _, _, h0, h1 = layout.rank_rows(ctx.rank)
    noise = make_noise((t, h, w, vae.cfg.latent_channels), g, dtype=torch.float32)[:, h0:h1].to(latent.device)
    slabs = RowOwnership.slabs((t, h, w), [layout.rank_rows(r) for r in range(ctx.world_size)], "VAE slabs")
    rows = dit_input(noise, latent.float()).reshape(-1, noise.shape[-1] * 2 + 1)
    rt = _runtime(runtimes, pvae.comm, dit, _grid(dit, win, (t, h, w)), plan.planner, deterministic, plan.dit_shares)
    v = st.run("dit", win.index, lambda: dit(rows.to(dit.dtype), models.text, dit_timestep(ctx.device), runtime=rt,
                                             rows=slabs))
    advance("DiT done")
    x0 = one_step_x0(noise.reshape(-1, noise.shape[-1]), v).reshape(noise.shape)
    z = decoder_latent(x0, dtype=vae.dtype)
    z = z if z.dim() == 5 else z.unsqueeze(2)

    def decode():
        mine, first = decoder.slab(win, z, layout)  # (1, 3, T, rows, W)
        counts = [b - a for a, b in layout.pixel_rows(vae.cfg.spatial_factor)]
        return _rows_to_rank0(rt.transport, mine, counts), first

    decoded, first = st.run("vae_decode", win.index, decode)
    return decoded, first, rt.report(heads=dit.cfg.heads)


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


def _all_ok(comm: Comm) -> None:
    """A window boundary every rank passes together (rank 0's write errors surface on every rank)."""
    comm.all_gather_object(True)
