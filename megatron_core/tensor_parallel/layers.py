"""Column-, row- and vocab-parallel layers (Megatron's tensor-parallel building blocks).

Weights are [out, in] like nn.Linear. Sharded parameters carry `tensor_model_parallel = True`
and `partition_dim` (0 for column-parallel rows, 1 for row-parallel columns), and `vocab_padded = True`
when that dim is the padded vocabulary; these attributes are the model's one statement of its
sharding (`declared_sharding`, which checkpoint merging and splitting read). Replicated
parameters that see only this rank's sequence chunk under sequence parallelism carry
`sequence_parallel = True`, so the trainer all-reduces their gradients across TP.

Initialization has one path: each layer declares how its parameters are drawn (`param.init_method`,
see declare_init) and `initialize_parameter` draws them. It is layout-independent: the FULL
(master) weight is drawn on every rank from the same generator and each rank keeps its slice, so
TP 2 starts from exactly the weights of TP 1. A layer built with `initialize=False` (what GPTModel
does, Megatron's `perform_initialization=False`) draws nothing until its owner initializes it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_core import parallel_state
from megatron_core.checkpoint_format import TensorSharding
from megatron_core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

# init_method(master_weight, generator) fills a full-size fp32 tensor in place.
InitMethod = Callable[[torch.Tensor, Optional[torch.Generator]], None]


def normal_init(std: float) -> InitMethod:
    def init(tensor: torch.Tensor, generator: Optional[torch.Generator]) -> None:
        tensor.normal_(0.0, std, generator=generator)

    return init


def zeros_init(tensor: torch.Tensor, _generator: Optional[torch.Generator] = None) -> None:
    tensor.zero_()


def ones_init(tensor: torch.Tensor, _generator: Optional[torch.Generator] = None) -> None:
    tensor.fill_(1.0)


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


def set_tensor_model_parallel_attributes(param: torch.Tensor, partition_dim: int, vocab_padded: bool = False) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1
    param.vocab_padded = vocab_padded


def is_tensor_model_parallel(param: torch.Tensor) -> bool:
    return getattr(param, "tensor_model_parallel", False)


def declared_sharding(param: torch.Tensor) -> TensorSharding:
    """How `param` lies across TP ranks, read from the attributes its layer set (replicated when none)."""
    if not is_tensor_model_parallel(param):
        return TensorSharding(partition_dim=None)
    return TensorSharding(partition_dim=param.partition_dim, vocab_padded=getattr(param, "vocab_padded", False))


def declare_init(param: torch.Tensor, init_method: InitMethod) -> torch.Tensor:
    """Record how `param` is drawn: what initialize_parameter uses unless told otherwise."""
    param.init_method = init_method
    return param


@torch.no_grad()
def initialize_parameter(
    param: torch.Tensor, init_method: Optional[InitMethod] = None, generator: Optional[torch.Generator] = None
) -> None:
    """Fill `param` with this rank's slice of a full master tensor drawn by `init_method` (default:
    the one declared on it; Megatron's `_initialize_affine_weight_cpu`). Parameters on the meta
    device are left alone."""
    init_method = init_method or getattr(param, "init_method", None)
    if init_method is None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} declares no init_method (see declare_init)")
    if param.is_meta:
        return
    world = parallel_state.get_tensor_model_parallel_world_size() if is_tensor_model_parallel(param) else 1
    shape = list(param.shape)
    if world > 1:
        shape[param.partition_dim] *= world
    master = torch.empty(shape, dtype=torch.float32)
    init_method(master, generator)
    if world > 1:
        master = master.chunk(world, dim=param.partition_dim)[parallel_state.get_tensor_model_parallel_rank()]
    param.copy_(master)


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    *,
    sequence_parallel: bool = False,
    gather_output: bool = False,
) -> torch.Tensor:
    """y = x W^T + b with W split by output rows. x is replicated ([*, h]) or, under sequence
    parallelism, this rank's sequence chunk ([s/tp, b, h]) that is all-gathered first."""
    if sequence_parallel:
        x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
    else:
        x = copy_to_tensor_model_parallel_region(x)
    y = F.linear(x, weight, bias)
    return gather_from_tensor_model_parallel_region(y) if gather_output else y


