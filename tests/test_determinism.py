"""The kernel-shape policy (ditsp.fixed_shape): configuration, agreement, the doctor, the VAE's tiled convolutions."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ditsp.config import ParallelConfig, ParallelConfigError
from ditsp.distributed.agree import DisagreementError
from ditsp.fixed_shape import DETERMINISTIC, FAST, KernelShapes, conv_tile_rows, current, use
from ditsp.models.seedvr2.nadit.config import TINY
from ditsp.models.seedvr2.parallelize import parallelize
from ditsp.models.seedvr2.vae.layers import conv3d

pytestmark = pytest.mark.timeout(240)


def test_config_takes_a_bool_only():
    assert ParallelConfig().deterministic is True
    with pytest.raises(ParallelConfigError, match="deterministic must be True or False"):
        ParallelConfig(deterministic="yes")


def test_the_runtime_carries_the_policy_and_the_forward_enters_it():
    assert parallelize(TINY, None, (1, 4, 4)).kernel_shapes is DETERMINISTIC
    rt = parallelize(TINY, ParallelConfig(deterministic=False), (1, 4, 4))
    assert rt.kernel_shapes is FAST and current() is DETERMINISTIC  # nothing leaks into the process
    with use(FAST):
        assert current() is FAST
    assert current() is DETERMINISTIC


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
    assert conv_tile_rows(256) == 32 and conv_tile_rows(1920) == 4 and conv_tile_rows(100000) == 1
    # spread over the whole frame: the last tile pads at most a few rows
    assert conv_tile_rows(8, 8) == 8 and conv_tile_rows(160, 90) == 30 and conv_tile_rows(256, 33) == 17
    for width in (8, 64, 160, 1920):
        for rows in range(1, 200):
            t = conv_tile_rows(width, rows)
            assert 1 <= t <= conv_tile_rows(width) and -(-rows // t) * t - rows < -(-rows // conv_tile_rows(width))
    with use(FAST):
        assert conv_tile_rows(256) is None


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
