"""GPT-2 as Megatron-LM builds it, tensor- and pipeline-parallel, in one file.

    input_ids [b, s] ──► embedding (word + learned position, dropout)          first stage only
                    ──► encoder.layers[i]: x + Attn(LN(x)), then x + MLP(LN(x))  this stage's layers
                    ──► encoder.final_layernorm ──► logits = x · E^T (tied)      last stage only
                    ──► per-token cross entropy [b, s]                           when labels are given

Activations inside the model use Megatron's layout [s, b, h] (sequence first), so that sequence
parallelism can split dim 0. Under sequence parallelism (SP) an activation between the
attention and MLP blocks is this TP rank's sequence chunk [s/tp, b, h].

What `forward` returns:
  - last stage, labels given:   per-token loss [b, s], float32
  - last stage, no labels:      logits [b, s, padded_vocab / tp] (this TP rank's vocabulary slice)
  - any other stage:            hidden states [s, b, h] ([s/tp, b, h] under SP), for the next stage
A non-first stage gets its input through `set_input_tensor` (the pipeline schedule calls it).

Tensor parallelism enters only through the layers of megatron_core.tensor_parallel: the fused
QKV and the first MLP projection are column-parallel (heads / ffn split across TP ranks), the
attention output and second MLP projection are row-parallel, the word embedding is
vocab-parallel. TP = 1 runs the very same code with every communication an identity.

Initialization is layout-independent: each parameter is drawn in full from a generator seeded
by (seed, its global name) and each rank keeps its slice, so any TP x PP layout starts from the
weights of the single-process model.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_core import fusions as kernels
from megatron_core import parallel_state
from megatron_core.checkpoint_format import TensorSharding, layer_generic_name
from megatron_core.config import ModelConfig, ModelSpec, ParallelConfig
from megatron_core.errors import UserError
from megatron_core.fusions import FusionBackends
from megatron_core.fusions.backends import attention_kernel
from megatron_core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    checkpoint,
    column_parallel_linear,
    declare_init,
    get_rng_tracker,
    initialize_parameter,
    normal_init,
    ones_init,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
    zeros_init,
)
from megatron_core.tensor_parallel.layers import declared_sharding
from megatron_core.tensor_parallel.random import tracked_dropout

# ----------------------------------------------------------------------------------------------
# Element-wise ops through megatron_core.fusions
# ----------------------------------------------------------------------------------------------


class ElementwiseOps:
    """The element-wise steps that have fused kernels, with the backends chosen once per run
    (`resolve_backends(...)`, which also holds the attention kernel; None means the PyTorch references of
    megatron_core.fusions)."""

    def __init__(self, gelu_approximation: str, fusions: Optional[FusionBackends] = None) -> None:
        self.gelu_approximation = gelu_approximation
        self.backends = fusions if fusions is not None else FusionBackends()
        # The fused bias-GeLU is the tanh approximation; the exact erf GeLU runs in plain PyTorch.
        self.fused_gelu = gelu_approximation == "tanh"

    def describe(self) -> str:
        return self.backends.describe(self.gelu_approximation)

    def layer_norm(self, x, weight, bias, eps):
        return kernels.layer_norm(x, weight, bias, eps, backend=self.backends.layer_norm)

    def bias_gelu(self, x, bias):
        if self.fused_gelu:
            return kernels.bias_gelu(x, bias, backend=self.backends.bias_gelu)
        return F.gelu(x + bias, approximate="none")

    def bias_dropout_add(self, x, bias, residual, p: float, training: bool):
        return kernels.bias_dropout_add(x, bias, residual, p, training, backend=self.backends.bias_dropout_add)

    def scaled_causal_softmax(self, scores, scale: float):
        return kernels.scaled_causal_softmax(scores, scale, backend=self.backends.softmax)

    def cross_entropy(self, vocab_parallel_logits, labels):
        # The logits are the head's fresh output, read by nothing else: the loss may reuse their buffer.
        return vocab_parallel_cross_entropy(
            vocab_parallel_logits, labels, backend=self.backends.cross_entropy, inplace=True
        )


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------


class LayerNorm(nn.Module):
    """LayerNorm over h with weight and bias, through the chosen kernel. Under SP its input is a
    sequence chunk, so its parameters are marked for the TP gradient all-reduce."""

    def __init__(self, hidden_size: int, eps: float, ops: ElementwiseOps, sequence_parallel: bool) -> None:
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = declare_init(nn.Parameter(torch.empty(hidden_size)), ones_init)
        self.bias = declare_init(nn.Parameter(torch.empty(hidden_size)), zeros_init)
        self.weight.sequence_parallel = self.bias.sequence_parallel = sequence_parallel

    def forward(self, x):
        return self.ops.layer_norm(x, self.weight, self.bias, self.eps)


def _dropout(x, p: float, training: bool, inside_tensor_parallel_region: bool):
    """Megatron's masks: inside TP regions (heads or sequence chunks differ across ranks) from the
    tracker's per-TP-rank state, outside from the default generator (the same on every TP rank)."""
    if inside_tensor_parallel_region:
        return tracked_dropout(x, p, training)
    return F.dropout(x, p=p, training=training)


