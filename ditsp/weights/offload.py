"""Blocks kept in host memory, each brought to the device ahead of its turn (``--offload-blocks N``).

:class:`BlockOffload` takes a model's sequence of blocks (run in order, once per forward) and keeps
the first ``n`` in host memory (pinned where the device is CUDA). Hooks on every block bring an
offloaded block's tensors to the device before it runs and drop the device copy after it: when
block ``i`` starts, the next offloaded block's copy is started too, so it travels while block
``i`` computes. On CUDA the copies go on a side stream (``non_blocking`` from pinned memory) and the
compute stream waits on the copy's event only when the block's turn comes; each device copy is
freed on the compute stream's schedule (``record_stream``). A device holds the blocks not
offloaded plus at most two offloaded ones (the running one and the next).

Only parameters and buffers move (a quantized weight's stored bytes included: it stays quantized in
both places); the model code does not change. On a CPU the device is the host: the mechanism runs
the same way (each block copied before its turn, the copy dropped after), which is what the tests
check for equal outputs; the overlap is a CUDA-stream property that is not claimed until measured
on a device.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def _tensors(block: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``block`` (each once), in a fixed order."""
    seen, out = set(), []
    for t in list(block.parameters()) + list(block.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


class BlockOffload:
    """The first ``n`` of ``blocks`` kept on the host, brought to ``device`` in turn (see the module doc)."""

    def __init__(self, blocks: Sequence[nn.Module], n: int, device: torch.device | str):
        if n < 0:
            raise ValueError(f"offload blocks must be >= 0, got {n}")
        self.blocks = list(blocks)
        self.device = torch.device(device)
        self.offloaded = list(range(min(int(n), len(self.blocks))))
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.index = {id(b): i for i, b in enumerate(self.blocks)}
        self.host: dict[int, list[torch.Tensor]] = {}
        self.live: dict[int, tuple[list[torch.Tensor], object]] = {}
        self.fetches = 0  # device copies made
        self.exposed = 0  # copies not started ahead of their block's turn
        self.bytes_copied = 0
        for i in self.offloaded:
            ts = _tensors(self.blocks[i])
            host = []
            for t in ts:
                h = t.data.to("cpu", copy=True)
                if self.cuda:
                    h = h.pin_memory()
                t.data = h
                host.append(h)
            self.host[i] = host
        self._hooks = []
        for b in self.blocks:
            self._hooks.append(b.register_forward_pre_hook(self._pre))
            self._hooks.append(b.register_forward_hook(self._post))

    @property
    def host_bytes(self) -> int:
        """Bytes of the blocks kept on the host."""
        return sum(h.numel() * h.element_size() for hs in self.host.values() for h in hs)

    def _fetch(self, i: int) -> None:
        if i in self.live or i not in self.host:
            return
        host = self.host[i]
        if self.cuda:
            with torch.cuda.stream(self.stream):
                dev = [h.to(self.device, non_blocking=True) for h in host]
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            dev = [h.to(self.device, copy=True) for h in host]
            event = None
        self.live[i] = (dev, event)
        self.fetches += 1
        self.bytes_copied += sum(h.numel() * h.element_size() for h in host)

    def _next(self, i: int) -> int | None:
        return next((j for j in self.offloaded if j > i), None)

    def _pre(self, module: nn.Module, args) -> None:
        i = self.index[id(module)]
        if i in self.host:
            if i not in self.live:
                self.exposed += 1
                self._fetch(i)
            dev, event = self.live[i]
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
            for t, d in zip(_tensors(module), dev):
                t.data = d
        j = self._next(i)
        if j is not None:
            self._fetch(j)  # travels while block i runs

    def _post(self, module: nn.Module, args, output) -> None:
        i = self.index[id(module)]
        if i not in self.host:
            return
        dev, _ = self.live.pop(i)
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            for d in dev:
                d.record_stream(current)
        for t, h in zip(_tensors(module), self.host[i]):
            t.data = h

    def remove(self) -> None:
        """Remove the hooks and put every offloaded block on the device for good."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for i in list(self.host):
            for t in _tensors(self.blocks[i]):
                t.data = t.data.to(self.device)
        self.host.clear()
        self.live.clear()

    def report(self) -> dict:
        return {"offloaded_blocks": len(self.offloaded), "host_bytes": self.host_bytes, "fetches": self.fetches,
                "exposed_fetches": self.exposed, "bytes_copied": self.bytes_copied,
                "overlap": "cuda stream" if self.cuda else "none (the device is the host)"}


def offload_blocks(model: nn.Module, n: int, device: torch.device | str | None = None) -> BlockOffload | None:
    """Keep the first ``n`` of ``model.blocks`` on the host (None when ``n`` is 0); kept on the model
    as ``model.block_offload``."""
    if not n:
        return None
    if device is None:
        device = next((t.device for t in model.parameters()), torch.device("cpu"))
    off = BlockOffload(model.blocks, n, device)
    model.block_offload = off
    return off
