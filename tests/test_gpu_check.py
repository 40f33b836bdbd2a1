"""The GPU check (``make gpu-check``, benchmarks/gpu/) and the CUDA paths, without a GPU.

- The check's whole run at tiny sizes on this CPU, with the packages the GPU image lacks made
  unimportable: every step reaches an outcome, nothing fails, what needs CUDA says so.
- Its supervisor: a step past its budget is cut off (its process group killed) and recorded, a
  crashed child is recorded with its last words, and the report stays whole.
- The device paths, on the meta device standing in for an accelerator: a tensor made on the host
  and mixed with device tensors, a host read of a device value (``.item()``, a boolean mask) or a
  host-to-device copy inside the per-layer loop shows up here as it would on CUDA (an error, or a
  cross-device op counted by :class:`CrossDevice`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
DEV = torch.device("meta")  # the stand-in accelerator: no data, every op checked for devices and shapes


class CrossDevice(TorchDispatchMode):
    """Counts ops (while ``on``) that mix host tensors (0-dim scalars aside) with device tensors, or copy
    between them: each is a host-device transfer or a device mismatch on a real accelerator."""

    def __init__(self):
        super().__init__()
        self.on, self.hits = False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.on:
            flat, _ = tree_flatten((args, kwargs))
            devs = {t.device.type for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0}
            to = kwargs.get("device")
            if len(devs) > 1 or (to is not None and devs and torch.device(to).type not in devs):
                self.hits.append(f"{func} {sorted(devs)} -> {to}")
        return func(*args, **kwargs)


# -- the CUDA paths on a stand-in device ---------------------------------------------------------------


@pytest.mark.parametrize("model", ["tiny", "tiny-7b"])
@pytest.mark.parametrize("path", ["window", "halo", "ulysses"])
def test_dit_layers_move_nothing_between_host_and_device(model, path):
    """A warm forward's per-layer loop (every block and the layout changes between them) runs on the device
    alone: no host-made tensor, no host read, no copy either way, under both kernel policies. Before the
    fix the Ulysses baseline indexed device rows with a host index in every layer."""
    from ditsp.config import ParallelConfig
    from ditsp.models.meta import meta_device
    from ditsp.models.seedvr2.nadit.config import get_config
    from ditsp.models.seedvr2.nadit.model import NaDiT
    from ditsp.models.seedvr2.parallelize import parallelize

    cfg = get_config(model)
    with meta_device():
        dit = NaDiT(cfg)
    dit = dit.to(torch.bfloat16).eval().requires_grad_(False)
    vid = torch.empty(5, 6, 8, 33, device=DEV)  # grid (5, 3, 4): both layouts, several windows
    txt = torch.empty(cfg.txt_len, cfg.txt_in_dim, device=DEV)
    audit = CrossDevice()
    dit.blocks[0].register_forward_pre_hook(lambda *a: setattr(audit, "on", True))
    dit.blocks[-1].register_forward_hook(lambda *a: setattr(audit, "on", False))
    for deterministic in (False, True):
        rt = parallelize(cfg, ParallelConfig(window_path=path, deterministic=deterministic), (5, 3, 4))
        with audit:
            dit(vid, txt, 1000.0, runtime=rt)  # the first forward fills the runtime's caches (indices, packs)
            audit.hits.clear()
            y = dit(vid, txt, 1000.0, runtime=rt)
        assert y.device == DEV and y.shape == (5, 6, 8, 16)
        assert audit.hits == [], (deterministic, audit.hits[:5])


@pytest.mark.parametrize("name", ["reference", "cuda_flash", "cuda_efficient"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 0])
def test_attention_blocks_return_on_the_device(name, causal, kv_heads):
    """Each CUDA kernel's wrapper and the reference keep every result on the inputs' device with the documented
    shapes, GQA and causal included, and so does a rank holding no heads. Before the fix the reference's
    backward made its gradients on the host."""
    from ditsp.attention import kernels as K

    heads = 4 if kv_heads else 0
    q = torch.empty(2, heads, 37, 64, device=DEV, dtype=torch.bfloat16)  # 37 rows: the LSE padding path
    k = torch.empty(2, kv_heads, 37, 64, device=DEV, dtype=torch.bfloat16)
    audit = CrossDevice()
    with audit:
        audit.on = True
        out, lse = K.block_fwd(name, q, k, k, 0.125, causal)
        grads = K.block_bwd(name, q, k, k, out, lse, torch.empty_like(q), 0.125, causal=causal)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
    assert {t.device for t in (out, lse, *grads)} == {DEV}
    assert audit.hits == []


def test_kernel_table_says_when_a_fused_kernel_failed(monkeypatch, caplog):
    """A kernel of the table that takes the call but raises when probed is a fallback (flagged, warned once),
    not a silent success; a call no kernel takes is not."""
    from ditsp.attention import kernels as K

    def broken(*a, **k):
        raise RuntimeError("no kernel image is available for execution on the device")

    table = tuple(K.Kernel(k.name, k.device, k.dtypes, k.head_dim_ok, broken, broken) if k.name == "cuda_flash" else k
                  for k in K.TABLE)
    monkeypatch.setattr(K, "TABLE", table)
    monkeypatch.setattr(K, "KERNELS", {k.name: k for k in table})
    monkeypatch.setattr(K, "_CHOICES", {})
    monkeypatch.setattr(K, "_PROBED", {})
    monkeypatch.setattr(K, "_probe", lambda k, *a: None if k.name != "cuda_flash" else "cuda_flash failed on this "
                        "device: RuntimeError: no kernel image")
    c = K.choose("cuda", torch.bfloat16, 128)
    assert c.name == "cuda_efficient" and not c.fallback  # the next kernel of the table took it
    with caplog.at_level("WARNING", logger="ditsp.attention"):
        c = K.choose("cuda", torch.bfloat16, 128, "cuda_flash")
        K.choose("cuda", torch.bfloat16, 128, "cuda_flash")  # cached: warned once
    assert c.name == "reference" and c.fallback and "no kernel image" in c.reason
    assert sum("falls back" in r.message for r in caplog.records) == 1
    c = K.choose("cuda", torch.float64, 128)
    assert c.name == "reference" and not c.fallback  # nothing in the table takes fp64 on CUDA: not a fallback


def test_backend_field_default_and_environment(monkeypatch):
    """The backend field's default is documented (auto); the environment variable overrides the default, an
    explicit field value overrides both."""
    from ditsp.attention import Ulysses
    from ditsp.attention import kernels as K

    monkeypatch.delenv(K.ENV, raising=False)
    assert K.DEFAULT_BACKEND == "auto" and K.requested_default() == "auto"
    monkeypatch.setenv(K.ENV, " reference ")
    assert K.requested_default() == "reference"
    assert Ulysses(None).requested == "reference"
    assert Ulysses(None, backend="cpu_flash").requested == "cpu_flash"


def test_vae_exact_modes_run_on_the_device():
    """Encode and decode in every exact mode on one device keep to the device, and the posterior takes noise
    drawn on the host (the restoration draws on the CPU, the same bits on any device). Before the fix a
    host draw met the device mean and raised."""
    from ditsp.models.meta import meta_device
    from ditsp.models.seedvr2.vae import RELEASED
    from ditsp.models.seedvr2.vae.model import VideoVAE
    from ditsp.models.seedvr2.vae.modes import EXACT_MODES
    from ditsp.models.seedvr2.vae.sharded import ParallelVAE

    with meta_device():
        vae = VideoVAE(RELEASED.with_widths((8, 16, 16, 16), groups=4))
    vae = vae.to(torch.bfloat16).eval()
    x = torch.empty(1, 3, 5, 16, 24, device=DEV, dtype=torch.bfloat16)
    pv = ParallelVAE(vae)
    for mode in EXACT_MODES:
        m = pv.encode(x, mode=mode).posterior.mean
        d = pv.decode(m, mode=mode)
        assert m.device == d.device == DEV and d.shape == x.shape, mode
    z, _ = pv.encode_latent(x, "chunked", generator=torch.Generator().manual_seed(0))
    assert z.device == DEV and z.shape == m.shape


def test_packed_varlen_path_reads_nothing_back_from_the_device(monkeypatch):
    """The flash-attn varlen packing (CUDA with flash-attn installed) computes its segment layout on the host,
    once per layout: a warm call only gathers and scatters on the device. Before the fix every layer read
    the segment totals back from the device and picked rows with boolean masks (both host syncs)."""
    import ditsp.attention.window as window

    calls = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, causal=False):
        assert isinstance(max_q, int) and isinstance(max_k, int) and cu_q.device == cu_k.device == q.device
        calls.append((q.shape[0], cu_q.shape[0], max_q, max_k))
        return torch.empty_like(q)

    monkeypatch.setattr(window, "flash_attn_varlen_func", kernel)
    pack = window.WindowPack.build([(1, 2, 3), (1, 2, 2), (1, 2, 3)], DEV)
    q = torch.empty(pack.num_rows, 4, 32, device=DEV)
    t = torch.empty(5, 4, 32, device=DEV)
    audit = CrossDevice()
    with audit:
        window.window_attention(q, q, q, t, t, t, pack, None, backend="varlen")
        audit.on = True
        out, txt = window.window_attention(q, q, q, t, t, t, pack, None, backend="varlen")
        out2, none = window.window_attention(q, q, q, None, t, t, pack, None, backend="varlen")
    assert audit.hits == []
    assert out.shape == out2.shape == q.shape and txt.shape == t.shape and txt.dtype == torch.float64 and none is None
    assert calls[-2:] == [(16 + 3 * 5, 4, 11, 11), (16, 4, 6, 11)]


class Mirror:
    """Rank ``rank`` of a ``world``-rank group whose peers mirror it: every collective returns, for each peer,
    a tensor like this rank's (shapes as the call says). Enough to run one rank's side of the VAE's
    sharded modes on the stand-in device, and to check that every tensor it hands a collective, an empty
    rank's included, is on the device with the dtype a busy rank sends."""

    def __init__(self, rank: int, world: int):
        from ditsp.distributed.comm import CommStats

        self.group, self.rank, self.world_size, self.stats = None, rank, world, CommStats()
        self.sent: set = set()

    def _send(self, t, kind):
        self.sent.add((kind, t.device.type, t.dtype))

    def all_gather_object(self, obj):
        return [obj] * self.world_size

    def all_gather_rows(self, t, rows, kind="all_gather"):
        self._send(t, kind)
        return [t if r == self.rank else t.new_zeros((rows[r],) + tuple(t.shape[1:])) for r in range(self.world_size)]

    def all_reduce(self, t, kind="all_reduce"):
        self._send(t, kind)
        return t

    def batch_isend_irecv(self, sends, recvs, kind="p2p"):  # between neighbours only: not every rank joins
        for t, _ in list(sends) + list(recvs):
            self._send(t, "p2p " + kind)
        return []