class Embedding(nn.Module):
    def __init__(self, config: ModelConfig, padded_vocab_size: int, sequence_parallel: bool) -> None:
        super().__init__()
        h = config.hidden_size
        self.sequence_parallel = sequence_parallel
        self.dropout = config.hidden_dropout
        std = normal_init(config.init_method_std)
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size, h, reduce_scatter_output=sequence_parallel, init_method=std, initialize=False
        )
        # Given an (uninitialized) weight, nn.Embedding skips its own init: GPTModel.initialize_parameters does it.
        self.position_embeddings = nn.Embedding(
            config.max_position_embeddings, h, _weight=torch.empty(config.max_position_embeddings, h)
        )
        declare_init(self.position_embeddings.weight, std)

    def forward(self, input_ids, position_ids):
        # [b, s] ids -> [s, b, h]: transpose the (small) ids, not the activations.
        words = self.word_embeddings(input_ids.t())
        positions = self.position_embeddings(position_ids.t())
        if self.sequence_parallel:
            positions = scatter_to_sequence_parallel_region(positions)
        return _dropout(words + positions, self.dropout, self.training, self.sequence_parallel)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention over this TP rank's heads (num_heads / tp of them)."""

    def __init__(self, config: ModelConfig, parallel: ParallelConfig, ops: ElementwiseOps, output_std: float) -> None:
        super().__init__()
        h, tp = config.hidden_size, parallel.tensor_model_parallel_size
        sp = parallel.sequence_parallel
        self.num_heads_local = config.num_attention_heads // tp
        self.head_dim = h // config.num_attention_heads
        self.attention_dropout = config.attention_dropout
        self.recompute_core = parallel.recompute_granularity == "selective"
        self.ops = ops
        # Output rows per head are [q (head_dim rows), k, v]: Megatron's checkpoint_version 3.0 order.
        self.query_key_value = ColumnParallelLinear(
            h, 3 * h, sequence_parallel=sp, init_method=normal_init(config.init_method_std), initialize=False
        )
        self.dense = RowParallelLinear(
            h,
            h,
            input_is_parallel=True,
            sequence_parallel=sp,
            skip_bias_add=True,
            init_method=normal_init(output_std),
            initialize=False,
        )

    def core_attention(self, q, k, v, kernel: str = "sdpa"):
        """softmax(q k^T / sqrt(d), causal) v on [b, heads, s, d] with `kernel` "sdpa" or "unfused"; dropout
        inside the TP region."""
        p = self.attention_dropout if self.training else 0.0
        # SDPA draws its mask inside the kernel, so it needs the tracker's state swapped in; a compiled
        # graph cannot swap states, so there the probabilities are explicit and the mask is the tracker
        # op's (on the CPU the very mask SDPA draws: SDPA's math path drops the same [b, heads, s, s]).
        if kernel != "unfused" and not (p > 0.0 and torch.compiler.is_compiling()):
            if p == 0.0:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            with get_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        probs = self.ops.scaled_causal_softmax(q @ k.transpose(-2, -1), 1.0 / math.sqrt(self.head_dim))
        return tracked_dropout(probs, p, self.training) @ v

    def attend(self, qkv):
        """qkv [s, b, 3h/tp] -> context [s, b, h/tp]."""
        s, b = qkv.shape[:2]
        # unbind, not three selects: its backward stacks the three gradients in one pass, where each
        # select's would zero a full-size qkv gradient and autograd would add the three.
        qkv = qkv.view(s, b, self.num_heads_local, 3, self.head_dim)
        q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.unbind(3))  # each [b, heads, s, d]
        context = self.core_attention(q, k, v, self.ops.backends.attention)
        return context.permute(2, 0, 1, 3).reshape(s, b, self.num_heads_local * self.head_dim)

    def forward(self, x):
        qkv = self.query_key_value(x)  # [s, b, 3h/tp]
        context = checkpoint(self.attend, qkv) if self.recompute_core else self.attend(qkv)
        return self.dense(context)  # (output [s, b, h] or its SP chunk, bias)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelConfig, ops: ElementwiseOps, output_std: float) -> None:
        super().__init__()
        h, ffn, sp = config.hidden_size, config.ffn_size, parallel.sequence_parallel
        self.ops = ops
        self.dense_h_to_4h = ColumnParallelLinear(
            h,
            ffn,
            sequence_parallel=sp,
            skip_bias_add=True,
            init_method=normal_init(config.init_method_std),
            initialize=False,
        )
        self.dense_4h_to_h = RowParallelLinear(
            ffn,
            h,
            input_is_parallel=True,
            sequence_parallel=sp,
            skip_bias_add=True,
            init_method=normal_init(output_std),
            initialize=False,
        )

    def forward(self, x):
        x, bias = self.dense_h_to_4h(x)
        return self.dense_4h_to_h(self.ops.bias_gelu(x, bias))


