"""ditsp.io: streaming video reads, atomic writes with audio, images, frame folders and clear errors."""

from __future__ import annotations

import os
from fractions import Fraction

import av
import numpy as np
import pytest
import torch
from PIL import Image

from ditsp.io import (
    MediaError,
    VideoReader,
    VideoWriter,
    available_encoders,
    count_frames,
    list_frames,
    media_kind,
    open_media,
    probe,
    read_frame_folder,
    read_image,
    read_video,
    video_encoder,
    write_image,
    write_video,
)
from ditsp.io.testclip import make_test_clip, scene_frames
from ditsp.models.seedvr2.pipeline.seams import seam_measure

W, H, T = 64, 48, 17


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return make_test_clip(tmp_path_factory.mktemp("clip") / "in.mp4", width=W, height=H, frames=T, fps=24)


@pytest.fixture(scope="module")
def pcm_clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("pcm") / "in.mkv"
    return make_test_clip(path, width=W, height=H, frames=9, fps=Fraction(30000, 1001), audio_codec="pcm_s16le")


def _leftovers(folder, keep=()):
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


def _audio_codec(path):
    with av.open(str(path)) as c:
        return c.streams.audio[0].codec_context.name if c.streams.audio else None


# ---------------------------------------------------------------- round trips


def test_encoders_present():
    enc = available_encoders()
    assert video_encoder() in ("libx264", "mpeg4")
    assert enc["aac"], "PyAV build without an AAC encoder"


def test_read_streams_in_chunks(clip):
    info = probe(clip)
    assert (info.width, info.height, info.frames, info.fps, info.has_audio) == (W, H, T, 24.0, True)
    with VideoReader(clip, chunk=5) as r:
        sizes = [c.shape[0] for c in r]
        assert r.info.audio_codec == "aac"
    assert sizes == [5, 5, 5, 2]
    assert count_frames(clip) == T
    frames = torch.cat(list(read_video(clip, chunk=8)))
    assert frames.dtype == torch.uint8 and frames.shape == (T, 3, H, W)
    # lossy but close to the synthetic scene
    assert (frames.float() - scene_frames(T, W, H).float()).abs().mean() < 6


def test_round_trip_keeps_frames_fps_size_audio(clip, tmp_path):
    info, chunks = open_media(clip, chunk=4)
    out = tmp_path / "out.mp4"
    with VideoWriter(out, info.rate, crf=12, audio_from=clip) as w:
        for c in chunks:
            w.write(c.permute(0, 2, 3, 1))  # THWC, as the pipeline's to_uint8 gives
    assert w.audio_mode == "copy"
    got = probe(out)
    assert (got.width, got.height, got.frames, got.rate, got.has_audio) == (W, H, T, Fraction(24), True)
    assert got.video_codec in ("h264", "mpeg4") and _audio_codec(out) == "aac"
    a = torch.cat(list(read_video(clip)))
    b = torch.cat(list(read_video(out)))
    assert (a.float() - b.float()).abs().mean() < 6
    assert _leftovers(tmp_path) == ["out.mp4"]


def test_audio_transcoded_when_mp4_cannot_carry_it(pcm_clip, tmp_path):
    info = probe(pcm_clip)
    assert info.audio_codec == "pcm_s16le" and info.rate == Fraction(30000, 1001)
    assert info.frames in (None, 9) and count_frames(pcm_clip) == 9  # mkv stores no frame count
    frames = torch.cat(list(read_video(pcm_clip)))
    out = write_video(tmp_path / "o.mp4", frames, info.rate, audio_from=pcm_clip)  # TCHW accepted too
    got = probe(out)
    assert got.frames == 9 and got.rate == Fraction(30000, 1001) and _audio_codec(out) == "aac"
    with av.open(str(out)) as c:
        a, v = c.streams.audio[0], c.streams.video[0]
        assert abs(float(a.duration * a.time_base) - float(v.duration * v.time_base)) < 0.05