@pytest.mark.parametrize("mode", ["height", "height+chunks", "time"])
def test_vae_collectives_carry_device_tensors_on_every_rank(mode):
    """One rank's side of the sharded VAE at SP=4 (a 2-latent-row frame: ranks 2 and 3 hold no rows) hands
    every collective device tensors, and an empty rank the same kinds, devices and dtypes as a busy one
    (NCCL deadlocks on a mismatch). Before the fix the GroupNorm statistics and halo rows went out in a
    host buffer."""
    from ditsp.models.meta import meta_device
    from ditsp.models.seedvr2.vae import RELEASED
    from ditsp.models.seedvr2.vae.model import VideoVAE
    from ditsp.models.seedvr2.vae.sharded import ParallelVAE

    with meta_device():
        vae = VideoVAE(RELEASED.with_widths((8, 16, 16, 16), groups=4))
    vae = vae.to(torch.bfloat16).eval()
    x = torch.empty(1, 3, 9, 16, 24, device=DEV, dtype=torch.bfloat16)
    sent = []
    for rank in (0, 3):
        comm = Mirror(rank, 4)
        pv = ParallelVAE(vae, comm)
        m = pv.encode(x, mode=mode).posterior.mean
        d = pv.decode(m, mode=mode)
        assert m.device == d.device == DEV and d.shape == x.shape
        assert {dev for _, dev, _ in comm.sent} == {"meta"}, comm.sent
        sent.append({c for c in comm.sent if not c[0].startswith("p2p ")})
    assert sent[0] == sent[1]  # the group's collectives: every rank joins each with the same kind of tensor


