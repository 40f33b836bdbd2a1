"""CPU-only tuning: what ditsp does to run fast on a CPU, every trick named here with where it lives.

None of it matters on a GPU; each trick is kept because a measurement says it pays on CPU (the file named
with each). The generic ones live in this package; the ones tied to a model or a collective live beside
the code they speed up. Each is switched by a field of :class:`ditsp.cpu.settings.CpuSettings` (one per
process, each overridable by a ``DITSP_*`` environment variable; docs/configuration.md has the table).

- :mod:`ditsp.cpu.gemm`: float32 linears through oneDNN instead of the BLAS (2.2x on AMD's AVX-512,
  ``benchmarks/results/speed.md``).
- :mod:`ditsp.cpu.malloc`: how glibc serves torch's big buffers (the ``reuse`` allocator policy: no page
  faults and kernel page clearing per window, ``benchmarks/results/malloc.md``); spawned ranks and server
  workers start under it, the ``ditsp`` program only when asked to restart itself under it.
- :mod:`ditsp.distributed.shm_gather`: all-gathers between the ranks of one machine through shared
  memory instead of gloo's sockets (``benchmarks/results/gather.md``).
- :mod:`ditsp.models.seedvr2.vae.winograd`: the VAE's wide 3x3x3 convs by Winograd F(4x4, 3x3) under
  the fast policy (``benchmarks/results/vae-winograd.md``).
- :mod:`ditsp.models.seedvr2.vae.channels_last`: the VAE's activations channels-last under the fast
  policy, the layout oneDNN's convs compute in (``benchmarks/results/vae-layout.md``).
"""