@pytest.mark.parametrize("ext", [".mp4", ".m4v", ".mov", ".mkv"])
def test_every_writable_container_round_trips(clip, pcm_clip, tmp_path, ext):
    """Every extension ditsp.io.formats offers writes, reads back with the same frames count, size and rate,
    and carries the input's audio (copied where the container takes the codec, else AAC)."""
    from ditsp.io.formats import WRITE_VIDEO_EXTS, audio_copy_codecs

    assert ext in WRITE_VIDEO_EXTS
    for src, codec in ((clip, "aac"), (pcm_clip, "pcm_s16le")):
        info = probe(src)
        out = write_video(tmp_path / f"o-{codec}{ext}", torch.cat(list(read_video(src))), info.rate,
                          audio_from=src)
        got = probe(out)
        assert (got.width, got.height, got.rate) == (W, H, info.rate) and count_frames(out) == count_frames(src)
        want = codec if codec in audio_copy_codecs(ext) else "aac"
        assert got.has_audio and _audio_codec(out) == want
        a = torch.cat(list(read_video(src))).float()
        assert (a - torch.cat(list(read_video(out))).float()).abs().mean() < 6


def test_writable_video_list_is_the_one_in_formats():
    from ditsp.io import formats, write

    assert tuple(formats.VIDEO_CONTAINERS) == formats.WRITE_VIDEO_EXTS == write.WRITE_VIDEO_EXTS
    assert set(formats.WRITE_VIDEO_EXTS) <= set(formats.VIDEO_EXTS)  # what is written can be read back
    assert set(formats.WRITE_IMAGE_EXTS) <= set(formats.IMAGE_EXTS)


def test_mpeg4_fallback_and_no_audio(clip, tmp_path):
    frames = torch.cat(list(read_video(clip)))[:5]
    out = write_video(tmp_path / "m.mp4", frames, 12.5, codec="mpeg4")
    got = probe(out)
    assert got.video_codec == "mpeg4" and got.frames == 5 and not got.has_audio and got.fps == 12.5


# ---------------------------------------------------------------- images and folders


def test_images_round_trip_and_convert_to_rgb(tmp_path):
    rgb = (np.arange(20 * 24 * 3) % 251).astype(np.uint8).reshape(20, 24, 3)
    p = write_image(tmp_path / "a.png", torch.from_numpy(rgb))
    img = read_image(p)
    assert img.shape == (1, 3, 20, 24) and torch.equal(img[0].permute(1, 2, 0), torch.from_numpy(rgb))
    Image.fromarray(rgb[..., 0], "L").save(tmp_path / "g.png")
    Image.fromarray(np.dstack([rgb, rgb[..., :1]]), "RGBA").save(tmp_path / "r.webp", lossless=True)
    Image.fromarray(rgb).save(tmp_path / "j.jpg")
    for name in ("g.png", "r.webp", "j.jpg"):
        assert read_image(tmp_path / name).shape == (1, 3, 20, 24)
    info = probe(tmp_path / "a.png")
    assert info.kind == "image" and info.frames == 1 and info.size == (24, 20)


def test_frame_folder_natural_order(tmp_path):
    d = tmp_path / "frames"
    d.mkdir()
    for i in (1, 2, 10, 3):
        Image.fromarray(np.full((16, 20, 3), i, np.uint8)).save(d / f"f{i}.png")
    (d / "notes.txt").write_text("ignored")
    (d / ".hidden.png").write_bytes(b"ignored")
    assert [p.name for p in list_frames(d)] == ["f1.png", "f2.png", "f3.png", "f10.png"]
    chunks = list(read_frame_folder(d, chunk=3))
    assert [c.shape[0] for c in chunks] == [3, 1]
    assert torch.cat(chunks)[:, 0, 0, 0].tolist() == [1, 2, 3, 10]
    info, it = open_media(d)
    assert info.kind == "folder" and info.frames == 4 and len(torch.cat(list(it))) == 4
    Image.fromarray(np.zeros((18, 20, 3), np.uint8)).save(d / "f11.png")
    with pytest.raises(MediaError, match="first frame is 20x16"):
        list(read_frame_folder(d))


