"""The ComfyUI nodes (ditsp/integrations/comfyui) without ComfyUI: a stand-in for the few ComfyUI modules they
use (folder_paths, comfy.utils.ProgressBar, comfy.model_management's interrupt flag and unload), the node
contract, IMAGE frames both ways, the refusals before any rank, and the frames of a restoration on the
nodes' persistent ranks against `ditsp upscale`'s."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import types
from dataclasses import replace

import pytest
import torch

from ditsp.cli import main
from ditsp.distributed.launcher import RankContext
from ditsp.integrations.comfyui import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, host
from ditsp.integrations.comfyui.frames import to_frames, to_images
from ditsp.integrations.comfyui.nodes import LoadSeedVR2, UpscaleSeedVR2
from ditsp.io.probe import open_media
from ditsp.io.testclip import make_test_clip
from ditsp.models.seedvr2.job import request
from ditsp.models.seedvr2.job.restore import rank_upscale
from ditsp.serve.handles import call

pytestmark = pytest.mark.timeout(300)

OPTIONS = dict(scale=0.0, resolution="64x48", size="", seed=666, color_fix="wavelet", window_frames=0, overlap=4,
               gpus="", vae_mode="auto", deterministic=True, max_memory=0.0, force=False)
CLI = ["--model", "tiny-8x", "--random-weights", "--resolution", "64x48", "--seed", "666", "--deterministic"]


class _Interrupt(Exception):
    """The stand-in's InterruptProcessingException."""


def _stand_in(models_dir) -> dict[str, types.ModuleType]:
    """The ComfyUI modules the nodes use, as ComfyUI defines them (the same names and behaviour)."""
    fp = types.ModuleType("folder_paths")
    fp.get_filename_list = lambda kind: sorted(os.listdir(models_dir / kind)) if (models_dir / kind).is_dir() else []

    def get_full_path(kind, name):
        p = models_dir / kind / name
        return str(p) if p.is_file() else None

    fp.get_full_path = get_full_path
    comfy = types.ModuleType("comfy")
    utils = types.ModuleType("comfy.utils")
    utils.updates = []

    class ProgressBar:
        def __init__(self, total, node_id=None):
            self.total, self.current = total, 0

        def update_absolute(self, value, total=None, preview=None):
            self.total = total if total is not None else self.total
            self.current = min(value, self.total)
            utils.updates.append((self.current, self.total))

    utils.ProgressBar = ProgressBar
    mm = types.ModuleType("comfy.model_management")
    mm.flag = [False]
    mm.unloads = []
    mm.InterruptProcessingException = _Interrupt
    mm.interrupt_current_processing = lambda value=True: mm.flag.__setitem__(0, value)
    mm.processing_interrupted = lambda: mm.flag[0]

    def throw_exception_if_processing_interrupted():
        if mm.flag[0]:
            mm.flag[0] = False
            raise _Interrupt()

    mm.throw_exception_if_processing_interrupted = throw_exception_if_processing_interrupted
    mm.unload_all_models = lambda: mm.unloads.append(True)
    comfy.utils, comfy.model_management = utils, mm
    return {"folder_paths": fp, "comfy": comfy, "comfy.utils": utils, "comfy.model_management": mm}


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    """The stand-in ComfyUI, installed for this module's tests (its models folder has one DiT file)."""
    models = tmp_path_factory.mktemp("comfy-models")
    (models / "diffusion_models").mkdir()
    (models / "diffusion_models" / "seedvr2_ema_3b_fp8_e4m3fn.safetensors").write_bytes(b"")
    mods = _stand_in(models)
    saved = {k: sys.modules.get(k) for k in mods}
    sys.modules.update(mods)
    yield types.SimpleNamespace(utils=mods["comfy.utils"], mm=mods["comfy.model_management"])
    for k, v in saved.items():
        if v is None:
            sys.modules.pop(k, None)
        else:
            sys.modules[k] = v
    host._unload_hooks.clear()


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("comfy-clip") / "in.mp4"
    return str(make_test_clip(str(path), width=48, height=32, frames=5, fps=12, audio=False))


def _images(path) -> torch.Tensor:
    """The clip as ComfyUI's video loader gives it: rgb24 frames / 255, [frames, H, W, 3]."""
    _, chunks = open_media(path)
    return torch.cat(list(chunks)).permute(0, 2, 3, 1) / 255.0


