"""`ditsp rl`: GRPO post-training of a diffusers Wan transformer under Ulysses SP, on local ranks or torchrun.

Thin: checks the arguments, the model folders and the prompt files before
any rank starts, runs :func:`ditsp.rl.loop.rank_rl` on ``--sp`` ranks and
prints the report (``--json`` for one object). What a step does:
docs/rl.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import asdict

from ..argtypes import nonneg_float, nonneg_int, positive_float, positive_int, timeout_seconds


def add_parser(sub) -> argparse.ArgumentParser:
    from ..rl.rewards import REWARDS  # the table only: no model code

    p = sub.add_parser(
        "rl", help="GRPO post-training of a Wan video transformer under SP, rewards from its frames",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="GRPO post-training of a diffusers Wan text-to-video transformer (WanTransformer3DModel) under "
                    "Ulysses SP.\nEach step samples --group-size rollouts for each of --prompts-per-step prompts "
                    "(SDE steps inside\n--sde-window, ODE outside, every rank drawing the same noise from the "
                    "rollout's seed), decodes\nthem with the frozen VAE, scores the frames with --reward, "
                    "normalises the rewards within each\nprompt's group and takes --updates AdamW steps of the "
                    "PPO-clip loss (plus --kl to the initial\nmodel). Held-out prompts are sampled with the "
                    "deterministic sampler before, every --eval-every\nsteps and after; OUT/reward.png is the "
                    "curve. Details: docs/rl.md.",
        epilog="example:\n  ditsp rl --random-weights --random-prompts 6 --reward brightness --steps 10 --sp 2 "
               "--deterministic")
    src = p.add_argument_group("model and prompts")
    src.add_argument("--transformer", metavar="DIR", help="a WanTransformer3DModel save_pretrained folder")
    src.add_argument("--vae", metavar="DIR", help="its AutoencoderKLWan save_pretrained folder (frozen)")
    src.add_argument("--random-weights", action="store_true",
                     help="a seeded tiny Wan and VAE instead of folders (tests and benchmarks, not a model)")
    src.add_argument("--prompts", metavar="FILE",
                     help="safetensors with prompt_embeds [N, tokens, dim]: the prompts (no text encoder is run)")
    src.add_argument("--random-prompts", type=nonneg_int, default=0, metavar="N",
                     help="N seeded prompt embeddings instead of --prompts (tests and benchmarks)")
    src.add_argument("--eval-prompts", metavar="FILE", help="held-out prompt embeddings (default: the last --holdout)")
    src.add_argument("--holdout", type=nonneg_int, default=2, metavar="K",
                     help="without --eval-prompts, the last K prompts are held out for evaluation")
    src.add_argument("--reward", default="jpeg-compressibility", choices=list(REWARDS),
                     help="; ".join(f"{r.name}: {r.doc}" for r in REWARDS.values()))
    run = p.add_argument_group("sampling and GRPO")
    run.add_argument("--steps", type=positive_int, default=20, help="GRPO steps (one batch of rollouts each)")
    run.add_argument("--prompts-per-step", type=positive_int, default=2, help="training prompts per step")
    run.add_argument("--group-size", type=positive_int, default=4, help="rollouts per prompt (>= 2)")
    run.add_argument("--sample-steps", type=positive_int, default=8, help="denoising steps of the sampler")
    run.add_argument("--sde-window", default="0:4", metavar="START:STOP",
                     help="the stochastic (SDE) steps START..STOP-1; the others are deterministic (ODE)")
    run.add_argument("--noise-level", type=positive_float, default=0.7, help="the SDE's noise scale a")
    run.add_argument("--shift", type=positive_float, default=3.0, help="the sigma schedule's shift")
    run.add_argument("--frames", type=positive_int, default=5, help="frames per clip (4n + 1 for Wan's VAE)")
    run.add_argument("--size", default="32x32", metavar="WxH", help="clip size in pixels (multiples of 16 for Wan)")
    run.add_argument("--clip", type=positive_float, default=1e-4, help="PPO clip range of the importance ratio")
    run.add_argument("--adv-clip", type=positive_float, default=5.0, help="advantages clipped to +-this")
    run.add_argument("--kl", type=nonneg_float, default=0.0, help="weight of the KL to the initial model (0: none)")
    run.add_argument("--lr", type=positive_float, default=1e-4, help="AdamW learning rate")
    run.add_argument("--weight-decay", type=nonneg_float, default=1e-4, help="AdamW weight decay")
    run.add_argument("--grad-clip", type=positive_float, default=1.0, help="gradient-norm clip")
    run.add_argument("--updates", type=positive_int, default=2, help="optimizer steps per batch of rollouts")
    run.add_argument("--seed", type=int, default=0, help="prompts, rollout and evaluation seeds: a run is a function of it")
    par = p.add_argument_group("ranks and output")
    par.add_argument("--sp", type=positive_int, default=1, help="Ulysses SP degree: local ranks (under torchrun: the job's)")
    par.add_argument("--deterministic", action="store_true",
                     help="fixed-shape kernel calls: the same bits at every SP degree, importance ratios exactly 1 "
                          "at each batch's first update")
    par.add_argument("--eval-every", type=positive_int, default=5, help="evaluate the held-out prompts every N steps")
    par.add_argument("--eval-seeds", type=positive_int, default=1, help="deterministic samples per held-out prompt")
    par.add_argument("--out", default="out/rl",
                     help="folder: checkpoint.pt, history.json, transformer/, reward.png, report.json")
    par.add_argument("--checkpoint-every", type=positive_int, default=10)
    par.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt (bit for bit)")
    par.add_argument("--json", action="store_true", help="print one JSON report")
    par.add_argument("--no-progress", action="store_true")
    par.add_argument("--timeout", type=timeout_seconds, default=600.0,
                     help="seconds a rank may go without progress before it counts as stuck")
    from ..rl.spot_config import add_arguments as add_spot_arguments

    add_spot_arguments(p)
    p.set_defaults(func=run_command)
    return p


def _window(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in text.split(":"))
        return lo, hi
    except ValueError:
        raise ValueError(f"--sde-window must be START:STOP (e.g. 0:4), got {text!r}") from None


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
        if w > 0 and h > 0:
            return h, w
    except ValueError:
        pass
    raise ValueError(f"--size must be WxH in pixels (e.g. 32x32), got {text!r}")


def config_of(args):
    from ..rl.loop import RLConfig

    return RLConfig(out=args.out, steps=args.steps, transformer=args.transformer, vae=args.vae,
                    random_weights=args.random_weights, prompts=args.prompts, random_prompts=args.random_prompts,
                    eval_prompts=args.eval_prompts, holdout=args.holdout, reward=args.reward,
                    prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                    sample_steps=args.sample_steps, window=_window(args.sde_window), noise_level=args.noise_level,
                    shift=args.shift, frames=args.frames, size=_size(args.size), clip=args.clip,
                    adv_clip=args.adv_clip, kl=args.kl, lr=args.lr, weight_decay=args.weight_decay,
                    grad_clip=args.grad_clip, updates=args.updates, seed=args.seed, sp=args.sp,
                    deterministic=args.deterministic, eval_every=args.eval_every, eval_seeds=args.eval_seeds,
                    checkpoint_every=args.checkpoint_every, resume=args.resume,
                    progress=not (args.no_progress or args.json), json=args.json)


def preflight(cfg) -> None:
    """What can be checked on the host before any rank starts: the folders' classes and configs, the
    prompts and the clip size (ValueError, one line)."""
    from ..rl.loop import load_prompts
    from ..rl.policy import RANDOM_VAE, RANDOM_WAN, check_configs, check_folders

    if cfg.random_weights:
        text_dim = check_configs(RANDOM_WAN, RANDOM_VAE, cfg.sampler, cfg.deterministic)
    else:
        text_dim = check_folders(cfg.transformer, cfg.vae, cfg.sampler, cfg.deterministic)
    load_prompts(cfg, text_dim)


def run_command(args, parser) -> int:
    from ..distributed.launcher import RankError, init_from_env, launch
    from ..distributed.torchrun import under_torchrun
    from ..errors import one_line
    from ..memory import check_local_cores, check_local_ranks

    from ..rl.spot_config import from_args as spot_of

    try:
        cfg = config_of(args)
        spot = spot_of(args)
        spot.check(cfg.group_size, cfg.sp)
        preflight(cfg)
    except ImportError as e:  # diffusers missing
        parser.error(f"ditsp rl needs diffusers (pip install 'ditsp[diffusers]'): {e}")
    except ValueError as e:
        parser.error(one_line(str(e)))
    torchrun = under_torchrun()
    if not torchrun:
        try:
            check_local_ranks(cfg.sp)
            crowded = check_local_cores(cfg.sp)
        except ValueError as e:
            parser.error(str(e))
        if crowded:
            print(f"ditsp rl: warning: {crowded}", file=sys.stderr)
    if cfg.random_weights:
        print("ditsp rl: RANDOM WEIGHTS: a seeded tiny Wan and VAE (--random-weights), a test, not a model",
              file=sys.stderr)
    from ..rl.loop import rank_rl
    from ..rl.scheduler import SpotError
    from ..rl.spot_run import explore_line, rank_spot_run

    if spot.explore != "none":  # seed exploration (docs/rl.md): the loop with its hooks wired
        rank_rl = functools.partial(rank_spot_run, spot=spot)
    try:
        if torchrun:
            ctx = init_from_env(timeout_s=args.timeout)
            if ctx.world_size != cfg.sp:
                parser.error(f"--sp {cfg.sp} but the torchrun job has {ctx.world_size} ranks")
            result = rank_rl(ctx, cfg)
            if ctx.rank != 0:
                return 0
        elif cfg.sp == 1:
            import torch

            from ..distributed.launcher import RankContext

            result = rank_rl(RankContext(0, 1, None, torch.device("cpu")), cfg)
        else:
            result = launch(rank_rl, cfg.sp, cfg, timeout_s=args.timeout)[0]
    except (RankError, ValueError, OSError, SpotError) as e:  # a rank's report: its first line names the cause
        print(f"ditsp rl: {str(e).splitlines()[0] if isinstance(e, RankError) else one_line(str(e))}",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({**result, "config": asdict(cfg)}))
        return 0
    ratio = result["first_update_ratio"]
    print(f"rl {cfg.reward}: {result['steps']} steps (from {result['resumed_from']}) at SP {result['sp']}"
          f"{' deterministic' if cfg.deterministic else ''}; held-out reward {result['eval_before']:.6g} -> "
          f"{result['eval_after']:.6g}; first-update ratios {ratio[0]!r}..{ratio[1]!r}; "
          f"{result['s_per_step']} s/step; {cfg.out}" if ratio else
          f"rl {cfg.reward}: {result['steps']} steps; held-out reward {result['eval_after']:.6g}; {cfg.out}")
    if "cost" in result:
        print(explore_line(result))
    return 0
