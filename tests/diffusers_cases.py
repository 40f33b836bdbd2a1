"""Tiny seeded diffusers transformers, their inputs, and the one-device comparison the integration tests share.

Every rank builds the same model and inputs, runs the parallelized forward on the full inputs and
back-propagates the same cotangent. The output must equal the single-device output of the unmodified
diffusers model, and the per-rank parameter gradients must sum to its gradients, within a measured
tolerance (different attention kernels: not the same bits).
"""

from __future__ import annotations

import torch

from ditsp.config import ParallelConfig
from ditsp.integrations.diffusers import parallelize, reduce_gradients

# Measured (fp32, CPU, 2 cores): output max rel err <= 2.1e-7, worst parameter-gradient rel err 3.5e-6
# (Wan and Flux, SP 2, 3 and USP 2x2; SP 1 the same bits); the bars are about 10x those.
OUT_TOL, GRAD_TOL = 1e-5, 3e-5


def build(family: str, heads: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    if family == "wan":
        from diffusers import WanTransformer3DModel

        return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=12,
                                     in_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=64,
                                     num_layers=2, rope_max_seq_len=32)
    if family == "flux":
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                      attention_head_dim=8, num_attention_heads=heads, joint_attention_dim=16,
                                      pooled_projection_dim=8, guidance_embeds=False, axes_dims_rope=(2, 2, 4))
    if family == "ltx":
        from diffusers import LTXVideoTransformer3DModel

        return LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=heads,
                                          attention_head_dim=8, cross_attention_dim=4 * 8, num_layers=2,
                                          caption_channels=16)
    if family in ("cogvideox", "cogvideox-rope"):  # 2B style (sincos positions) or 5B style (RoPE)
        from diffusers import CogVideoXTransformer3DModel

        return CogVideoXTransformer3DModel(num_attention_heads=heads, attention_head_dim=8, in_channels=4,
                                           out_channels=4, time_embed_dim=8, text_embed_dim=16, num_layers=2,
                                           sample_width=10, sample_height=6, sample_frames=5, patch_size=2,
                                           max_text_seq_length=6,
                                           use_rotary_positional_embeddings=family == "cogvideox-rope")
    if family == "hunyuan":
        from diffusers import HunyuanVideoTransformer3DModel

        return HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=heads,
                                              attention_head_dim=8, num_layers=1, num_single_layers=1,
                                              num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, text_embed_dim=16,
                                              pooled_projection_dim=8, rope_axes_dim=(2, 2, 4))
    raise ValueError(family)


