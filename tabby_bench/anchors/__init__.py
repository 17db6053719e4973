"""Anchors: the baselines Tabby is measured against, each with moe_reference's signature.

- ``torch-a2a`` (:func:`moe_torch_a2a`): the plain PyTorch EP layer (NCCL all_to_all, host-synced
  splits, ``torch._grouped_mm``).
- ``torch-symm`` (:func:`moe_torch_symm`): the sync-free PyTorch path over NVSHMEM symmetric memory
  (``all_to_all_vdev_2d`` / ``all_to_all_vdev_2d_offset``), as torchtitan does it.
- the compute-only floor (:mod:`tabby_bench.anchors.floor`): the same routed rows through
  ``torch._grouped_mm`` on one GPU, no communication, no permutation.
"""
from .torch_a2a import moe_torch_a2a
from .torch_symm import moe_torch_symm

__all__ = ["moe_torch_a2a", "moe_torch_symm"]