class TransformerLayer(nn.Module):
    """Pre-LN block: x + dropout(Attn(LN(x))), then x + dropout(MLP(LN(x)))."""

    def __init__(self, config: ModelConfig, parallel: ParallelConfig, ops: ElementwiseOps) -> None:
        super().__init__()
        sp = parallel.sequence_parallel
        output_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = sp
        self.ops = ops
        self.input_layernorm = LayerNorm(config.hidden_size, config.layernorm_epsilon, ops, sp)
        self.self_attention = SelfAttention(config, parallel, ops, output_std)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.layernorm_epsilon, ops, sp)
        self.mlp = MLP(config, parallel, ops, output_std)

    def _residual(self, out, bias, residual):
        if self.sequence_parallel:  # this rank's sequence chunk: its mask comes from the tracker
            return residual + tracked_dropout(out + bias, self.hidden_dropout, self.training)
        return self.ops.bias_dropout_add(out, bias, residual, self.hidden_dropout, self.training)

    def forward(self, x):
        x = self._residual(*self.self_attention(self.input_layernorm(x)), x)
        return self._residual(*self.mlp(self.post_attention_layernorm(x)), x)


class Encoder(nn.Module):
    """This pipeline stage's layers (numbered 0.. locally), and the final LayerNorm on the last stage."""

    def __init__(
        self, config: ModelConfig, parallel: ParallelConfig, ops: ElementwiseOps, num_layers: int, final_layernorm: bool
    ) -> None:
        super().__init__()
        self.recompute_layers = parallel.recompute_granularity == "full"
        self.layers = nn.ModuleList(TransformerLayer(config, parallel, ops) for _ in range(num_layers))
        if final_layernorm:
            self.final_layernorm = LayerNorm(
                config.hidden_size, config.layernorm_epsilon, ops, parallel.sequence_parallel
            )
        else:
            self.final_layernorm = None

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x) if self.recompute_layers else layer(x)
        return self.final_layernorm(x) if self.final_layernorm is not None else x


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


