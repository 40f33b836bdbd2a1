"""Block offload (``ditsp/weights/offload.py``, ``--offload-blocks N``): the first N blocks kept on
the host, each copied to the device before its turn (the next one started while the previous block
runs) and the copy dropped after it. On a CPU the device is the host; the mechanism runs the same
way, and the outputs are the same bits with and without it (float and quantized weights, SP 1/2)."""

from __future__ import annotations

import pytest
import torch

from ditsp.distributed.dispatch import dispatch
from ditsp.models.seedvr2.job.forward import RunSpec, rank_forward
from ditsp.models.seedvr2.nadit import TINY, NaDiT
from ditsp.models.seedvr2.nadit.model import build_model, init_random_, random_inputs
from ditsp.weights.convert import save_gguf
from ditsp.weights.gguf_write import q8_0
from ditsp.weights.offload import BlockOffload, offload_blocks
from ditsp.models.seedvr2.parallelize import single_runtime

pytestmark = pytest.mark.timeout(240)
GRID = (3, 8, 12)


def forward(model, deterministic: bool | None = None):
    from ditsp.fixed_shape import shapes_for

    vid, txt = random_inputs(TINY, GRID, seed=1)
    rt = single_runtime(model.cfg, model.grid_of(vid.shape))
    if deterministic is not None:
        rt.kernel_shapes = shapes_for(deterministic)
    with torch.no_grad():
        return model(vid, txt, 1000.0, runtime=rt)


@pytest.mark.parametrize("n", [1, 2, TINY.num_layers])
def test_offloaded_blocks_run_on_copies_and_give_the_same_bits(n, one_thread):
    ref = forward(init_random_(NaDiT(TINY), seed=3).eval())
    model = init_random_(NaDiT(TINY), seed=3).eval()
    off = offload_blocks(model, n, "cpu")
    host = {i: [t.data_ptr() for t in off.host[i]] for i in off.offloaded}
    seen = {}

    def probe(i):
        def hook(mod, args):
            seen[i] = mod.weight.data_ptr()
        return hook

    first_linear = [next(m for m in model.blocks[i].modules() if isinstance(m, torch.nn.Linear)) for i in range(n)]
    hooks = [m.register_forward_pre_hook(probe(i)) for i, m in enumerate(first_linear)]
    for _ in range(2):
        assert torch.equal(forward(model), ref)
    for h in hooks:
        h.remove()
    r = off.report()
    assert r["offloaded_blocks"] == n and r["fetches"] == 2 * n and r["exposed_fetches"] == 2  # block 0 only
    assert not off.live, "no device copy outlives its block"
    for i in off.offloaded:
        params = list(model.blocks[i].parameters())
        assert [t.data_ptr() for t in params] == host[i][: len(params)], "back on the host after the forward"
        assert seen[i] not in host[i], f"block {i} ran on its device copy"
    assert off.host_bytes == sum(t.numel() * t.element_size() for i in range(n)
                                 for t in [*model.blocks[i].parameters(), *model.blocks[i].buffers()])
    off.remove()
    assert torch.equal(forward(model), ref)


def test_quantized_blocks_offload_as_stored(tmp_path, one_thread):
    src = init_random_(NaDiT(TINY), seed=7).eval()
    sd = {(k[: -len(".rope.freqs")] + ".rope.rope.freqs" if k.endswith(".rope.freqs") else k): v
          for k, v in src.state_dict().items()}
    path = str(save_gguf(sd, tmp_path / "dit-Q8_0.gguf", q8_0))
    ref = forward(build_model(TINY, checkpoint=path))
    model = build_model(TINY, checkpoint=path)
    off = offload_blocks(model, 3)
    assert any(h.dtype == torch.uint8 for h in off.host[0]), "stored bytes travel, not dequantized weights"
    assert torch.equal(forward(model), ref)


def test_offload_checks_its_count():
    with pytest.raises(ValueError):
        BlockOffload(NaDiT(TINY).blocks, -1, "cpu")
    assert offload_blocks(NaDiT(TINY), 0) is None


def test_run_offload_blocks_under_sp2(clusters):
    a = dispatch(rank_forward, RunSpec(model="tiny", grid=GRID, sp=2, deterministic=True), sp=2, cluster=clusters(2))
    b = dispatch(rank_forward, RunSpec(model="tiny", grid=GRID, sp=2, deterministic=True, offload_blocks=2), sp=2,
                 cluster=clusters(2))
    assert torch.equal(a[0]["output"], b[0]["output"])
    assert all(r["offload"]["fetches"] == 2 for r in b) and a[0]["offload"] is None


def test_cli_offload_blocks(capsys):
    import json

    from ditsp.cli import main

    assert main(["run", "--model", "tiny", "--grid", "3,8,12", "--sp", "1", "--offload-blocks", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spec"]["offload_blocks"] == 2 and out["offload"]["fetches"] == 2
    with pytest.raises(SystemExit):
        main(["run", "--model", "tiny", "--grid", "3,8,12", "--sp", "1", "--offload-blocks", "99"])
    assert "--offload-blocks 99: the model has" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- native FP8 matmul


def test_native_fp8_matmul_is_guarded_and_close_to_the_dequantizing_path(one_thread):
    """``ditsp/weights/fp8_matmul.py``: off on a CPU (no claim without a device that has it); forced
    onto torch's CPU kernel, the same code is within the activations' FP8 rounding of the exact path."""
    from ditsp.weights.fp8_matmul import native_error, native_supported, scaled_linear, use_native_fp8

    assert not native_supported("cpu")
    model = build_model(TINY, weights_dtype="fp8", seed=5)
    ref = forward(model, deterministic=True)
    loose_ref = forward(model, deterministic=False)
    assert use_native_fp8(model) and torch.equal(forward(model, deterministic=False), loose_ref), \
        "unsupported device: the layers' own path"
    assert native_error(model) < 0.08
    plain = build_model(TINY, weights_dtype="fp8", seed=5)
    names = use_native_fp8(plain, force=True)
    assert "blocks.0.attn.proj_qkv.vid.weight" in names
    out = forward(plain, deterministic=False)  # the native path runs only under the plain kernel policy
    assert torch.equal(forward(plain, deterministic=True), ref)
    assert not torch.equal(out, loose_ref) and float((out - loose_ref).abs().max() / loose_ref.abs().max()) < 0.1
    raw = torch.randn(32, 64).to(torch.float8_e4m3fn).view(torch.uint8)
    x = torch.randn(3, 5, 64)
    y = scaled_linear(x, raw, (32, 64), 0.5)
    exact = x @ (raw.view(torch.float8_e4m3fn).float() * 0.5).t()
    assert y.shape == (3, 5, 32) and float((y - exact).abs().max() / exact.abs().max()) < 0.08
