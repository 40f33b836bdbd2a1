"""The GPUs `ditsp plan --gpu` sizes a job for: memory, dense bf16 matmul rate, memory bandwidth, and the link
between the GPUs of one box, as the vendors publish them (none measured by ditsp; each row says its source).

Memory is the nominal capacity read as GiB (what the device reports is within a few percent of it). The bf16
rate is the dense tensor-core rate with float32 accumulation (half the figure quoted "with sparsity"). The
link figure is per GPU and per direction: half the bidirectional NVLink total, or a x16 PCIe slot's one-way
rate (GPUs without NVLink exchange over PCIe, through the host).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

SPEC_SHEET = "vendor datasheet"
WHITEPAPER = "vendor architecture whitepaper"


@dataclass(frozen=True)
class Gpu:
    name: str  # what --gpu takes
    label: str
    memory_gib: float
    bf16_tflops: float  # dense, float32 accumulation
    memory_tbs: float  # device memory bandwidth, TB/s
    link: str  # "NVLink 4" or "PCIe 4.0 x16"
    link_gbs: float  # GB/s per GPU per direction
    source: str

    @property
    def nvlink(self) -> bool:
        return self.link.startswith("NVLink")

    def describe(self) -> str:
        return (f"{self.label}: {self.memory_gib:g} GiB, bf16 {self.bf16_tflops:g} TFLOP/s dense, memory "
                f"{self.memory_tbs:g} TB/s, {self.link} {self.link_gbs:g} GB/s per direction ({self.source})")

    def as_dict(self) -> dict:
        return asdict(self)


TABLE = (
    Gpu("b200", "B200 (HGX, 180 GB)", 180, 2250, 8.0, "NVLink 5", 900, SPEC_SHEET),
    Gpu("h200", "H200 SXM (141 GB)", 141, 989, 4.8, "NVLink 4", 450, SPEC_SHEET),
    Gpu("h100", "H100 SXM (80 GB)", 80, 989, 3.35, "NVLink 4", 450, SPEC_SHEET),
    Gpu("a100", "A100 SXM (80 GB)", 80, 312, 2.039, "NVLink 3", 300, SPEC_SHEET),
    Gpu("l40s", "L40S (48 GB)", 48, 362, 0.864, "PCIe 4.0 x16", 32, SPEC_SHEET),
    Gpu("5090", "GeForce RTX 5090 (32 GB)", 32, 209.5, 1.792, "PCIe 5.0 x16", 64, WHITEPAPER),
    Gpu("4090", "GeForce RTX 4090 (24 GB)", 24, 165.2, 1.008, "PCIe 4.0 x16", 32, WHITEPAPER),
    Gpu("3090", "GeForce RTX 3090 (24 GB)", 24, 71, 0.936, "PCIe 4.0 x16", 32, WHITEPAPER),
)
BY_NAME = {g.name: g for g in TABLE}
NAMES = tuple(g.name for g in TABLE)


def gpu(name: str) -> Gpu:
    """The row named ``name`` (case-insensitive); ValueError naming the choices otherwise."""
    try:
        return BY_NAME[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; choose one of {', '.join(NAMES)}") from None
