"""GRPO post-training of a flow-matching video DiT under SP (``ditsp rl``).

The model is a diffusers Wan transformer (``WanTransformer3DModel``, text to
video) run under Ulysses SP through :mod:`ditsp.integrations.diffusers`, with
its VAE (``AutoencoderKLWan``) decoding frames for the rewards. Everything a
rank computes is a function of the run's settings and seeds: every rank of a
group draws the same noise from the same seed, and under ``deterministic``
the transformer's kernel calls have shapes the SP degree never sets
(:mod:`ditsp.integrations.diffusers.fixed`), so a rollout sampled at one SP
degree and the training forward at another give the same log-probabilities
bit for bit.

The interface other code builds on (stable; every function is called on every
rank of a policy's group with the same arguments, and returns the same value
on every rank):

``policy.py`` (the model and the sampler)

- ``SamplerConfig(steps=8, shift=3.0, window=(0, 4), noise_level=0.7,
  frames=5, height=32, width=32)``: the flow-matching schedule (``steps``
  Euler steps over shifted sigmas from 1 to 0); steps ``window[0] <= i <
  window[1]`` are stochastic (SDE), the others deterministic (ODE).
- ``Rollout``: ``prompt`` (index), ``seed``, ``latents`` (float32
  ``[steps + 1, C, F, H, W]``: the trajectory, pure noise first),
  ``log_probs`` (float64 ``[window length]``: the log-density of each SDE
  step's sample, a mean over the latent's elements), ``frames`` (uint8
  ``[F, H, W, 3]`` or None when not decoded), ``reward`` (float or None).
- ``Models(transformer, vae, source)`` from ``load_models(transformer_dir,
  vae_dir)`` (diffusers ``save_pretrained`` folders, local files only) or
  ``random_models(seed)`` (the seeded tiny Wan of tests and benchmarks);
  ``seeded_prompts(n, dim, seed)``: prompt embeddings for tests.
- ``Policy(models, group=None, deterministic=False)``: one rank's transformer
  under Ulysses SP on ``group`` (every rank of it builds one), the VAE, the
  kernel policy. ``policy.weights()`` (a CPU copy of the trainable weights by
  name), ``policy.load_weights(state)`` (e.g. the previous step's weights:
  stale-weight exploration), ``policy.velocity(latents, sigma, embeds)``,
  ``policy.decode(latents) -> uint8 frames``, ``policy.comm`` (the group).
- ``sample(policy, prompt_embeds, seed, cfg, prompt=0, reward=None,
  ode=False, decode=True) -> Rollout``: one trajectory from ``seed``
  (``prompt_embeds`` ``[1, L, D]``); ``reward`` (a name of
  :data:`ditsp.rl.rewards.REWARDS` or a callable on the frames) fills
  ``reward``; ``ode=True`` is the deterministic sampler (evaluation; no
  ``log_probs``).
- ``score(policy, rollouts, reward) -> list[float]``: decode and score many
  rollouts, split across the group's ranks, every reward on every rank.

``rewards.py``: ``REWARDS`` (name -> :class:`~ditsp.rl.rewards.Reward`, its
``fn(frames uint8 [F, H, W, 3]) -> float``), ``reward(name)``.

``grpo.py`` (the objective and one update)

- ``GRPOConfig(clip=1e-4, adv_clip=5.0, kl=0.0, lr=1e-4, weight_decay=1e-4,
  grad_clip=1.0, updates=2)``.
- ``advantages(rewards [P, n], clip) -> [P, n]``: per prompt, (reward - mean)
  / (std + eps), clipped to +-clip.
- ``step_log_prob(policy, rollout, i, embeds, sampler) -> (log_prob, mean,
  std)``: SDE step ``i`` of a rollout under the policy's current weights
  (autograd follows the caller's mode).
- ``Trainer(policy, sampler, cfg, reference=None)``: AdamW on the policy's
  weights; ``trainer.update(rollouts, advantages, prompts, step) ->
  UpdateStats`` (``prompts[rollout.prompt]`` its embeddings) runs
  ``cfg.updates`` optimizer steps over the rollouts (PPO-clip, KL to
  ``reference`` when ``cfg.kl > 0``); ``UpdateStats.first_ratios`` holds the
  importance ratio of every (rollout, step) pair of the first update.

``loop.py`` (a run)

- ``RLConfig`` (every setting of ``ditsp rl``) and ``run(cfg, group=None,
  choose_seeds=None, after_step=None) -> report``, i.e. ``Run(cfg, group,
  choose_seeds, after_step).run()``; a ``Run`` also offers its parts:
  ``run.rollouts(step)`` (scored), ``run.evaluate()`` (the held-out mean
  reward), ``run.train_step()``, ``run.policy``, ``run.train_prompts``.
- ``choose_seeds(SeedRequest(step, prompt, n, default)) -> n seeds``: where
  exploration plugs in; ``default`` are the seeds the run uses without it
  (``default_seeds(seed, step, prompt, n)``). Called on every rank; the ranks
  must return the same seeds (checked).
- ``after_step(step, policy, stats)``: called after each update (e.g. to copy
  ``policy.weights()`` for stale-weight exploration).
"""
