"""The GPUs ``python -m minifsdp plan`` knows: memory, dense peak FLOP/s and link speeds, each from a datasheet.

A plan's time bound is only as good as the figures it divides by, so every card below carries its source, and
the figures are the vendor's *dense* ones (NVIDIA's datasheets print the Tensor Core figures "with sparsity",
twice the dense rate; the dense one is what a training step can reach).  Link speeds are per GPU and per
direction, in bits per second: NVLink's datasheet figure adds both directions, so 900 GB/s is 450 GB/s = 3,600
Gbit/s each way.  Between nodes a GPU gets its node's network divided among its GPUs (a DGX: one 400 Gb/s
ConnectX-7 per GPU).

Cards without NVLink (L4, GeForce) ring over PCIe inside a node; a card sold without a node design (L4,
GeForce) has no published network, so its "between nodes" speed is an assumption, said so in its source: give
your cluster's with ``--link-gbps``.  V100 has no bf16 Tensor Cores: bf16 runs at its fp32 rate there, fp16 at
its Tensor Core rate.

Note (the host link): CPU offload copies shards and gradients between the CPU's memory and the card over its host
link, PCIe x16 of the generation its datasheet names (``host_bps``, per direction; B200: Gen5 x16, as the DGX
B200's host switches), or on GH200 the NVLink-C2C to its Grace CPU.

Note (which "H100"): the 80 GB SXM5 part is the common one; the 94 GB is the H100 NVL (PCIe, lower clocks, its
NVLink bridge joins pairs only, so a ring over a node of 8 runs over PCIe); the 96 GB is the H100 with HBM3 of
Grace Hopper (GH200) and of some clusters' SXM boards (published runs report "95 GiB" for it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["GPU", "GPUS", "gpu", "with_links", "with_memory"]


@dataclass(frozen=True)
class GPU:
    """A GPU's published figures: memory (bytes), dense peak FLOP/s, link speeds per GPU and direction (bit/s)."""

    name: str
    memory: float
    fp32_flops: float
    bf16_flops: float
    intra_node_bps: float  # NVLink (or PCIe), per direction (the datasheet's NVLink figure is both directions added)
    inter_node_bps: float  # the node's network ports divided among its GPUs
    source: str
    fp16_flops: float = 0.0  # 0: as bf16 (a card whose fp16 and bf16 rates differ sets it: V100)
    host_bps: float = 0.0  # the link to the CPU's memory (PCIe, or GH200's NVLink-C2C), per direction, bit/s
    host_link: str = ""  # that link and where its figure is published (CPU offload's copies cross it)

    def flops(self, precision: str) -> float:
        if precision == "fp16":
            return self.fp16_flops or self.bf16_flops
        return self.fp32_flops if precision == "fp32" else self.bf16_flops


_PCIE4, _PCIE5 = 256e9, 512e9  # PCIe 4.0 / 5.0 x16: 32 / 64 GB/s each way
_ASSUMED = "; between nodes: not published for this card, 100 Gb/s per GPU assumed (give yours with --link-gbps)"

