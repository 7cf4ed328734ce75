"""RLx2 dynamic sparse training: masks, ERK/uniform densities, RigL/SET topology, FLOPs.

Pure torch; wraps any ``nn.Module`` and its optimizer (see :class:`SparseTrainer`).
:class:`SparseConfig` is the spec's ``sparse`` section; algorithms apply it through
``Algorithm.sparsify``.
"""

from rlfabric.sparse.config import SparseConfig
from rlfabric.sparse.distribution import layer_active_counts, layer_densities, sparsifiable_layers
from rlfabric.sparse.flops import ForwardFlops, LayerFlops, forward_flops, training_flops
from rlfabric.sparse.topology import drop_and_grow, drop_fraction, is_update_step
from rlfabric.sparse.trainer import SparseTrainer

__all__ = [
    "ForwardFlops",
    "LayerFlops",
    "SparseConfig",
    "SparseTrainer",
    "drop_and_grow",
    "drop_fraction",
    "forward_flops",
    "is_update_step",
    "layer_active_counts",
    "layer_densities",
    "sparsifiable_layers",
    "training_flops",
]