# -- the check itself ---------------------------------------------------------------------------------------


@pytest.mark.timeout(900)
def test_gpu_check_runs_every_step_at_tiny_sizes(tmp_path):
    """``make gpu-check``'s script end to end on this CPU (the tiny profile), without the packages the GPU
    image lacks: every step runs to ok, no row fails, and what needs a GPU is skipped with the reason.
    The budgets are scaled far up: on a shared CPU a step may take many times its usual seconds, and the
    time limits have their own tests (the supervisor's, below)."""
    from benchmarks.gpu import profiles

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.check", "--profile", "tiny", "--run-dir", str(run),
                           "--block-imports", "av,gguf,fastapi,diffusers", "--budget-scale", "20"], cwd=ROOT,
                          capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    data = json.loads((run / "results.json").read_text())
    assert [s["name"] for s in data["steps"]] == list(profiles.STEPS)
    assert {s["name"]: s["status"] for s in data["steps"]} == {s: "ok" for s in profiles.STEPS}
    rows = [r for s in data["steps"] for r in s["rows"]]
    assert not [r for r in rows if r["result"] == "FAIL"]
    skipped = [r for r in rows if r["result"] == "skip"]
    assert all(r.get("why") for r in skipped)
    assert not [r for r in skipped if "left of the step's budget" in r["why"]]  # every item ran
    ranks = {r["item"]: r for r in data["steps"][-1]["rows"]}
    assert ranks["nccl group of one"]["result"] == "skip"
    assert ranks["2 gloo ranks: dit window"]["collectives"]["window_exchange"] > 0  # layout changes moved rows
    assert data["run"]["packages"]["av"] == "absent" and data["run"]["ceilings"]["bf16_matmul_tflops"] >= 0
    md = (run / "results.md").read_text()
    assert all(f"## {s}:" in md for s in profiles.STEPS) and "gpu-check: 0 failure(s)" in proc.stdout
    assert "| ranks | ok |" in proc.stdout  # the summary table, printed last