# ---------------------------------------------------------------- errors


def _one_line(exc):
    msg = str(exc.value)
    assert "\n" not in msg and msg
    return msg


def test_bad_inputs_raise_media_error(tmp_path):
    with pytest.raises(MediaError, match="no such file") as e:
        open_media(tmp_path / "missing.mp4")
    _one_line(e)
    (tmp_path / "junk.mp4").write_bytes(b"\x00not a video at all" * 50)
    with pytest.raises(MediaError, match="not a readable video|no video stream|no frames") as e:
        VideoReader(tmp_path / "junk.mp4")
    _one_line(e)
    (tmp_path / "junk.png").write_text("hello")
    with pytest.raises(MediaError, match="not a readable image") as e:
        read_image(tmp_path / "junk.png")
    _one_line(e)
    (tmp_path / "x.xyz").write_text("?")
    with pytest.raises(MediaError, match="unknown extension"):
        media_kind(tmp_path / "x.xyz")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MediaError, match="no image files"):
        open_media(tmp_path / "empty")
    Image.fromarray(np.zeros((8, 40, 3), np.uint8)).save(tmp_path / "tiny.png")
    with pytest.raises(MediaError, match="at least 16 px"):
        read_image(tmp_path / "tiny.png")


def test_zero_frames_and_small_video(tmp_path):
    with av.open(str(tmp_path / "empty.mkv"), "w") as c:  # a video stream with no frames
        s = c.add_stream("mpeg4", rate=24)
        s.width, s.height, s.pix_fmt = 32, 32, "yuv420p"
        c.start_encoding()
    with pytest.raises(MediaError, match="has no frames") as e:
        VideoReader(tmp_path / "empty.mkv")
    _one_line(e)
    with av.open(str(tmp_path / "audio_only.mkv"), "w") as c:
        c.add_stream("aac", rate=48000)
        c.start_encoding()
    with pytest.raises(MediaError, match="no video stream|has no frames"):
        VideoReader(tmp_path / "audio_only.mkv")
    write_video(tmp_path / "small.mp4", torch.zeros(3, 8, 12, 3, dtype=torch.uint8), 24)
    with pytest.raises(MediaError, match="8 px|at least 16") as e:
        probe(tmp_path / "small.mp4")
    assert "12x8" in _one_line(e)


def test_unwritable_destinations(tmp_path):
    frames = torch.zeros(2, 16, 16, 3, dtype=torch.uint8)
    with pytest.raises(MediaError, match="does not exist"):
        write_video(tmp_path / "nope" / "o.mp4", frames, 24)
    (tmp_path / "file").write_text("x")
    with pytest.raises(MediaError, match="not a folder"):
        write_video(tmp_path / "file" / "o.mp4", frames, 24)
    with pytest.raises(MediaError, match="unknown output extension"):
        write_video(tmp_path / "o.avi", frames, 24)
    with pytest.raises(MediaError, match="unknown output extension"):
        write_image(tmp_path / "o.gif", frames[0])
    with pytest.raises(MediaError, match="must be even"):
        write_video(tmp_path / "odd.mp4", torch.zeros(2, 17, 16, 3, dtype=torch.uint8), 24)
    assert _leftovers(tmp_path) == ["file"]


# ---------------------------------------------------------------- atomic writes