GPUS = {
    "a100-40": GPU("NVIDIA A100 SXM4 40GB", 40e9, 19.5e12, 312e12, 2400e9, 200e9,
                   "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB): FP32 19.5 TFLOPS, BF16/FP16 Tensor Core 312 "
                   "TFLOPS dense (624 with sparsity), NVLink 600 GB/s (300 GB/s each way); NVIDIA DGX A100 user "
                   "guide: 8x ConnectX-6 200 Gb/s HDR InfiniBand for compute, one per GPU"),
    "a100": GPU("NVIDIA A100 SXM4 80GB", 80e9, 19.5e12, 312e12, 2400e9, 200e9,
                "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): FP32 19.5 TFLOPS, BF16/FP16 Tensor Core 312 "
                "TFLOPS dense (624 with sparsity), NVLink 600 GB/s (300 GB/s each way); NVIDIA DGX A100 user "
                "guide: 8x ConnectX-6 200 Gb/s HDR InfiniBand for compute, one per GPU"),
    "h100": GPU("NVIDIA H100 SXM5 80GB", 80e9, 67e12, 989e12, 3600e9, 400e9,
                "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB, FP32 67 TFLOPS, BF16/FP16 Tensor Core 1,979 "
                "TFLOPS with sparsity (989 dense), NVLink 900 GB/s (450 GB/s each way); NVIDIA DGX H100 user "
                "guide: 8x ConnectX-7 400 Gb/s InfiniBand, one per GPU"),
    "h100-94": GPU("NVIDIA H100 NVL 94GB", 94e9, 60e12, 835e12, _PCIE5, 400e9,
                   "NVIDIA H100 Tensor Core GPU datasheet (H100 NVL): 94 GB, FP32 60 TFLOPS, BF16/FP16 Tensor Core "
                   "1,671 TFLOPS with sparsity (835 dense), NVLink bridge 600 GB/s between a pair only, PCIe Gen5 "
                   "128 GB/s (64 GB/s each way: a ring over the node); between nodes one 400 Gb/s port per GPU "
                   "assumed (as a DGX H100)"),
    "h100-96": GPU("NVIDIA H100 96GB (HBM3, as in GH200)", 96e9, 67e12, 989e12, 3600e9, 400e9,
                   "NVIDIA GH200 Grace Hopper Superchip datasheet: H100 with 96 GB HBM3, FP32 67 TFLOPS, BF16/FP16 "
                   "Tensor Core 1,979 TFLOPS with sparsity (989 dense), NVLink 900 GB/s (450 GB/s each way); "
                   "between nodes one 400 Gb/s ConnectX-7 per GPU (as a DGX H100)"),
    "h200": GPU("NVIDIA H200 SXM 141GB", 141e9, 67e12, 989e12, 3600e9, 400e9,
                "NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB, FP32 67 TFLOPS, BF16/FP16 Tensor Core "
                "1,979 TFLOPS with sparsity (989 dense), NVLink 900 GB/s (450 GB/s each way); NVIDIA DGX H200: "
                "8x ConnectX-7 400 Gb/s, one per GPU"),
    "b200": GPU("NVIDIA B200 180GB (HGX B200)", 180e9, 75e12, 2250e12, 7200e9, 400e9,
                "NVIDIA HGX B200 datasheet (8 GPUs): 1.4 TB HBM3e (180 GB each), FP32 600 TFLOPS (75 each), "
                "FP16/BF16 Tensor Core 36 PFLOPS with sparsity (2,250 TFLOPS dense each), NVLink 5 1.8 TB/s per "
                "GPU (900 GB/s each way); NVIDIA DGX B200: 8x ConnectX-7 400 Gb/s, one per GPU"),
    "l4": GPU("NVIDIA L4 24GB", 24e9, 30.3e12, 121e12, _PCIE4, 100e9,
              "NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6, FP32 30.3 TFLOPS, BF16/FP16 Tensor Core 242 TFLOPS "
              "with sparsity (121 dense), no NVLink: PCIe Gen4 x16 64 GB/s (32 GB/s each way)" + _ASSUMED),
    "rtx4090": GPU("NVIDIA GeForce RTX 4090 24GB", 24e9, 82.6e12, 165.2e12, _PCIE4, 100e9,
                   "NVIDIA Ada GPU architecture whitepaper (GeForce RTX 4090): 24 GB GDDR6X, FP32 82.6 TFLOPS, "
                   "FP16/BF16 Tensor with FP32 accumulate 165.2 TFLOPS dense (330.3 with sparsity), no NVLink: "
                   "PCIe Gen4 x16 (32 GB/s each way)" + _ASSUMED),
    "rtx3090": GPU("NVIDIA GeForce RTX 3090 24GB", 24e9, 35.6e12, 71e12, _PCIE4, 100e9,
                   "NVIDIA Ampere GA102 GPU architecture whitepaper (GeForce RTX 3090): 24 GB GDDR6X, FP32 35.6 "
                   "TFLOPS, FP16/BF16 Tensor with FP32 accumulate 71 TFLOPS dense (142 with sparsity); its NVLink "
                   "bridge joins two cards only: PCIe Gen4 x16 (32 GB/s each way) over a node" + _ASSUMED),
    "v100-16": GPU("NVIDIA V100 SXM2 16GB", 16e9, 15.7e12, 15.7e12, 1200e9, 50e9,
                   "NVIDIA V100 Tensor Core GPU datasheet (SXM2): 16 GB, FP32 15.7 TFLOPS, FP16 Tensor Core 125 "
                   "TFLOPS, no bf16 Tensor Cores (bf16 at the fp32 rate), NVLink 300 GB/s (150 GB/s each way); "
                   "NVIDIA DGX-1: 4x 100 Gb/s EDR InfiniBand for 8 GPUs (50 Gb/s each)", fp16_flops=125e12),
    "v100-32": GPU("NVIDIA V100 SXM2 32GB", 32e9, 15.7e12, 15.7e12, 1200e9, 50e9,
                   "NVIDIA V100 Tensor Core GPU datasheet (SXM2): 32 GB, FP32 15.7 TFLOPS, FP16 Tensor Core 125 "
                   "TFLOPS, no bf16 Tensor Cores (bf16 at the fp32 rate), NVLink 300 GB/s (150 GB/s each way); "
                   "NVIDIA DGX-1: 4x 100 Gb/s EDR InfiniBand for 8 GPUs (50 Gb/s each)", fp16_flops=125e12),
}
_HOST = {  # (bit/s each way, the source): what CPU offload's copies cross
    "pcie3": (128e9, "PCIe Gen3 x16, 32 GB/s (16 GB/s each way), the card's datasheet"),
    "pcie4": (_PCIE4, "PCIe Gen4 x16, 64 GB/s (32 GB/s each way), the card's datasheet"),
    "pcie5": (_PCIE5, "PCIe Gen5 x16, 128 GB/s (64 GB/s each way), the card's datasheet"),
    "c2c": (3600e9, "NVLink-C2C to the Grace CPU, 900 GB/s (450 GB/s each way), NVIDIA GH200 datasheet"),
}
for _name, _link in {"a100-40": "pcie4", "a100": "pcie4", "h100": "pcie5", "h100-94": "pcie5", "h100-96": "c2c",
                     "h200": "pcie5", "b200": "pcie5", "l4": "pcie4", "rtx4090": "pcie4", "rtx3090": "pcie4",
                     "v100-16": "pcie3", "v100-32": "pcie3"}.items():
    GPUS[_name] = dataclasses.replace(GPUS[_name], host_bps=_HOST[_link][0], host_link=_HOST[_link][1])