CHILD = """
import json, subprocess, sys, time
sys.path.insert(0, {root!r})
from benchmarks.gpu.report import Report
r = Report(sys.argv[1])
r.begin("env", "a step that hangs", {budget})
r.row("env", item="before the hang", value=1.5)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a rank of the step
print("child", flush=True)
{then}
"""


def _supervised(tmp_path, budget: float, then: str):
    from benchmarks.gpu.check import supervise
    from benchmarks.gpu.report import Report

    report = Report(tmp_path)
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=str(ROOT), budget=budget, then=then))
    t0 = time.monotonic()
    code = supervise([sys.executable, str(script), str(tmp_path)], report, time.time() + 60, tmp_path / "log.txt",
                     grace_s=0.5)
    return report, code, time.monotonic() - t0


def test_supervisor_cuts_off_a_step_past_its_budget(tmp_path):
    """The running step is cut off once past its budget (its process group killed: the step's own children
    too) and recorded as timed out; the rows it wrote before stay, and both files are whole."""
    report, code, took = _supervised(tmp_path, 1.0, "time.sleep(120)")
    s = report.step("env")
    assert s["status"] == "timed out" and "budget of 1 s" in s["error"] and took < 30
    assert s["rows"] == [{"result": "ok", "item": "before the hang", "value": 1.5}]
    assert json.loads((tmp_path / "results.json").read_text())["steps"][0]["status"] == "timed out"
    assert "Status: **timed out**" in (tmp_path / "results.md").read_text()
    assert "child" in (tmp_path / "log.txt").read_text()
    out = subprocess.run(["pgrep", "-f", "time.sleep\\(120\\)"], capture_output=True, text=True).stdout.split()
    assert not [p for p in out if int(p) != os.getpid()]  # the step's child went with it


def test_supervisor_records_a_crashed_step_with_its_last_words(tmp_path):
    report, code, _ = _supervised(tmp_path, 30.0, "print('CUDA error: an illegal memory access', flush=True); "
                                                  "import os; os._exit(7)")
    s = report.step("env")
    assert code == 7 and s["status"] == "crashed" and "illegal memory access" in s["error"]
    assert report.failures() and report.failures()[0].startswith("env: crashed")


def test_torchrun_rank_sets_its_device_before_joining_nccl(monkeypatch):
    """Under torchrun with CUDA, a rank selects its LOCAL_RANK device before any collective work, binds the
    NCCL group to it, and keeps the timeout that ends a stuck collective (the order matters: NCCL work on
    the default device 0 from every rank of a node was the classic hang)."""
    import torch.distributed as dist

    from ditsp.distributed import launcher

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw)))
    monkeypatch.setattr(dist, "get_rank", lambda *a: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 4)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    for k, v in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    ctx = launcher.init_from_env(timeout_s=42)
    assert calls[0] == ("set_device", 1)
    (_, backend, kw), = calls[1:]
    assert backend == "nccl" and kw["device_id"] == torch.device("cuda", 1) and kw["timeout"].total_seconds() == 42
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert ctx.device == torch.device("cuda", 1) and (ctx.rank, ctx.world_size) == (3, 4)


def test_gpu_profile_without_a_gpu_says_so(tmp_path):
    """The gpu sizes on a machine whose torch sees no CUDA device: every step fails at once with the reason
    (never hours of a 3B on the CPU), and the exit status says the run failed."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.check", "--profile", "gpu", "--run-dir", str(run),
                           "--steps", "env,dit"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    steps = json.loads((run / "results.json").read_text())["steps"]
    assert proc.returncode == 1 and [s["status"] for s in steps] == ["failed", "failed"]
    assert "needs a CUDA device" in steps[0]["error"]
