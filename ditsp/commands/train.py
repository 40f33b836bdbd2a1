"""`ditsp train`: train the SeedVR2 DiT (one-step restoration, frozen VAE) or the VAE, on local ranks or torchrun.

``--sp N`` spawns N local gloo ranks (under torchrun: joins the job, one SP
group of all its ranks); the DiT then runs forward and backward under window
SP. ``--check`` runs step 0 on one device and on the SP group and prints the
largest gradient difference instead of training.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from ..argtypes import nonneg_float, positive_float, timeout_seconds
from .common import add_compile_arg, positive_int


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train the DiT (one-step restoration) or the VAE under SP")
    p.add_argument("--objective", default="dit", choices=["dit", "vae"],
                   help="dit: one-step x0 regression at t=1000 against a frozen VAE; vae: reconstruction (one device)")
    p.add_argument("--out", default="out/train", help="directory: checkpoint.pt, <module>.safetensors, loss.png, report.json")
    p.add_argument("--steps", type=positive_int, default=100)
    p.add_argument("--batch", type=positive_int, default=2, help="clips per step")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate (a finite number > 0)")
    p.add_argument("--weight-decay", type=nonneg_float, default=0.01, help="AdamW weight decay (>= 0)")
    p.add_argument("--clip", type=positive_float, default=1.0, help="gradient-norm clip (a finite number > 0)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (weights and optimizer stay fp32)")
    p.add_argument("--seed", type=int, default=0, help="data, noise and everything drawn: a run is a function of it")
    p.add_argument("--frames", type=positive_int, default=5, help="frames per clip (kn + 1, k the VAE's time factor)")
    p.add_argument("--size", default="32x32", metavar="WxH[,WxH...]",
                   help="clean clip size (multiples of the VAE's space factor x 2); several: taken in turn, step by step")
    p.add_argument("--sp", type=positive_int, default=1, help="SP degree: local ranks (under torchrun: the job's ranks)")
    p.add_argument("--path", default="window", choices=["window", "halo"], help="Plan A (window) or Plan B (halo)")
    p.add_argument("--planner", default="lpt", choices=["lpt", "locality"])
    p.add_argument("--model", default="tiny", choices=["tiny", "tiny-7b"])
    p.add_argument("--dit", metavar="SAFETENSORS", help="initial DiT weights (default: seeded)")
    p.add_argument("--vae", metavar="SAFETENSORS", help="VAE weights (frozen under --objective dit; default: seeded)")
    p.add_argument("--dit-loss", default="mse", choices=["mse", "l1", "l1-ssim"],
                   help="the DiT's x0 regression distance (l1-ssim: L1 plus 1 - SSIM over the latent channels)")
    p.add_argument("--freeze", default="", metavar="PREFIXES", help="comma-separated DiT parameter-name prefixes to keep fixed")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each DiT block in the backward")
    p.add_argument("--checkpoint-every", type=positive_int, default=50)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt (bit-exact)")
    p.add_argument("--check", action="store_true", help="one step on one device vs SP: print the max gradient difference")
    add_compile_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON report")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--timeout", type=timeout_seconds, default=600.0,
                   help="seconds a rank may go without progress (no collective completed) before it counts as stuck")
    p.set_defaults(func=run)
    return p


def config_of(args):
    from ..train.loop import TrainConfig

    sizes = []
    for part in args.size.split(","):
        try:
            w, h = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"--size must be WxH (or several, comma-separated), got {args.size!r}") from None
        sizes.append((h, w))
    return TrainConfig(objective=args.objective, out=args.out, steps=args.steps, batch=args.batch, lr=args.lr,
                       weight_decay=args.weight_decay, clip=args.clip, bf16=args.bf16, seed=args.seed,
                       frames=args.frames, size=sizes[0] if len(sizes) == 1 else tuple(sizes), sp=args.sp, path=args.path, planner=args.planner,
                       model=args.model, dit=args.dit, vae=args.vae, dit_loss=args.dit_loss,
                       freeze=tuple(s for s in args.freeze.split(",") if s),
                       activation_checkpointing=args.activation_checkpointing, compile=args.compile,
                       checkpoint_every=args.checkpoint_every, resume=args.resume,
                       progress=not (args.no_progress or args.json), json=args.json)


def check_local(parser, n: int) -> None:
    """Refuse (one line) ``n`` local ranks this machine cannot hold, before any starts: their processes'
    memory (:func:`ditsp.memory.check_local_ranks`, as `upscale` and `run`) or more than
    :data:`~ditsp.memory.RANKS_PER_CORE_LIMIT` per CPU core; warn when they outnumber the cores."""
    from ..memory import check_local_cores, check_local_ranks

    try:
        check_local_ranks(n)
        warning = check_local_cores(n)
    except ValueError as e:
        parser.error(str(e))
    if warning:
        print(f"ditsp train: warning: {warning}", file=sys.stderr)


def run(args, parser) -> int:
    from ..distributed.launcher import RankError, init_from_env, launch
    from ..distributed.torchrun import under_torchrun
    from ..errors import one_line
    from ..train.loop import check, rank_check, rank_train

    try:
        cfg = config_of(args)
    except ValueError as e:
        parser.error(str(e))
    torchrun = under_torchrun()
    if not torchrun:
        check_local(parser, cfg.sp)
    fn = rank_check if args.check else rank_train
    try:
        if torchrun:
            ctx = init_from_env(timeout_s=args.timeout)
            if ctx.world_size != cfg.sp:
                parser.error(f"--sp {cfg.sp} but the torchrun job has {ctx.world_size} ranks")
            result = fn(ctx, cfg)
            if ctx.rank != 0:
                return 0
        elif cfg.sp == 1 and not args.check:
            from ..distributed.launcher import RankContext
            import torch

            result = rank_train(RankContext(0, 1, None, torch.device("cpu")), cfg)
        else:
            result = launch(fn, cfg.sp, cfg, timeout_s=args.timeout)[0]
        if args.check:
            result = {"check": check(cfg, result), "sp": cfg.sp, "path": cfg.path, "objective": cfg.objective}
    except (RankError, ValueError, OSError) as e:  # a rank's report: its first line names the cause on each rank
        print(f"ditsp train: {str(e).splitlines()[0] if isinstance(e, RankError) else one_line(str(e))}",
              file=sys.stderr)
        return 1
    if args.check:
        if not args.json:
            c = result["check"]
            print(f"one step, SP={cfg.sp} ({cfg.path}) vs one device: loss {c['loss_sp']:.6g} vs "
                  f"{c['loss_one_device']:.6g}; max |grad diff| {c['max_grad_diff']:.3g} "
                  f"(max |grad| {c['max_grad']:.3g}, relative {c['relative']:.2g})")
    elif not args.json:
        print(f"trained {cfg.objective}: {result['steps']} steps (from {result['resumed_from']}), "
              f"loss {result['first_loss']:.4g} -> {result['final_loss']:.4g}, {result['s_per_step']} s/step "
              f"({result['compile']}); "
              f"weights in {cfg.out}")
    if args.json:
        print(json.dumps({**result, "config": asdict(cfg)} if not args.check else result))
    return 0