def _check_layout(config: ModelConfig, parallel: ParallelConfig, padded_vocab_size: int) -> None:
    """Whether the live process groups are this layout, then the shape and layout rules (ModelSpec's)."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    live_tp = parallel_state.get_tensor_model_parallel_world_size()
    live_pp = parallel_state.get_pipeline_model_parallel_world_size()
    # A single process may build any one pipeline stage (pre/post_process, layer_offset given),
    # but tensor parallelism always needs its process group.
    if tp != live_tp or (live_pp != 1 and pp != live_pp):
        raise UserError(
            f"the model asks for TP {tp} x PP {pp} but the process groups are TP {live_tp} x PP "
            f"{live_pp}; call parallel_state.initialize_model_parallel({tp}, {pp}) before building"
        )
    ModelSpec.from_configs(config, parallel, padded_vocab_size).check(
        "change the recipe's parallel sizes or model shape"
    )


def _backends_for(config: ModelConfig, fusions: Optional[FusionBackends]) -> FusionBackends:
    """The run's resolved backends, which must hold the kernel of this model's attention_backend; without
    them the reference fusions with that kernel."""
    kernel = attention_kernel(config.attention_backend)
    if fusions is None:
        return FusionBackends(attention=kernel)
    if fusions.attention != kernel:
        raise ValueError(
            f"the fusion backends run attention kernel {fusions.attention!r} but the model asks for "
            f"attention_backend {config.attention_backend!r}; pass attention=config.attention_backend "
            "to resolve_backends"
        )
    return fusions


def _parameter_seed(seed: int, global_name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{global_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class GPTModel(nn.Module):
    """One pipeline stage (by default: the whole model) of a tensor-parallel GPT.

    pre_process / post_process default to this rank's pipeline position (first / last stage),
    layer_offset to pp_rank x layers per stage. `init_seed` defaults to torch.initial_seed(), so
    seeding torch before building (as `model_parallel_manual_seed` does) fixes the weights.

    Under the interleaved schedule (parallel.num_layers_per_virtual_pipeline_stage set) a GPTModel
    is one model chunk, `virtual_pipeline_rank` c of this PP rank: its layers are
    parallel_state.stage_layers(...), the embedding is in chunk 0 of the first stage and the
    final norm and head in the last chunk of the last stage. `build_gpt_model` builds them all.
    """

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelConfig,
        padded_vocab_size: int,
        *,
        pre_process: Optional[bool] = None,
        post_process: Optional[bool] = None,
        layer_offset: Optional[int] = None,
        fusions: Optional[FusionBackends] = None,
        init_seed: Optional[int] = None,
        virtual_pipeline_rank: Optional[int] = None,
    ) -> None:
        super().__init__()
        _check_layout(config, parallel, padded_vocab_size)
        pp = parallel.pipeline_model_parallel_size
        self.config, self.parallel = config, parallel
        self.padded_vocab_size = padded_vocab_size
        chunks = parallel.virtual_pipeline_model_parallel_size(config.num_layers)
        if virtual_pipeline_rank is not None and not (chunks and 0 <= virtual_pipeline_rank < chunks):
            raise UserError(
                f"virtual_pipeline_rank {virtual_pipeline_rank} needs "
                f"parallel.num_layers_per_virtual_pipeline_stage set and a rank below {chunks or 1}"
            )
        self.virtual_pipeline_rank = vp = virtual_pipeline_rank or 0
        first_chunk, last_chunk = vp == 0, vp == (chunks or 1) - 1
        if pre_process is None:
            pre_process = parallel_state.is_pipeline_first_stage() and first_chunk
        if post_process is None:
            post_process = parallel_state.is_pipeline_last_stage() and last_chunk
        self.pre_process, self.post_process = pre_process, post_process
        layers = parallel_state.stage_layers(
            config.num_layers,
            pp,
            parallel_state.get_pipeline_model_parallel_rank(),
            num_layers_per_virtual_pipeline_stage=parallel.num_layers_per_virtual_pipeline_stage,
            virtual_rank=vp,
        )
        layers_per_stage = len(layers)
        if layer_offset is None:
            layer_offset = layers.start
        self.layer_offset = layer_offset
        self.sequence_parallel = parallel.sequence_parallel
        self.tied = not config.untie_embeddings_and_output_weights
        self.ops = ElementwiseOps(config.gelu_approximation, _backends_for(config, fusions))
        self.input_tensor: Optional[torch.Tensor] = None

        if self.pre_process:
            self.embedding = Embedding(config, padded_vocab_size, self.sequence_parallel)
        self.encoder = Encoder(config, parallel, self.ops, layers_per_stage, final_layernorm=self.post_process)
        if self.post_process and not self.tied:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size,
                padded_vocab_size,
                bias=False,
                sequence_parallel=self.sequence_parallel,
                init_method=normal_init(config.init_method_std),
                initialize=False,
                vocab_padded=True,
            )
        if self.post_process and self.tied and not self.pre_process:
            # The last stage's copy of the tied word embeddings; initialized like the first stage's
            # (same global name, same draw), and kept equal by the embedding-group all-reduce.
            self.word_embeddings_for_head = VocabParallelEmbedding(
                padded_vocab_size, config.hidden_size, init_method=normal_init(config.init_method_std), initialize=False
            )
        for param in self.shared_embedding_parameters():
            param.shared_embedding = True
        self.initialize_parameters(torch.initial_seed() if init_seed is None else init_seed)

    # -- structure ---------------------------------------------------------------------------
    @property
    def layer_range(self) -> range:
        """Global layer numbers held by this stage."""
        return range(self.layer_offset, self.layer_offset + len(self.encoder.layers))

    def head_weight(self) -> torch.Tensor:
        if not self.tied:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight if self.pre_process else self.word_embeddings_for_head.weight

    def shared_embedding_parameters(self) -> list[nn.Parameter]:
        """The tied word-embedding weight on the first and last stage (all-reduce its gradient
        over the embedding group); empty on middle stages and when untied."""
        if not self.tied:
            return []
        if self.pre_process:
            return [self.embedding.word_embeddings.weight]
        if self.post_process:
            return [self.word_embeddings_for_head.weight]
        return []

    def describe_backends(self) -> str:
        """The one description of the kernels this model runs (attention and every fusion), and its recompute."""
        return f"{self.ops.describe()}; recompute: {self.parallel.recompute_granularity or 'none'}"

    def global_parameter_name(self, name: str) -> str:
        """The name a parameter has in the single-process model (global layer number, tied head
        weight = the word embedding): what initialization is keyed by."""
        if name == "word_embeddings_for_head.weight":
            return "embedding.word_embeddings.weight"
        return re.sub(r"^encoder\.layers\.(\d+)\.", lambda m: f"encoder.layers.{int(m[1]) + self.layer_offset}.", name)

    @torch.no_grad()
    def initialize_parameters(self, seed: int) -> None:
        """Megatron's init, as each layer declared it (normal(0, std); block output projections
        std / sqrt(2 L); biases zero; norms one). Each full tensor is drawn from its own generator
        keyed by (seed, global name), so every TP x PP layout starts from the same weights."""
        for name, param in self.named_parameters():
            generator = torch.Generator().manual_seed(_parameter_seed(seed, self.global_parameter_name(name)))
            initialize_parameter(param, generator=generator)

    @property
    def chunks(self) -> list[GPTModel]:
        """The stage modules (the model protocol's `chunks`): this one model, saved as `model`."""
        return [self]

    # -- running -----------------------------------------------------------------------------
    def set_input_tensor(self, input_tensor) -> None:
        """The previous stage's output for a non-first stage (a tensor, or a list holding one)."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0] if input_tensor else None
        self.input_tensor = input_tensor

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        labels: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if self.pre_process:
            hidden = self.embedding(input_ids, position_ids)
        else:
            if self.input_tensor is None:
                raise RuntimeError("GPTModel on a non-first pipeline stage needs set_input_tensor(...) before forward")
            hidden = self.input_tensor
        hidden = self.encoder(hidden)
        if not self.post_process:
            return hidden
        logits = column_parallel_linear(hidden, self.head_weight(), None, sequence_parallel=self.sequence_parallel)
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [b, s, V/tp]
        return self.ops.cross_entropy(logits, labels.t()).t().contiguous()  # [b, s] float32


class GPTModelChunks(nn.Module):
    """This PP rank's model chunks under the interleaved 1F1B schedule: a container, as nn.ModuleList
    is (no forward of its own), so that the optimizer, the data-parallel wrapper and the grad norm see
    every parameter once (Megatron keeps a list of models). Chunk c is `chunks[c]`, a GPTModel holding
    global layers parallel_state.stage_layers(..., virtual_rank=c); the schedule runs them one by one.
    Parameter names are `chunks.<c>.<name>` (the optimizer state's); checkpoints hold each chunk's own
    state_dict() as `model{c}` (keys a GPTModel's, layer numbers local to the chunk).
    """

    def __init__(self, chunks: list[GPTModel]) -> None:
        super().__init__()
        if len(chunks) < 1:
            raise ValueError("GPTModelChunks needs at least one chunk")
        self.chunks = nn.ModuleList(chunks)
        self.config, self.parallel = chunks[0].config, chunks[0].parallel

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def layer_ranges(self) -> list[range]:
        return [chunk.layer_range for chunk in self.chunks]

    def shared_embedding_parameters(self) -> list[nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.shared_embedding_parameters()]

    def describe_backends(self) -> str:
        layers = ", ".join(f"{r.start}-{r.stop - 1}" for r in self.layer_ranges)
        return f"{self.chunks[0].describe_backends()}; {len(self)} virtual pipeline chunks (layers {layers})"

    def global_parameter_name(self, name: str) -> str:
        match = re.match(r"^chunks\.(\d+)\.(.+)$", name)
        if match is None:
            raise ValueError(f"{name!r} is not a parameter of a model chunk")
        return self.chunks[int(match[1])].global_parameter_name(match[2])


def build_gpt_model(
    config: ModelConfig,
    parallel: ParallelConfig,
    padded_vocab_size: int,
    *,
    fusions: Optional[FusionBackends] = None,
    init_seed: Optional[int] = None,
):
    """This rank's GPT: one GPTModel stage, or GPTModelChunks with Megatron's virtual pipeline
    layout when parallel.num_layers_per_virtual_pipeline_stage is set."""
    chunks = parallel.virtual_pipeline_model_parallel_size(config.num_layers)
    if chunks is None:
        return GPTModel(config, parallel, padded_vocab_size, fusions=fusions, init_seed=init_seed)
    return GPTModelChunks(
        [
            GPTModel(config, parallel, padded_vocab_size, fusions=fusions, init_seed=init_seed, virtual_pipeline_rank=c)
            for c in range(chunks)
        ]
    )


def parameter_sharding(config: ModelConfig) -> dict[str, TensorSharding]:
    """{layer-generic parameter name (checkpoint_format.layer_generic_name): how it lies across TP ranks} of
    the GPT that `config` describes, read from what its tensor-parallel layers declare: the one source that
    checkpoint merging and splitting, resharding on load and convert use. Built on the meta device as a
    single process (no weights drawn, no process groups needed, whatever this process's layout) with one
    layer, which stands for every layer. It includes the tied head's copy of the word embedding
    (`word_embeddings_for_head`, on a last stage that is not the first)."""
    one_layer, vocab = replace(config, num_layers=1), config.make_vocab_size_divisible_by  # any padded size
    with parallel_state.single_process_view(), torch.device("meta"):
        stages = [
            GPTModel(one_layer, ParallelConfig(), vocab, pre_process=True, post_process=True),
            GPTModel(one_layer, ParallelConfig(), vocab, pre_process=False, post_process=True),
        ]
    return {
        layer_generic_name(name): declared_sharding(param)
        for stage in stages
        for name, param in stage.named_parameters()
    }


def compile_layers(model) -> None:
    """torch.compile each transformer layer, as torchtitan compiles each block: the layers share one
    graph (their parameters are its inputs), the embedding and the loss stay eager, and
    Module.compile leaves parameter names and state_dict keys as they were. fullgraph: a layer
    traces without a break (dropout inside TP regions goes through the tracker's custom op, the TP
    collectives are traced)."""
    if model.parallel.recompute_granularity == "selective":
        # Inside a graph the recompute would be the partitioner's, which draws the tracker's masks anew.
        raise UserError(
            "training.compile does not combine with recompute_granularity selective (the recompute "
            "would redraw the attention dropout masks); use --set recompute_granularity=full, or "
            "training.compile=false"
        )
    for stage in model.chunks:
        for layer in stage.encoder.layers:
            layer.compile(fullgraph=True)
