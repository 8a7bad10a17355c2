"""Tensor-parallel building blocks: f/g mappings, parallel layers, vocab-parallel CE, RNG tracker."""

from megatron_core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    declare_init,
    initialize_parameter,
    is_tensor_model_parallel,
    normal_init,
    ones_init,
    set_tensor_model_parallel_attributes,
    zeros_init,
)
from megatron_core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_core.tensor_parallel.random import (
    RNGStatesTracker,
    checkpoint,
    get_rng_tracker,
    model_parallel_manual_seed,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "column_parallel_linear",
    "declare_init",
    "initialize_parameter",
    "is_tensor_model_parallel",
    "normal_init",
    "ones_init",
    "zeros_init",
    "set_tensor_model_parallel_attributes",
    "vocab_parallel_cross_entropy",
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "RNGStatesTracker",
    "checkpoint",
    "get_rng_tracker",
    "model_parallel_manual_seed",
]