class ColumnParallelLinear(nn.Module):
    """Linear layer whose output features are split across TP ranks: weight [out/tp, in].
    `vocab_padded`: the output features are the padded vocabulary (an untied output layer)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        gather_output: bool = False,
        init_method: InitMethod = normal_init(0.02),
        sequence_parallel: bool = False,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
        initialize: bool = True,
        vocab_padded: bool = False,
    ) -> None:
        super().__init__()
        world = parallel_state.get_tensor_model_parallel_world_size()
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, world, "output size")
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.skip_bias_add = skip_bias_add
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output is not supported with sequence_parallel")
        self.weight = nn.Parameter(
            torch.empty(self.output_size_per_partition, input_size, dtype=params_dtype, device=device)
        )
        set_tensor_model_parallel_attributes(
            declare_init(self.weight, init_method), partition_dim=0, vocab_padded=vocab_padded
        )
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(
                declare_init(self.bias, zeros_init), partition_dim=0, vocab_padded=vocab_padded
            )
        else:
            self.register_parameter("bias", None)
        if initialize:
            self.reset_parameters()

    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        initialize_parameter(self.weight, generator=generator)
        if self.bias is not None:
            initialize_parameter(self.bias)

    def forward(self, x: torch.Tensor):
        bias = None if self.skip_bias_add else self.bias
        y = column_parallel_linear(
            x, self.weight, bias, sequence_parallel=self.sequence_parallel, gather_output=self.gather_output
        )
        return (y, self.bias) if self.skip_bias_add else y


class RowParallelLinear(nn.Module):
    """Linear layer whose input features are split across TP ranks: weight [out, in/tp].

    The partial products are all-reduced (or reduce-scattered along the sequence under sequence
    parallelism) and the bias, which is whole on every rank, is added AFTER the reduce.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        init_method: InitMethod = normal_init(0.02),
        sequence_parallel: bool = False,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
        initialize: bool = True,
    ) -> None:
        super().__init__()
        world = parallel_state.get_tensor_model_parallel_world_size()
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, world, "input size")
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.skip_bias_add = skip_bias_add
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.weight = nn.Parameter(
            torch.empty(output_size, self.input_size_per_partition, dtype=params_dtype, device=device)
        )
        set_tensor_model_parallel_attributes(declare_init(self.weight, init_method), partition_dim=1)
        if bias:
            self.bias = declare_init(
                nn.Parameter(torch.empty(output_size, dtype=params_dtype, device=device)), zeros_init
            )
            # Under SP each rank adds the bias to its own sequence chunk: grads must be summed over TP.
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)
        if initialize:
            self.reset_parameters()

    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        initialize_parameter(self.weight, generator=generator)
        if self.bias is not None:
            initialize_parameter(self.bias)

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial)
        else:
            y = reduce_from_tensor_model_parallel_region(partial)
        if self.skip_bias_add:
            return y, self.bias
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows: weight [V/tp, h], this rank owns ids
    [vocab_start_index, vocab_end_index). Ids elsewhere look up zeros and the all-reduce (or,
    with `reduce_scatter_output`, a reduce-scatter along dim 0 for sequence parallelism:
    pass ids as [s, b]) fills them in from their owners."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: InitMethod = normal_init(0.02),
        reduce_scatter_output: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
        initialize: bool = True,
    ) -> None:
        super().__init__()
        world = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_partition = divide(num_embeddings, world, "vocabulary size")
        self.vocab_start_index = rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.reduce_scatter_output = reduce_scatter_output
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype, device=device)
        )
        set_tensor_model_parallel_attributes(declare_init(self.weight, init_method), partition_dim=0, vocab_padded=True)
        if initialize:
            self.reset_parameters()

    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        initialize_parameter(self.weight, generator=generator)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            out = F.embedding(input_ids, self.weight)
        else:
            outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
            local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
            out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_output:
            return reduce_scatter_to_sequence_parallel_region(out)
        return reduce_from_tensor_model_parallel_region(out)
