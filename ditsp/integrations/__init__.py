"""Third-party models under ditsp sequence parallelism (``diffusers``: :func:`ditsp.integrations.diffusers.parallelize`)."""
