"""The kernel-shape policy (ditsp.fixed_shape): configuration, agreement, the doctor, the VAE's tiled convolutions."""

import argparse
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ditsp.config import ParallelConfig, ParallelConfigError
from ditsp.distributed.agree import DisagreementError
from ditsp.fixed_shape import (DEFAULT, DEFAULT_DETERMINISTIC, DETERMINISTIC, FAST, SERVE_DETERMINISTIC, KernelShapes,
                               conv_tile_rows, current, use)
from ditsp.models.seedvr2.nadit.config import TINY
from ditsp.models.seedvr2.parallelize import parallelize
from ditsp.models.seedvr2.vae.layers import conv3d

pytestmark = pytest.mark.timeout(240)


def test_the_default_is_one_value_read_everywhere():
    """Plain calls by default (the fixed shapes cost more than 10% end to end); the server alone defaults
    to fixed shapes (its re-run promise). Every default reads the one home, ditsp.fixed_shape."""
    from ditsp.commands.run import add_parser as run_parser
    from ditsp.commands.serve import add_parser as serve_parser
    from ditsp.commands.upscale import add_parser as upscale_parser
    from ditsp.models.seedvr2.job.forward import RunSpec
    from ditsp.models.seedvr2.job.request import Options, UpscaleRequest
    from ditsp.serve.app import Settings

    assert DEFAULT_DETERMINISTIC is False and SERVE_DETERMINISTIC is True and current() is DEFAULT is FAST
    assert ParallelConfig().deterministic is False and RunSpec("tiny", (1, 4, 4), 1).deterministic is False
    assert Options("a", "b").deterministic is False
    assert "deterministic" not in UpscaleRequest.__dataclass_fields__  # one value: the plan's, from the options
    assert Settings.__dataclass_fields__["deterministic"].default is True
    for make, want in ((run_parser, False), (upscale_parser, False), (serve_parser, True)):
        sub = make(argparse.ArgumentParser().add_subparsers())
        assert {a.dest: a.default for a in sub._actions}["deterministic"] is want, make


def test_config_takes_a_bool_only():
    assert ParallelConfig(deterministic=True).deterministic is True
    with pytest.raises(ParallelConfigError, match="deterministic must be True or False"):
        ParallelConfig(deterministic="yes")


def test_the_runtime_carries_the_policy_and_the_forward_enters_it():
    assert parallelize(TINY, None, (1, 4, 4)).kernel_shapes is FAST
    rt = parallelize(TINY, ParallelConfig(deterministic=True), (1, 4, 4))
    assert rt.kernel_shapes is DETERMINISTIC and current() is FAST  # nothing leaks into the process
    with use(DETERMINISTIC):
        assert current() is DETERMINISTIC
    assert current() is FAST


def _disagree(ctx):
    try:
        parallelize(TINY, ParallelConfig(ulysses_degree=2, deterministic=ctx.rank == 0), (1, 8, 8), ctx.group)
    except DisagreementError as e:
        return str(e)
    return None


def test_ranks_that_disagree_on_the_policy_raise_on_every_rank(clusters):
    for msg in clusters(2).run(_disagree):
        assert msg and "kernel-shape policy" in msg


@torch.no_grad()
@pytest.mark.parametrize("stride,padding,kernel", [((1, 1, 1), (0, 1, 1), (3, 3, 3)), ((2, 2, 2), (0, 0, 0), (3, 3, 3)),
                                                   ((1, 1, 1), (0, 0, 0), (1, 1, 1))])
def test_tiled_convolution_equals_one_call(stride, padding, kernel):
    """Every output pixel of the tiled path, incl. partial last tiles and strides, within fp32 rounding of one call."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, 7, 45, 13, generator=g)
    w = torch.randn(6, 8, *kernel, generator=g) * 0.1
    b = torch.randn(6, generator=g)
    ref = F.conv3d(x.double(), w.double(), b.double(), stride=stride, padding=padding)
    for shapes in (KernelShapes(conv_pixels=13 * 4), DETERMINISTIC, FAST):  # 4-row tiles, the default, one call
        with use(shapes):
            out = conv3d(x, w, b, stride, padding)
        assert out.shape == ref.shape and (out.double() - ref).abs().max() < 1e-5, shapes


def test_bf16_convolution_is_one_float32_sum_rounded_once():
    """bf16 convs: oneDNN's bf16 kernel where the CPU has one, else a float32 oneDNN call on the bf16
    values rounded once (never PyTorch's reference loop); either way within one bf16 rounding of fp64."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 4, 12, 10, generator=g).bfloat16()
    w = (torch.randn(8, 16, 3, 3, 3, generator=g) * 0.1).bfloat16()
    b = torch.randn(8, generator=g).bfloat16()
    ref = F.conv3d(x.double(), w.double(), b.double(), padding=(0, 1, 1))
    for shapes in (DETERMINISTIC, FAST):
        with use(shapes):
            out = conv3d(x, w, b, padding=(0, 1, 1))
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        assert ((out.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all(), shapes


def test_conv_tile_rows_follow_the_width_and_the_frame_height_only():
    d = DETERMINISTIC
    assert conv_tile_rows(256, shapes=d) == 32 and conv_tile_rows(1920, shapes=d) == 4
    assert conv_tile_rows(100000, shapes=d) == 1
    # spread over the whole frame: the last tile pads at most a few rows
    assert (conv_tile_rows(8, 8, d), conv_tile_rows(160, 90, d), conv_tile_rows(256, 33, d)) == (8, 30, 17)
    for width in (8, 64, 160, 1920):
        most = conv_tile_rows(width, shapes=d)
        for rows in range(1, 200):
            t = conv_tile_rows(width, rows, d)
            assert 1 <= t <= most and -(-rows // t) * t - rows < -(-rows // most)
    assert conv_tile_rows(256, shapes=FAST) is None and conv_tile_rows(256) is None  # the default: one call


@pytest.mark.bitwise
def test_doctor_says_whether_the_guarantee_holds_here():
    r = subprocess.run([sys.executable, "-m", "ditsp.cli", "doctor", "--model", "tiny", "--dtype", "fp32",
                        "--threads", "1", "--json"], capture_output=True, text=True, timeout=200)
    out = json.loads(r.stdout)
    assert {c["kind"] for c in out["checks"]} == {"gemm", "attention", "conv"}
    assert "CPU capability" in out["cpu"] and out["threads"] == 1
    assert r.returncode == (0 if out["holds"] else 1)
    assert out["holds"], out  # the premise of every bitwise test in this suite; if it fails, they fail too
    bad = subprocess.run([sys.executable, "-m", "ditsp.cli", "doctor", "--dtype", "fp64"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "choose from fp32, bf16" in bad.stderr


def test_upscale_check_verdict_follows_the_policy():
    """--check: equal bytes under --deterministic; under the fast policy frames within FAST_MIN_PSNR_DB."""
    from ditsp.commands.upscale import FAST_MIN_PSNR_DB, check_verdict

    near = {"same_frames": False, "max_abs_diff_decoded": 3, "psnr_vs_one_device": FAST_MIN_PSNR_DB + 10}
    far = dict(near, psnr_vs_one_device=FAST_MIN_PSNR_DB - 1)
    assert check_verdict(near, 2, deterministic=False) == "passed"
    assert check_verdict(near, 2, deterministic=True).startswith("failed: SP=2 frames differ")
    assert check_verdict(far, 2, deterministic=False).startswith("failed")
    assert check_verdict({"same_frames": True}, 3, deterministic=True) == "passed"