def _digest(images: torch.Tensor) -> str:
    """The sha256 of IMAGE frames saved as ComfyUI saves them (255 x, clipped, truncated to uint8)."""
    u8 = (images * 255).clamp(0, 255).byte()
    return hashlib.sha256(u8.numpy().tobytes()).hexdigest()


def _cli_digest(clip, tmp_path, capsys, sp: int) -> str:
    assert main(["upscale", clip, "-o", str(tmp_path / f"cli{sp}.mp4"), "--sp", str(sp), *CLI, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["sha256"]


@pytest.fixture(scope="module")
def loaded(comfy):
    (model,) = LoadSeedVR2().load("tiny-8x", host.NONE, host.NONE, "default", "stored", 1, True)
    yield model
    model.group.close()


# -- the contract ---------------------------------------------------------------------------------------


def test_the_nodes_follow_comfyuis_contract(comfy):
    """Mappings, types, functions and categories as ComfyUI reads them; every choice and default is the
    restoration request's own (the CLI's flags come from the same place)."""
    assert set(NODE_CLASS_MAPPINGS) == set(NODE_DISPLAY_NAME_MAPPINGS) == {"DitspLoadSeedVR2", "DitspUpscaleSeedVR2"}
    for cls in NODE_CLASS_MAPPINGS.values():
        assert callable(getattr(cls, cls.FUNCTION)) and cls.CATEGORY == "ditsp/SeedVR2"
        assert len(cls.RETURN_TYPES) == len(cls.RETURN_NAMES)
    load = LoadSeedVR2.INPUT_TYPES()["required"]
    assert LoadSeedVR2.RETURN_TYPES == ("SEEDVR2_DITSP",)
    assert load["model"][0] == list(request.MODELS) and load["model"][1]["default"] == request.default("model")
    assert load["dit"][0] == [host.NONE, "seedvr2_ema_3b_fp8_e4m3fn.safetensors"]  # ComfyUI's models folder
    assert load["vae"][0] == [host.NONE]
    assert load["dtype"][0] == ["default", *request.DTYPE_NAMES]
    assert load["weights_dtype"][0] == list(request.WEIGHTS_DTYPES)
    assert load["threads"][1]["default"] == request.default("threads")
    up = UpscaleSeedVR2.INPUT_TYPES()["required"]
    assert UpscaleSeedVR2.RETURN_TYPES == ("IMAGE",)
    assert up["model"] == ("SEEDVR2_DITSP",) and up["images"] == ("IMAGE",)
    assert set(up) == {"model", "images", "sp", *OPTIONS}
    assert up["color_fix"][0] == list(request.COLOR_FIX_CHOICES) and up["vae_mode"][0] == list(request.VAE_MODES)
    for name in ("seed", "color_fix", "window_frames", "overlap", "sp", "vae_mode", "deterministic", "force"):
        assert up[name][1]["default"] == request.default(name), name
    # the node's function takes exactly its inputs
    assert set(up) == set(UpscaleSeedVR2.upscale.__code__.co_varnames[1:UpscaleSeedVR2.upscale.__code__.co_argcount])
    assert set(load) == set(LoadSeedVR2.load.__code__.co_varnames[1:LoadSeedVR2.load.__code__.co_argcount])


def test_image_frames_both_ways():
    """IMAGE [frames, H, W, 3] float in 0..1 -> uint8 (T, 3, H, W) rounded to the nearest level; back,
    level k -> k/255, which ComfyUI's savers (255 x, clipped, truncated) and rounding both turn into k."""
    levels = torch.arange(256, dtype=torch.uint8)
    u8 = levels.repeat(2 * 4 * 3 * 3)[: 2 * 4 * 3 * 3].reshape(2, 3, 4, 3)  # (T, 3, H, W)
    images = u8.permute(0, 2, 3, 1) / 255.0  # what ComfyUI's loaders give
    got = to_frames(images)
    assert got.dtype == torch.uint8 and got.shape == (2, 3, 4, 3) and got.is_contiguous()
    assert torch.equal(got, u8)
    nudged = (images + 0.4 / 255).clamp(0, 1)  # a node upstream that is off by less than half a level
    assert torch.equal(to_frames(nudged), u8)
    assert torch.equal(to_frames(torch.full((1, 2, 2, 3), 1.7)), torch.full((1, 3, 2, 2), 255, dtype=torch.uint8))
    out = to_images(levels.reshape(1, 16, 16, 1).expand(1, 16, 16, 3).contiguous())
    assert out.dtype == torch.float32 and out.shape == (1, 16, 16, 3)
    assert float(out.min()) == 0.0 and float(out.max()) == 1.0
    assert torch.equal((out * 255).clamp(0, 255).byte()[..., 0].flatten(), levels)  # ComfyUI's savers
    assert torch.equal(to_images(got.permute(0, 2, 3, 1)), images)  # the round trip is exact
    for bad, says in ((torch.zeros(2, 4, 4), "shape"), (torch.zeros(1, 4, 4, 4), "shape"),
                      (torch.zeros(1, 4, 4, 3, dtype=torch.uint8), "float"), (torch.zeros(0, 4, 4, 3), "empty"),
                      (torch.full((1, 2, 2, 3), float("nan")), "NaN"), ([[0.5]], "tensor")):
        with pytest.raises(ValueError, match=says) as e:
            to_frames(bad)
        assert "\n" not in str(e.value)


def test_frames_in_memory_make_the_files_plan_and_bytes(clip, tmp_path, one_thread):
    """The job's in-memory input (the request's frames) plans the same restoration as the file and gives
    the same bytes (rank 0 returns them instead of writing); frames of the wrong kind are refused."""
    o = request.Options(input=clip, output=str(tmp_path / "out.mp4"), model="tiny-8x", random_weights=True,
                        resolution="64x48", deterministic=True, progress=False)
    frames = to_frames(_images(clip))
    unwritten = tmp_path / "unwritten.mp4"
    from_file, in_memory = request.check(o).req, request.check(replace(o, output=str(unwritten)), frames).req
    assert in_memory.plan.fingerprint() == from_file.plan.fingerprint()
    ctx = RankContext(0, 1, None, torch.device("cpu"))
    a, b = rank_upscale(ctx, from_file), rank_upscale(ctx, in_memory)
    assert a["sha256"] == b["sha256"]
    restored = b["output_frames"]
    assert restored.dtype == torch.uint8 and tuple(restored.shape) == (5, 32, 64, 3)
    assert hashlib.sha256(restored.numpy().tobytes()).hexdigest() == a["sha256"]
    assert b["frames"] == a["frames"] == 5 and b["frames_written"] == 5 and "output_frames" not in a
    assert not unwritten.exists() and (tmp_path / "out.mp4").is_file()
    for bad in (frames.float(), frames[:, :2], frames[:0], frames.permute(0, 2, 3, 1)):
        with pytest.raises(ValueError, match="frames") as e:
            request.check(o, bad)
        assert "\n" not in str(e.value)


# -- refusals before any rank --------------------------------------------------------------------------


def test_the_loader_refuses_what_the_request_refuses(comfy):
    with pytest.raises(ValueError, match="model seedvr2-3b has no weights without checkpoints"):
        LoadSeedVR2().load("seedvr2-3b", host.NONE, host.NONE, "default", "stored", 1, False)
    with pytest.raises(ValueError, match="not found in ComfyUI's vae folder"):
        LoadSeedVR2().load("seedvr2-3b", "seedvr2_ema_3b_fp8_e4m3fn.safetensors", "ema_vae.pth", "default",
                           "stored", 1, False)
    with pytest.raises(ValueError, match="unknown model"):
        LoadSeedVR2().load("seedvr3", host.NONE, host.NONE, "default", "stored", 1, True)


def test_a_job_that_does_not_fit_is_refused_with_the_clis_message_before_any_rank(comfy, clip, tmp_path, capsys):
    (model,) = LoadSeedVR2().load("tiny-8x", host.NONE, host.NONE, "default", "stored", 1, True)
    assert main(["upscale", clip, "-o", str(tmp_path / "o.mp4"), "--sp", "2", *CLI, "--max-memory", "0.0001"]) == 1
    cli = capsys.readouterr().err.strip()
    assert cli.startswith("ditsp upscale: error: memory estimate:") and "does not fit" in cli
    with pytest.raises(MemoryError) as e:
        UpscaleSeedVR2().upscale(model, _images(clip), sp=2, **{**OPTIONS, "max_memory": 0.0001})
    assert str(e.value) == cli.removeprefix("ditsp upscale: error: ")
    assert model.group.workers == []  # no rank was started
    for kw, says in (({"scale": 2.0, "size": "64x32"}, "at most one of scale, resolution, size"),
                     ({"resolution": "64by48"}, "--resolution"), ({"gpus": "0,x"}, "device indices"),
                     ({"gpus": "0"}, "give 2 different device indices"), ({"color_fix": "sepia"}, "--color-fix")):
        with pytest.raises(ValueError, match=says) as e:
            UpscaleSeedVR2().upscale(model, _images(clip), sp=2, **{**OPTIONS, **kw})
        assert "\n" not in str(e.value)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            UpscaleSeedVR2().upscale(model, _images(clip), sp=2, **{**OPTIONS, "gpus": "0,1"})
    assert model.group.workers == []


# -- on the persistent ranks ----------------------------------------------------------------------------


def test_the_nodes_frames_are_ditsp_upscales_at_sp_1_and_2(comfy, loaded, clip, tmp_path, capsys):
    """The node at SP 2 and 1 on the loaded model's persistent ranks restores the bytes `ditsp upscale
    --deterministic` writes at SP 2 and 1; the ranks are kept between prompts (the group shrinks to the
    degree asked for), and the progress bar follows rank 0 to the end."""
    cli = {sp: _cli_digest(clip, tmp_path, capsys, sp) for sp in (1, 2)}
    assert cli[1] == cli[2]
    images = _images(clip)
    comfy.utils.updates.clear()
    (out,) = UpscaleSeedVR2().upscale(loaded, images, sp=2, **OPTIONS)
    assert out.dtype == torch.float32 and tuple(out.shape) == (5, 32, 64, 3)
    assert 0.0 <= float(out.min()) and float(out.max()) <= 1.0
    assert _digest(out) == cli[2]
    steps = comfy.utils.updates
    assert steps and steps[-1][0] == steps[-1][1] > 1 and [d for d, _ in steps] == sorted(d for d, _ in steps)
    pids = loaded.group.pids
    assert len(pids) == 2
    (again,) = UpscaleSeedVR2().upscale(loaded, images, sp=2, **OPTIONS)
    assert loaded.group.pids == pids and _digest(again) == cli[2]  # the same ranks, no reload
    (one,) = UpscaleSeedVR2().upscale(loaded, images, sp=1, **OPTIONS)
    assert loaded.group.pids == pids[:1] and _digest(one) == cli[1]
    assert not _alive(pids[1])


def test_an_interrupt_stops_the_ranks_mid_job(comfy, loaded, clip):
    """ComfyUI's interrupt, set while the ranks run (at rank 0's first step), stops the job on every rank:
    rank 0's progress stays short of the end, ComfyUI's own exception is raised and its flag cleared, and
    no rank computes on: each is gone or idle, and the next prompt runs on the group."""
    images = _images(clip)
    long = torch.cat([images] * 16)  # 80 one-frame windows: 320 steps, far more than the ranks run between two
    opts = {**OPTIONS, "window_frames": 1, "overlap": 0}  # of the host's looks at the flag (about 0.5 s apart)
    comfy.utils.updates.clear()
    real = comfy.utils.ProgressBar

    class Interrupting(real):
        def update_absolute(self, value, total=None, preview=None):
            super().update_absolute(value, total, preview)
            comfy.mm.interrupt_current_processing()

    comfy.utils.ProgressBar = Interrupting
    try:
        with pytest.raises(_Interrupt):
            UpscaleSeedVR2().upscale(loaded, long, sp=2, **opts)
    finally:
        comfy.utils.ProgressBar = real
    assert comfy.mm.flag == [False]
    assert comfy.utils.updates and comfy.utils.updates[-1][1] == 320
    workers = loaded.group.workers
    assert workers and workers[0].progress[0] < 320  # rank 0 stopped short of the end
    _, errors, _ = call(workers, "ping", [{}] * len(workers), 60.0)  # out of the job: each answers at once
    assert not errors
    (out,) = UpscaleSeedVR2().upscale(loaded, images, sp=2, **opts)
    assert tuple(out.shape) == (5, 32, 64, 3)


def test_unloading_or_dropping_the_model_stops_its_ranks(comfy, loaded, clip):
    """ComfyUI's "unload models" stops every loaded model's ranks (ComfyUI's own unload still runs; a later
    prompt starts them again), and so does ComfyUI dropping a loader's output from its cache."""
    pids = loaded.group.pids
    (model,) = LoadSeedVR2().load("tiny-8x", host.NONE, host.NONE, "default", "stored", 1, True)
    UpscaleSeedVR2().upscale(model, _images(clip)[:1], sp=1, **OPTIONS)
    pids += model.group.pids
    assert len(pids) >= 2 and all(_alive(p) for p in pids)
    comfy.mm.unloads.clear()
    comfy.mm.unload_all_models()
    assert comfy.mm.unloads == [True] and loaded.group.workers == model.group.workers == []
    assert not any(_alive(p) for p in pids)
    UpscaleSeedVR2().upscale(model, _images(clip)[:1], sp=1, **OPTIONS)
    pids = model.group.pids
    assert pids and all(_alive(p) for p in pids)
    del model
    gc.collect()
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie is not: it has exited and only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_example_workflow_matches_the_nodes():
    """examples/: the API-format graph gives each ditsp node exactly its inputs, with allowed values (SP 2,
    deterministic, the shipped model); the UI-format graph is the same graph (links, widget values)."""
    folder = os.path.join(os.path.dirname(host.__file__), "examples")
    api = json.load(open(os.path.join(folder, "restore-sp2.api.json")))
    ui = json.load(open(os.path.join(folder, "restore-sp2.json")))
    for node in api.values():
        cls = NODE_CLASS_MAPPINGS.get(node["class_type"])
        if cls is None:
            continue
        spec = cls.INPUT_TYPES()["required"]
        assert set(node["inputs"]) == set(spec), node["class_type"]
        for k, v in node["inputs"].items():
            if isinstance(spec[k][0], list):
                assert v in spec[k][0], (k, v)
    up = next(n["inputs"] for n in api.values() if n["class_type"] == "DitspUpscaleSeedVR2")
    assert up["sp"] == 2 and up["deterministic"] is True
    assert next(n["inputs"] for n in api.values() if n["class_type"] == "DitspLoadSeedVR2")["model"] == "tiny"
    assert [n["class_type"] for n in api.values()] == ["LoadVideo", "GetVideoComponents", "DitspLoadSeedVR2",
                                                      "DitspUpscaleSeedVR2", "CreateVideo", "SaveVideo"]
    by_id = {n["id"]: n for n in ui["nodes"]}
    assert {str(i): n["type"] for i, n in by_id.items()} == {i: n["class_type"] for i, n in api.items()}
    for lid, src, slot, dst, dslot, _ in ui["links"]:
        name = by_id[dst]["inputs"][dslot]["name"]
        assert by_id[dst]["inputs"][dslot]["link"] == lid and lid in by_id[src]["outputs"][slot]["links"]
        assert api[str(dst)]["inputs"][name] == [str(src), slot]
    for i, n in by_id.items():
        cls = NODE_CLASS_MAPPINGS.get(n["type"])
        if cls is not None:
            widgets = [api[str(i)]["inputs"][k] for k, spec in cls.INPUT_TYPES()["required"].items()
                       if spec[0] not in ("IMAGE", "SEEDVR2_DITSP")]
            assert [v for v in n["widgets_values"] if v != "fixed"] == widgets


def test_workers_started_inside_comfyui_do_not_rerun_its_main_script(monkeypatch):
    """A spawned process re-runs its parent's main script first; inside ComfyUI that is ComfyUI's main.py
    (argument parsing, device set-up, every import). The ranks are started with the main module named
    ``__main__``, which the spawn skips; the main module is as it was afterwards."""
    import multiprocessing.spawn

    from ditsp.integrations.comfyui.group import _main_not_rerun

    fake = types.ModuleType("__main__")
    fake.__file__, fake.__spec__ = "/opt/ComfyUI/main.py", None
    monkeypatch.setitem(sys.modules, "__main__", fake)
    assert multiprocessing.spawn.get_preparation_data("x").get("init_main_from_path") == "/opt/ComfyUI/main.py"
    with _main_not_rerun():
        d = multiprocessing.spawn.get_preparation_data("x")
    assert "init_main_from_path" not in d and d["init_main_from_name"] == "__main__"
    assert fake.__spec__ is None and fake.__file__ == "/opt/ComfyUI/main.py"