ALIASES = {"a100-80": "a100", "h100-80": "h100", "h100-nvl": "h100-94", "gh200": "h100-96", "v100": "v100-32"}


def _key(name: str) -> str:
    return "".join(c for c in str(name).lower() if c.isalnum())


def gpu(name: str) -> GPU:
    """A card by name, case and punctuation ignored ("H100", "rtx-4090", "A100_40"); an unknown one is an error
    that lists the known ones."""
    names = {_key(k): k for k in GPUS} | {_key(k): v for k, v in ALIASES.items()}
    if _key(name) not in names:
        raise ValueError(f"unknown --gpu {name!r}; known: {', '.join(GPUS)} (or give --gpu-memory and "
                         f"--link-gbps for another card)")
    return GPUS[names[_key(name)]]


def with_links(card: GPU, intra_gbps: float | None = None, inter_gbps: float | None = None) -> GPU:
    """``card`` with other link speeds (Gbit/s per GPU, each way), e.g. a cluster on slower Ethernet."""
    for v in (intra_gbps, inter_gbps):
        if v is not None and v <= 0:
            raise ValueError(f"link speeds must be positive Gbit/s, got {v}.")
    return dataclasses.replace(card, intra_node_bps=intra_gbps * 1e9 if intra_gbps else card.intra_node_bps,
                               inter_node_bps=inter_gbps * 1e9 if inter_gbps else card.inter_node_bps,
                               source=card.source + ("; link speeds given by the user" if intra_gbps or inter_gbps
                                                     else ""))


def with_memory(card: GPU, gigabytes: float) -> GPU:
    """``card`` with ``gigabytes`` (10^9 bytes) of memory, e.g. a 95 GB part or what another job leaves free."""
    if not gigabytes > 0:
        raise ValueError(f"--gpu-memory takes a positive number of GB, got {gigabytes}.")
    return dataclasses.replace(card, memory=gigabytes * 1e9, name=f"{card.name} ({gigabytes:g} GB given)",
                               source=card.source + f"; memory given by the user: {gigabytes:g} GB")