def test_failed_write_leaves_nothing(tmp_path, clip):
    out = tmp_path / "o.mp4"
    with pytest.raises(RuntimeError, match="boom"):
        with VideoWriter(out, 24, audio_from=clip) as w:
            w.write(torch.zeros(3, 16, 16, 3, dtype=torch.uint8))
            raise RuntimeError("boom")
    assert _leftovers(tmp_path) == []
    with pytest.raises(ValueError, match="uint8"):
        write_video(out, torch.zeros(2, 16, 16, 3), 24)
    with pytest.raises(ValueError, match="frame size changed"):
        write_video(out, [torch.zeros(2, 16, 16, 3, dtype=torch.uint8), torch.zeros(1, 32, 16, 3, dtype=torch.uint8)], 24)
    with pytest.raises(MediaError, match="no frames were written"):
        write_video(out, [], 24)
    assert _leftovers(tmp_path) == []


def test_refuses_to_overwrite_unless_asked(tmp_path):
    frames = torch.full((2, 16, 16, 3), 200, dtype=torch.uint8)
    out = tmp_path / "o.mp4"
    out.write_bytes(b"precious")
    with pytest.raises(MediaError, match="already exists"):
        write_video(out, frames, 24)
    assert out.read_bytes() == b"precious"
    write_video(out, frames, 24, overwrite=True)
    assert probe(out).frames == 2
    img = tmp_path / "i.png"
    write_image(img, frames[0])
    with pytest.raises(MediaError, match="already exists"):
        write_image(img, frames[1])
    write_image(img, torch.zeros(16, 16, 3, dtype=torch.uint8), overwrite=True)
    assert read_image(img).sum() == 0
    assert _leftovers(tmp_path) == ["i.png", "o.mp4"]


def test_seam_metric_on_the_test_clip():
    frames = scene_frames(12, 32, 32)
    assert torch.equal(frames, scene_frames(12, 32, 32))  # deterministic
    spliced = torch.cat([frames[:6], 255 - frames[6:]])  # a hard cut after frame 5
    m = seam_measure(spliced, [(6, 7)])
    assert m["ratio"] > 3 and m["each"][0]["frames"] == [5, 6]


def test_testclip_command(tmp_path):
    from ditsp.io.testclip import main

    assert main([str(tmp_path / "c.mp4"), "--size", "32x32", "--frames", "5", "--no-audio"]) == 0
    info = probe(tmp_path / "c.mp4")
    assert (info.width, info.height, info.frames, info.has_audio) == (32, 32, 5, False)
    with pytest.raises(SystemExit):
        main([str(tmp_path / "c.mp4")])  # exists


def test_windowed_identity_restoration_end_to_end(clip, tmp_path):
    """Read -> transform -> windows -> (identity instead of the model) -> colour fix -> blend -> write."""
    from ditsp.models.seedvr2.pipeline import (
        StreamingBlender,
        apply_color_fix,
        pad_frames,
        plan_windows,
        to_uint8,
        transform_frames,
    )

    info = probe(clip)
    plan = plan_windows(info.frames, window=9, overlap=3, seed=1)
    frames = torch.cat(list(read_video(clip)))  # a real run streams; the clip is tiny
    blender = StreamingBlender(plan)
    out = tmp_path / "restored.mp4"
    with VideoWriter(out, info.rate, audio_from=clip) as w:
        for win in plan:
            x = transform_frames(frames[win.start : win.stop], size=(64, 96))  # (3, t, 64, 96)
            padded = pad_frames(x)
            restored = padded[:, : win.length].permute(1, 0, 2, 3)  # the DiT/VAE would go here
            fixed = apply_color_fix(restored, x.permute(1, 0, 2, 3), "wavelet")
            ready = blender.push(win.index, fixed)
            if len(ready):
                w.write(to_uint8(ready))
    blender.flush()
    got = probe(out)
    assert (got.width, got.height, got.frames, got.has_audio) == (96, 64, T, True)
    m = seam_measure(torch.cat(list(read_video(out))), plan.seams())
    assert m["ratio"] < 2 and len(m["each"]) == len(plan) - 1


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can write anywhere")
def test_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(MediaError, match="not writable"):
            write_image(ro / "a.png", torch.zeros(16, 16, 3, dtype=torch.uint8))
    finally:
        ro.chmod(0o755)

