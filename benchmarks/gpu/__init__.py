"""``make gpu-check``: the acceptance run of ditsp on a GPU, one command, bounded in time.

:mod:`.check` starts :mod:`.runner` in a child process and watches it: each step has a time budget,
a step that overruns is cut off (its process killed) and the run goes on with the next one in a
fresh child, and every finished row goes to ``results.json`` and ``results.md`` at once (atomic
writes, :mod:`.report`), so a run cut off anywhere still reports what it did. The steps, in order:
``env`` (versions, measured matmul rate and copy bandwidth), ``attention`` (the kernel table against
the reference), ``dit`` (3B and 7B NaDiT at released widths), ``vae`` (released VAE, every exact
mode), ``compile`` (``--compile`` against eager), ``fp8`` (``_scaled_mm`` against bf16) and
``ranks`` (NCCL, and two ranks sharing the device over gloo). :mod:`.profiles` holds the sizes: the
``gpu`` profile for the real run, ``tiny`` for the same code on a CPU in seconds (the suite runs it,
tests/test_gpu_check.py). docs/gpu.md says how to run it on a lent GPU.
"""