def inputs(family: str, shape, per_token: bool = False, seed: int = 1):
    """(args, kwargs, cotangent) of one forward; ``shape`` is the latent grid (Wan) or (tokens, text) (Flux)."""
    g = torch.Generator().manual_seed(seed)
    if family == "wan":
        f, h, w = shape
        x = torch.randn(1, 4, f, h, w, generator=g)
        tokens = f * (h // 2) * (w // 2)
        t = torch.randint(0, 1000, (1, tokens), generator=g) if per_token else torch.tensor([437])
        return (x, t, torch.randn(1, 7, 16, generator=g)), {}, torch.randn(1, 4, f, h, w, generator=g)
    if family == "ltx":  # (frames, height, width) of the latent grid; one text token masked out
        f, h, w = shape
        s = f * h * w
        t = torch.randint(0, 1000, (1, s), generator=g) if per_token else torch.tensor([437])
        mask = torch.ones(1, 6)
        mask[0, -1] = 0
        kw = {"timestep": t, "encoder_attention_mask": mask, "num_frames": f, "height": h, "width": w}
        return (torch.randn(1, s, 8, generator=g), torch.randn(1, 6, 16, generator=g)), kw, \
            torch.randn(1, s, 8, generator=g)
    if family.startswith("cogvideox"):  # latent (frames, height, width); 6 text tokens
        f, h, w = shape
        s = f * (h // 2) * (w // 2)
        kw = {"timestep": torch.tensor([437])}
        if family == "cogvideox-rope":
            kw["image_rotary_emb"] = (torch.randn(s, 8, generator=g), torch.randn(s, 8, generator=g))
        return (torch.randn(1, f, 4, h, w, generator=g), torch.randn(1, 6, 16, generator=g)), kw, \
            torch.randn(1, f, 4, h, w, generator=g)
    if family == "hunyuan":  # latent (frames, height, width); 6 text tokens, the last two padding
        f, h, w = shape
        mask = torch.ones(1, 6)
        mask[0, 4:] = 0
        x, e = torch.randn(1, 4, f, h, w, generator=g), torch.randn(1, 6, 16, generator=g)
        kw = {"timestep": torch.tensor([437]), "encoder_hidden_states": e, "encoder_attention_mask": mask,
              "pooled_projections": torch.randn(1, 8, generator=g), "guidance": torch.tensor([3.5])}
        return (x,), kw, torch.randn(1, 4, f, h, w, generator=g)
    s, text = shape
    x, e = torch.randn(1, s, 8, generator=g), torch.randn(1, text, 16, generator=g)
    kw = {"pooled_projections": torch.randn(1, 8, generator=g), "timestep": torch.tensor([0.5]),
          "img_ids": torch.randint(0, 8, (s, 3), generator=g).float(), "txt_ids": torch.zeros(text, 3)}
    return (x, e), kw, torch.randn(1, s, 8, generator=g)


def forward_backward(model, family, shape, per_token=False):
    args, kw, cot = inputs(family, shape, per_token)
    out = model(*args, **kw, return_dict=False)[0]
    out.backward(cot)
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rank_run(ctx, family, u, r, heads, shape, per_token=False, advanced_uaa=False, reduce=False):
    model = build(family, heads)
    parallelize(model, ParallelConfig(ulysses_degree=u, ring_degree=r, advanced_uaa=advanced_uaa), ctx.group)
    out, grads = forward_backward(model, family, shape, per_token)
    if reduce:
        reduce_gradients(model)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def errors(results, family, heads, shape, per_token=False, summed=True):
    """(worst output rel err over ranks, worst parameter-gradient rel err) against the unmodified model."""
    ref_out, ref_grads = forward_backward(build(family, heads), family, shape, per_token)
    for out, _ in results:
        assert out.shape == ref_out.shape
    grads = ({n: sum(g[n] for _, g in results) for n in ref_grads} if summed else results[0][1])
    assert set(grads) == set(ref_grads)
    # A gradient that is zero in exact arithmetic (a key bias: softmax ignores a shift shared by all keys)
    # is roundoff on both sides, so each parameter's error is relative to its own largest gradient but at
    # least 1e-3 of the largest gradient of any parameter.
    floor = 1e-3 * max(g.abs().max().item() for g in ref_grads.values())
    grad_err = max(((grads[n].double() - ref_grads[n].double()).abs().max()
                    / max(ref_grads[n].abs().max().item(), floor)).item() for n in ref_grads)
    return max(rel(out, ref_out) for out, _ in results), grad_err


def compare(results, family, heads, shape, per_token=False, summed=True):
    out_err, grad_err = errors(results, family, heads, shape, per_token, summed)
    assert out_err <= OUT_TOL, out_err
    assert grad_err <= GRAD_TOL, grad_err


def save_tiny_wan_pipeline(folder, seed: int = 0, expand_timesteps: bool = False):
    """A tiny random Wan text-to-video pipeline folder (transformer, VAE, scheduler, model_index.json) and
    its prompt embeddings file. No text encoder or tokenizer: their files are not available offline, so
    the prompt is given as precomputed embeddings (``embeds.safetensors``)."""
    import json
    from pathlib import Path

    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler
    from safetensors.torch import save_file

    folder = Path(folder)
    torch.manual_seed(seed)
    z = 4
    vae = AutoencoderKLWan(base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.0, 0.3],
                           latents_std=[1.5, 0.8, 1.0, 1.2])
    from diffusers import WanTransformer3DModel

    tr = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=12, in_channels=z,
                               out_channels=z, text_dim=16, freq_dim=32, ffn_dim=64, num_layers=2,
                               rope_max_seq_len=32)
    tr.save_pretrained(folder / "transformer")
    vae.save_pretrained(folder / "vae")
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(folder / "scheduler")
    index = {"_class_name": "WanPipeline", "_diffusers_version": "0.42.1",
             "transformer": ["diffusers", "WanTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLWan"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "text_encoder": [None, None],
             "tokenizer": [None, None], "transformer_2": [None, None], "boundary_ratio": None,
             "expand_timesteps": expand_timesteps}
    (folder / "model_index.json").write_text(json.dumps(index))
    g = torch.Generator().manual_seed(seed + 1)
    save_file({"prompt_embeds": torch.randn(1, 7, 16, generator=g),
               "negative_prompt_embeds": torch.randn(1, 7, 16, generator=g)}, str(folder / "embeds.safetensors"))
    return folder
