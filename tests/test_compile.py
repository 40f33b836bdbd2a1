"""`--compile`: compiled DiT blocks and VAE norms equal eager within tolerance at SP 1 and 2; refusals and
the eager fallback are explicit (the two compile tests take tens of seconds each: inductor on 2 cores)."""

from __future__ import annotations

import pytest
import torch

from ditsp.cli import main
from ditsp.models.seedvr2.job.forward import RunSpec, run
from ditsp.fixed_shape import FAST, use
from ditsp.models.seedvr2 import compiled
from ditsp.models.seedvr2.nadit.model import build_model, random_inputs
from ditsp.models.seedvr2.job.request import Options, check
from ditsp.models.seedvr2.parallelize import single_runtime

pytestmark = pytest.mark.timeout(300)

# fp32: compiled vs eager measured 1.2e-6 (DiT, 3B widths) and 4.4e-6 (VAE, released widths) relative to the output's scale
# (benchmarks/results/speed.md); the bound is the SP invariant's
REL_TOL = 1e-5


def test_compiled_dit_matches_eager_at_sp_1_and_2(clusters):
    """The compiled blocks' output vs the single-device eager forward (run --check), one device and SP=2."""
    for sp in (1, 2):
        spec = RunSpec(model="tiny", grid=(2, 8, 8), sp=sp, layers=2, deterministic=False, compile=True)
        s = run(spec, check=True, cluster=clusters(2) if sp == 2 else None)
        assert s["compile"].startswith("DiT blocks: compiled"), s["compile"]
        assert s["rel_err"] < REL_TOL, (sp, s["rel_err"])
        assert s["bytes_moved"] > 0 or sp == 1


def test_compiled_upscale_at_sp2_matches_eager(clusters, tmp_path):
    """A restoration at SP=2 with --compile (DiT blocks and VAE norms) writes the eager run's frames within
    one or two uint8 levels, and its report says it ran compiled."""
    from dataclasses import replace

    from ditsp.io.testclip import make_test_clip
    from ditsp.io.read import read_video
    from ditsp.models.seedvr2.job.restore import rank_upscale, summarize

    src = make_test_clip(str(tmp_path / "in.mp4"), width=32, height=32, frames=5, fps=10, audio=False)
    req = check(Options(input=str(src), output=str(tmp_path / "eager.mp4"), model="tiny-8x", random_weights=True,
                        resolution="32x32", progress=False, sp=2, deterministic=False, crf=0)).req
    eager = summarize(clusters(2).run(rank_upscale, req))
    comp = summarize(clusters(2).run(rank_upscale, replace(req, output=str(tmp_path / "comp.mp4"), compile=True)))
    assert eager["compile"] == "eager"
    assert "DiT blocks: compiled" in comp["compile"] and "VAE GroupNorm+SiLU: compiled" in comp["compile"]
    a, b = (torch.cat(list(read_video(str(tmp_path / name)))) for name in ("eager.mp4", "comp.mp4"))
    assert a.shape == b.shape
    assert (a.int() - b.int()).abs().max() <= 2


def test_compile_refuses_the_deterministic_policy(tmp_path, capsys):
    with pytest.raises(ValueError, match="--no-deterministic"):
        check(Options(input=str(tmp_path / "x.mp4"), output=str(tmp_path / "y.mp4"), compile=True,
                      deterministic=True))
    with pytest.raises(SystemExit) as e:
        main(["run", "--grid", "2,8,8", "--sp", "1", "--compile", "--deterministic"])
    assert e.value.code == 2
    assert "--no-deterministic" in capsys.readouterr().err


def _tiny():
    model = build_model("tiny", num_layers=2)
    grid = (2, 8, 8)
    vid, txt = random_inputs(model.cfg, grid, seed=1)
    rt = single_runtime(model.cfg, grid)
    rt.kernel_shapes = FAST
    return model, rt, vid, txt


def test_a_failed_compile_runs_eager_and_says_so(monkeypatch, capsys):
    """No C++ compiler (or any op inductor cannot lower): a warning, eager output, the report line says it."""
    model, rt, vid, txt = _tiny()
    with torch.no_grad():
        ref = model(vid, txt, 1000.0, runtime=rt)

    def no_compiler(fn, *a, **kw):
        def call(*args, **kwargs):
            raise torch._inductor.exc.CppCompileError(["g++"], "g++: command not found")
        return call

    monkeypatch.setattr(torch, "compile", no_compiler)
    compiled.compile_dit(model)
    with torch.no_grad():
        out = model(vid, txt, 1000.0, runtime=rt)
    assert torch.equal(out, ref)
    line = compiled.describe(model)
    assert "eager (compile failed: CppCompileError" in line, line
    assert "warning: compile of the DiT blocks failed" in capsys.readouterr().err


def test_a_request_without_compile_runs_a_compiled_model_eager():
    """The server's model cache may hold compiled models; a request without --compile runs the original
    eager code (the same bits as a model never compiled), and nothing is compiled."""
    model, rt, vid, txt = _tiny()
    with torch.no_grad():
        ref = model(vid, txt, 1000.0, runtime=rt)
    compiled.compile_dit(model)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad(), compiled.stance(False):
        out = model(vid, txt, 1000.0, runtime=rt)
    assert torch.equal(out, ref)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    with use(FAST), compiled.stance(False):
        assert compiled.fused_norm(torch.nn.GroupNorm(2, 4)) is None


_ONE_COMPILE = """
import torch, torch.nn.functional as F
from ditsp.models.seedvr2.compiled import kernel_set_cache
kernel_set_cache()
torch.manual_seed(0)
x, w = torch.randn(300, 256), torch.randn(256)
def f(x, w):
    return F.silu(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w) * 2 + 1
print((torch.compile(f, dynamic=True)(x, w) - f(x, w)).abs().max().item())
"""


def test_each_kernel_set_compiles_into_its_own_cache(tmp_path):
    """Inductor's cache key misses the ATen kernel set: a second kernel set on the same machine must not
    reuse the first one's compiled kernels (on an AVX-512 CPU an AVX2 run computed this 14 off)."""
    import os
    import subprocess
    import sys

    import torch

    other = "avx2" if torch.backends.cpu.get_cpu_capability() != "AVX2" else "default"
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["TMPDIR"] = str(tmp_path)  # the default cache folder lives under it
    for kernels in (None, other):
        run_env = dict(env, **({"ATEN_CPU_CAPABILITY": kernels} if kernels else {}))
        out = subprocess.run([sys.executable, "-c", _ONE_COMPILE], env=run_env, capture_output=True, text=True,
                             timeout=240)
        assert out.returncode == 0, out.stderr[-2000:]
        assert float(out.stdout.strip().splitlines()[-1]) < 1e-4, (kernels, out.stdout)
    assert len([d for d in os.listdir(tmp_path / f"torchinductor_{os.environ.get('USER', 'root')}")
                if d.startswith("ditsp-")]) == 2
