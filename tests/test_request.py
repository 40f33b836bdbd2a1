"""The restoration request (ditsp/models/seedvr2/job/request.py): every list pinned to its owner, both front doors
offer exactly what it accepts, and every writable format works end to end."""

from __future__ import annotations

import argparse

import pytest

from ditsp.cli import main
from ditsp.commands import upscale as upscale_cmd
from ditsp.dtypes import DTYPES
from ditsp.io import formats
from ditsp.io.testclip import make_test_clip
from ditsp.io.probe import count_frames, probe
from ditsp.models.seedvr2 import presets
from ditsp.models.seedvr2.job import request
from ditsp.models.seedvr2.pipeline import color_fix, windows
from ditsp.models.seedvr2.vae import modes
from ditsp.weights.fp8 import WEIGHTS_DTYPES
from ditsp.windows import planners


def test_every_list_comes_from_its_owner():
    assert request.VAE_MODES == ("auto",) + modes.MODES
    assert request.COLOR_FIXES == color_fix.METHODS
    assert request.STITCHES == windows.STITCHES and request.default("stitch") in windows.STITCHES
    assert request.PLANNERS == tuple(planners.PLANNERS)
    assert request.DTYPE_NAMES == tuple(DTYPES)
    assert request.WEIGHTS_DTYPES == WEIGHTS_DTYPES
    assert set(request.MODELS) <= set(presets.MODELS)
    assert request.OUTPUT_FORMATS == tuple(e[1:] for e in formats.WRITE_VIDEO_EXTS + formats.WRITE_IMAGE_EXTS)


def _choices(parser: argparse.ArgumentParser) -> dict:
    return {a.dest: tuple(a.choices) for a in parser._actions if a.choices and not isinstance(a.choices, dict)}


def test_the_cli_offers_exactly_the_request_lists():
    p = upscale_cmd.add_parser(argparse.ArgumentParser().add_subparsers())
    assert _choices(p) == {"model": request.MODELS, "color_fix": request.COLOR_FIX_CHOICES, "vae_mode": request.VAE_MODES,
                           "stitch": request.STITCHES,
                           "dtype": request.DTYPE_NAMES, "weights_dtype": request.WEIGHTS_DTYPES,
                           "planner": request.PLANNERS, "weights_read": request.WEIGHTS_READS}


def test_the_server_offers_exactly_the_request_lists():
    from ditsp.serve.app import OPTIONS

    assert OPTIONS is request.HTTP_OPTIONS
    assert OPTIONS["format"][1] == request.OUTPUT_FORMATS and "mkv" in OPTIONS["format"][1]
    assert OPTIONS["vae_mode"][1] == request.VAE_MODES and OPTIONS["planner"][1] == request.PLANNERS
    assert OPTIONS["stitch"][1] == request.STITCHES and OPTIONS["color_fix"][1] == request.COLOR_FIX_CHOICES


def test_http_options_are_typed_and_named():
    assert request.parse_http_options({"scale": 2, "format": "m4v"}) == {"scale": 2.0, "format": "m4v"}
    for bad, msg in (({"nope": 1}, "unknown option"), ({"seed": "1"}, "seed must be int"),
                     ({"format": "avi"}, "format must be one of"), ({"scale": 2, "size": "64x64"}, "at most one")):
        with pytest.raises(ValueError, match=msg):
            request.parse_http_options(bad)


def test_one_dtype_default_rule():
    from ditsp.serve.app import Settings

    for model in presets.MODELS:
        want = presets.default_dtype(model)
        assert Settings(data_dir="x", model=model, random_weights=True).weights.dtype == want
    assert presets.default_dtype("seedvr2-3b") == "bf16" and presets.default_dtype("tiny") == "fp32"


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return str(make_test_clip(tmp_path_factory.mktemp("req") / "in.mp4", width=32, height=32, frames=5, fps=24))


@pytest.mark.parametrize("ext", formats.WRITE_VIDEO_EXTS)
def test_upscale_writes_every_offered_video_format(clip, tmp_path, capsys, ext):
    """`ditsp upscale in.mp4 -o out.EXT` for every extension the request offers: a real file, same frames."""
    out = tmp_path / f"out{ext}"
    rc = main(["upscale", "--model", "tiny-8x", "--random-weights", clip, "-o", str(out), "--resolution", "32x32", "--json", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    got = probe(out)
    assert (got.width, got.height, got.has_audio) == (32, 32, True) and count_frames(out) == 5


def test_server_job_options_check_like_the_cli(clip, tmp_path):
    from ditsp.serve.app import Settings, job_options

    for fmt in ("m4v", "mkv"):
        o = job_options(Settings(data_dir=str(tmp_path), model="tiny-8x", random_weights=True), clip,
                        str(tmp_path / f"r.{fmt}"),
                        request.parse_http_options({"format": fmt, "resolution": "32x32"}))
        c = request.check(o)
        assert c.req.output.endswith(fmt) and c.req.weights.dtype == "fp32" and not c.req.progress
    with pytest.raises(ValueError, match="needs an output ending in"):
        request.check(request.Options(input=clip, output=str(tmp_path / "r.png"), model="tiny-8x",
                                      random_weights=True))


def test_the_colour_fix_defaults_to_the_model_s_own(clip, tmp_path):
    """`--color-fix model` (the default) runs the preset's fix: none for the small restorer (its VAE is
    lossless), wavelet for the released ones; a named fix is run as asked."""
    assert request.default("color_fix") == "model" and presets.model("tiny").color_fix == "none"
    assert presets.model("seedvr2-3b").color_fix == "wavelet"
    for model, asked, runs in (("tiny", "model", "none"), ("tiny-8x", "model", "wavelet"), ("tiny", "lab", "lab")):
        o = request.Options(input=clip, output=str(tmp_path / "r.mp4"), model=model, random_weights=True,
                            color_fix=asked)
        assert request.check(o).req.color_fix == runs
    with pytest.raises(ValueError, match="--color-fix"):
        request.check(request.Options(input=clip, output=str(tmp_path / "r.mp4"), color_fix="sepia"))


def test_weights_read_travels_from_the_flag_to_the_weights_spec():
    """`--weights-read` (upscale, serve) lands on the WeightsSpec every rank loads from; the list is the loader's."""
    import argparse

    from ditsp.commands.serve import add_parser as serve_parser
    from ditsp.commands.upscale import add_parser as upscale_parser
    from ditsp.models.seedvr2.weights import WeightsSpec
    from ditsp.serve.app import Settings
    from ditsp.weights.shared import READS

    assert request.WEIGHTS_READS == READS
    for make in (upscale_parser, serve_parser):
        action = {a.dest: a for a in make(argparse.ArgumentParser().add_subparsers())._actions}["weights_read"]
        assert tuple(action.choices) == READS and action.default is None
    assert WeightsSpec(read="one-reader").read == "one-reader"
    with pytest.raises(ValueError, match="one-reader"):
        WeightsSpec(read="every-other-rank")
    assert Settings(data_dir="d", weights_read="one-reader").weights.read == "one-reader"
