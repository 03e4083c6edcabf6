"""The GEM model: torchrec embeddings -> sequence tower -> DHEN interaction -> CTR/CVR heads."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from gem_kernels import host_offsets as host_offsets_of
from gem_kernels import validate_offsets
from gem_precision import autocast_input
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    PoolingType,
)

from gem_model.config import GemModelConfig
from gem_model.dhen import DHENLayer
from gem_model.sequence import (
    CandidateCrossAttention,
    HistoryFeatureCrossAttention,
    JaggedSelfAttentionLayer,
    PoolingByMultiheadAttention,
)

__all__ = ["REGION_SCOPE_PREFIX", "GemInputs", "GemModel"]


REGION_SCOPE_PREFIX = "gem_model/"
"""Profiler ranges of the forward regions are named ``gem_model/<region>`` (see
:meth:`GemModel.regions`); a profiler pass attributes time to the regions by them."""


def _region_scope(region: str) -> torch.profiler.record_function:
    """The profiler range of one forward region (a no-op unless a profiler is recording, at
    about a microsecond per call: the model opens a dozen per step, in its eager glue)."""
    return torch.profiler.record_function(REGION_SCOPE_PREFIX + region)


def _any_token_count(*tensors: torch.Tensor) -> None:
    """Marks dimension 0 (the batch's token count) of tensors entering a compiled region as
    dynamic: it changes every batch, so the region compiles once for any count instead of once
    for the first batch and again for the rest."""
    if not torch.compiler.is_compiling():
        for tensor in tensors:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)


def _select_keys(features: KeyedJaggedTensor, keys: list[str]) -> KeyedJaggedTensor:
    """The features of ``keys`` only, in that order (torchrec modules expect exactly their keys)."""
    if list(features.keys()) == keys:
        return features
    index = {key: i for i, key in enumerate(features.keys())}
    missing = [key for key in keys if key not in index]
    if missing:
        raise ValueError(f"features is missing keys {missing}; it has {features.keys()}")
    return features.permute([index[key] for key in keys])


@dataclasses.dataclass
class GemInputs:
    """One batch as :class:`GemModel` reads it. Any object with these four attributes will do:
    ``gem_data.Batch`` is one."""

    sequence_features: KeyedJaggedTensor | None
    """The history, one key per ``config.sequence_features``; every key has the per-sample
    history lengths. ``None`` only without the sequence tower."""
    sparse_features: KeyedJaggedTensor
    """One key per ``config.sparse_features`` (more keys are ignored)."""
    dense_features: torch.Tensor
    """``(B, num_dense_features)`` floats."""
    sequence_offsets: torch.Tensor | Sequence[int] | None = None
    """The histories' ``(B + 1,)`` offsets on the host: a CPU integer tensor or a list of
    ints. The attention kernels plan their tiles from it; without it they copy the device
    offsets back once per step, which stalls the host until the GPU has caught up."""


class _TableInputs(nn.Module):
    """The two embedding collections' inputs from a batch's features: the pooled features in
    the bag collection's order, and the history's keys followed by the candidate, which shares
    the candidate-history table. A parameter-free module of its own, so that torchrec's train
    pipeline can run it for the next batch ahead of its step (``pipeline_postproc``)."""

    def __init__(self, config: GemModelConfig, pooled_features: list[str]) -> None:
        super().__init__()
        self.pooled_features = pooled_features
        self.sequence_keys = list(config.sequence_features)
        self.candidate_feature = config.candidate_feature
        self.use_sequence_tower = config.use_sequence_tower

    def forward(
        self, sequence_features: KeyedJaggedTensor | None, sparse_features: KeyedJaggedTensor
    ) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor | None]:
        pooled = _select_keys(sparse_features, self.pooled_features)
        if not self.use_sequence_tower:
            return pooled, None
        if sequence_features is None:
            raise ValueError("sequence_features is required when use_sequence_tower=True")
        candidate = sparse_features[self.candidate_feature]
        lookup = KeyedJaggedTensor.concat(
            [
                _select_keys(sequence_features, self.sequence_keys),
                # Its one length per key is the number of ids, known without reading the
                # device lengths (from_lengths_sync would copy them back: a host sync).
                KeyedJaggedTensor(
                    keys=[self.candidate_feature],
                    values=candidate.values(),
                    lengths=candidate.lengths(),
                    length_per_key=[candidate.values().shape[0]],
                ),
            ]
        )
        return pooled, lookup


class _AfterLookups(nn.Module):
    """Everything after the two lookups (sequence tower, DHEN, heads), as one call into the
    model that owns it. torchrec's train pipeline traces ``GemModel.forward`` with torch.fx
    to find the tables' inputs, and calls a submodule without tables one opaque step (a leaf):
    this keeps the sequence tower's data-dependent Python out of that trace. It has no
    parameters, so the model's parameter names do not change."""

    def __init__(self, model: GemModel) -> None:
        super().__init__()
        object.__setattr__(self, "_model", model)  # not a submodule: no second parameter path

    def forward(self, pooled, embedded, dense_features, sequence_offsets) -> torch.Tensor:
        return self._model._after_lookups(pooled, embedded, dense_features, sequence_offsets)


class SequenceInput(nn.Module):
    """The history's tokens entering the sequence tower: each event's id embeddings (one per
    sequence feature) summed, plus a learned embedding of its recency (the distance from the
    end of its history), layer-normalised. A module of the ``sequence`` region, so the trainer
    compiles these token-sized passes into one kernel each way instead of running them eagerly
    between regions.

    Under autocast the tokens leave in the autocast dtype (bf16 in gem-train's bf16 and FP8
    policies on CUDA), so the tower's residual stream, its largest activations, is bf16 as in
    bf16 transformer training: half the bytes for every residual add, saved norm input and
    their gradients. The norms still compute in float32 (autocast's policy)."""

    def __init__(self, max_len: int, dim: int) -> None:
        super().__init__()
        self.recency = nn.Embedding(max_len, dim)
        # On the scale of the id embeddings, so recency does not drown the item signal.
        nn.init.normal_(self.recency.weight, std=0.1)
        # Unit-scale tokens: raw id embeddings are tiny next to freshly initialised
        # sublayer outputs, which would otherwise drown the history signal.
        self.norm = nn.LayerNorm(dim)

    def forward(self, embeddings: list[torch.Tensor], from_end: torch.Tensor) -> torch.Tensor:
        # A plain sum() would start from 0: one more pass over the (tokens, dim) float32 sum.
        tokens = embeddings[0]
        for embedding in embeddings[1:]:
            tokens = tokens + embedding
        return autocast_input(self.norm(tokens + self.recency(from_end)))


class SequenceOutput(nn.LayerNorm):
    """The sequence tower's final LayerNorm, leaving in the autocast dtype as
    :class:`SequenceInput`'s tokens do. A module of the ``pma`` region, the first to read it,
    so the trainer compiles it into one token-sized pass each way: eager under autocast it is
    four (a cast to float32, the norm, a cast back, and the same again in the backward)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return autocast_input(super().forward(tokens))


class GemModel(nn.Module):
    """GEM for CTR/CVR prediction.

    ``forward(inputs)`` takes one batch of ``B`` users, a :class:`GemInputs` or any object
    with its attributes (``gem_data.Batch``), and returns ``(B, len(config.tasks))`` logits.

    The history tokens are the sum of the history features' embeddings plus a
    learned recency embedding. They pass the self-attention layers (windowed, with the
    architecture's position signal), then, with ``history_cross``, attend over the sample's
    non-sequence feature tokens; PMA pools them into a few tokens and, with
    ``target_attention``, the candidate's query reads them. The candidate feature shares its
    table with ``candidate_history_feature``, so the candidate and the history meet in one
    embedding space. The feature tokens (pooled sparse features, the dense projection, and
    the sequence tower's tokens and the candidate's embedding) go through DHEN to the heads.
    Pass ``device=torch.device("meta")`` when torchrec's ``DistributedModelParallel`` will
    shard and materialise the tables.

    The forward is three calls: the tables' inputs (:class:`_TableInputs`), the two lookups,
    and the rest (:class:`_AfterLookups`). That is the shape torchrec's
    ``TrainPipelineSparseDist`` needs to start the next batch's lookup inputs while this
    batch trains.
    """

    def __init__(self, config: GemModelConfig, device: torch.device | None = None) -> None:
        super().__init__()
        self.config = config
        arch = config.architecture
        dim = arch.embedding_dim
        use_sequence = config.use_sequence_tower
        # Meta-device tables are materialised by DMP; dense layers are always real.
        table_device = device

        pooled_features = [
            name
            for name in config.sparse_features
            if not (use_sequence and name == config.candidate_feature)
        ]
        self.pooled_features = pooled_features
        self.table_inputs = _TableInputs(config, pooled_features)
        self.sparse_embeddings = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"sparse_{name}",
                    embedding_dim=dim,
                    num_embeddings=config.sparse_features[name],
                    feature_names=[name],
                    pooling=PoolingType.MEAN,
                )
                for name in pooled_features
            ],
            device=table_device,
        )
        num_tokens = len(pooled_features) + (1 if config.num_dense_features else 0)
        self.dense_projection = (
            nn.Linear(config.num_dense_features, dim) if config.num_dense_features else None
        )

        if use_sequence:
            self.sequence_keys = list(config.sequence_features)
            self.sequence_embeddings = EmbeddingCollection(
                tables=[
                    EmbeddingConfig(
                        name=f"sequence_{name}",
                        embedding_dim=dim,
                        num_embeddings=config.sequence_features[name],
                        feature_names=[name]
                        + (
                            [config.candidate_feature]
                            if name == config.candidate_history_feature
                            else []
                        ),
                    )
                    for name in config.sequence_features
                ],
                device=table_device,
            )
            self.sequence_input = SequenceInput(config.max_seq_len, dim)
            attention_dtype = (
                None if arch.attention_dtype == "auto" else getattr(torch, arch.attention_dtype)
            )
            self.sequence_layers = nn.ModuleList(
                JaggedSelfAttentionLayer(
                    dim,
                    arch.num_heads,
                    arch.self_attention,
                    arch.dropout,
                    attention_dtype,
                    window=arch.attention_window,
                    position=arch.position,
                    ffn=arch.ffn,
                    max_len=config.max_seq_len,
                )
                for _ in range(arch.num_sequence_layers)
            )
            self.history_cross = (
                HistoryFeatureCrossAttention(
                    dim, arch.num_heads, arch.sequence_activation, attention_dtype
                )
                if arch.history_cross
                else None
            )
            self.sequence_norm = SequenceOutput(dim)
            self.pma = PoolingByMultiheadAttention(
                dim, arch.num_heads, arch.pma_queries, arch.sequence_activation, attention_dtype
            )
            self.cross_attention = (
                CandidateCrossAttention(
                    dim, arch.num_heads, arch.sequence_activation, attention_dtype
                )
                if arch.target_attention
                else None
            )
            # PMA tokens, the target-attention token, and the candidate's own embedding.
            num_tokens += arch.pma_queries + (1 if arch.target_attention else 0) + 1

        self.num_tokens = num_tokens
        self.interaction = nn.Sequential(
            *(
                DHENLayer(
                    num_tokens,
                    dim,
                    arch.num_heads,
                    arch.dhen_experts,
                    arch.expert_hidden_dim,
                    arch.dropout,
                )
                for _ in range(arch.dhen_layers)
            )
        )
        self.interaction_norm = nn.LayerNorm(dim)
        self.heads = nn.ModuleDict(
            {
                task: nn.Sequential(
                    nn.Linear(num_tokens * dim, arch.expert_hidden_dim),
                    nn.GELU(),
                    nn.Dropout(arch.dropout),
                    nn.Linear(arch.expert_hidden_dim, 1),
                )
                for task in config.tasks
            }
        )
        if config.task_base_rates is not None:
            for task, rate in zip(config.tasks, config.task_base_rates, strict=True):
                nn.init.constant_(self.heads[task][-1].bias, math.log(rate / (1.0 - rate)))
        self.after_lookups = _AfterLookups(self)

    def regions(self) -> dict[str, list[nn.Module]]:
        """The model's regions, each as the modules that run it, in forward order: the units
        the trainer compiles one by one (all but the embeddings), profiles and checkpoints.

        ``embeddings`` (the torchrec tables), ``sequence`` (the self-attention layers),
        ``cross`` (the history x feature and the target cross-attention), ``pma`` (the
        tower's :class:`SequenceOutput` norm, then PMA), ``dhen`` (the dense projection and
        the DHEN layers) and ``heads``; the names of :class:`~gem_model.ModelFlops`' fields
        (``sequence`` is its ``sequence_attention`` + ``sequence_dense``; it starts with the
        :class:`SequenceInput`). Regions the architecture leaves out are empty lists. The glue
        between them (the history's index arithmetic, the small ``(B, F, dim)`` interaction
        norm) belongs to no region.
        """
        sequence = self.config.use_sequence_tower
        embeddings: list[nn.Module] = [self.sparse_embeddings]
        if sequence:
            embeddings.append(self.sequence_embeddings)
        cross = [self.history_cross, self.cross_attention] if sequence else []
        return {
            "embeddings": embeddings,
            "sequence": [self.sequence_input, *self.sequence_layers] if sequence else [],
            "cross": [module for module in cross if module is not None],
            "pma": [self.sequence_norm, self.pma] if sequence else [],
            "dhen": [
                module
                for module in (self.dense_projection, *self.interaction)
                if module is not None
            ],
            "heads": list(self.heads.values()),
        }

    def forward(self, inputs: GemInputs) -> torch.Tensor:
        """The ``(B, len(config.tasks))`` logits of the batch ``inputs`` (see :class:`GemInputs`)."""
        tables = self.table_inputs(inputs.sequence_features, inputs.sparse_features)
        with _region_scope("embeddings"):
            pooled = self.sparse_embeddings(tables[0])
            embedded = (
                self.sequence_embeddings(tables[1]) if self.config.use_sequence_tower else None
            )
        return self.after_lookups(pooled, embedded, inputs.dense_features, inputs.sequence_offsets)

    def _after_lookups(
        self,
        pooled: KeyedTensor,
        embedded: dict[str, JaggedTensor] | None,
        dense_features: torch.Tensor,
        sequence_offsets: torch.Tensor | Sequence[int] | None,
    ) -> torch.Tensor:
        config = self.config
        tokens = [pooled[name] for name in self.pooled_features]
        if self.dense_projection is not None:
            with _region_scope("dhen"):
                tokens.append(self.dense_projection(dense_features))
        if embedded is not None:
            tokens.extend(self._sequence_tokens(embedded, tokens, sequence_offsets))
        features = torch.stack(tokens, dim=1)
        with _region_scope("dhen"):
            features = self.interaction_norm(self.interaction(features)).flatten(1)
        with _region_scope("heads"):
            return torch.cat([self.heads[task](features) for task in config.tasks], dim=1)

    def _sequence_tokens(
        self,
        embedded: dict[str, JaggedTensor],
        feature_tokens: list[torch.Tensor],
        host_offsets: torch.Tensor | Sequence[int] | None,
    ) -> list[torch.Tensor]:
        """The sequence tower's tokens, then the candidate's embedding; ``feature_tokens`` (the
        pooled sparse and dense tokens, each ``(B, dim)``) are the history cross's keys."""
        config = self.config
        history = embedded[self.sequence_keys[0]]
        embeddings = [embedded[key].values() for key in self.sequence_keys]
        events = embeddings[0]  # one row per history event
        if host_offsets is None:
            # One device-to-host copy per step: the attention layers get this same tensor and
            # reuse its host copy (gem_kernels.host_offsets caches it).
            offsets = host_offsets = history.offsets()
        else:
            if not isinstance(host_offsets, torch.Tensor):
                host_offsets = torch.tensor(host_offsets, dtype=torch.int64)
                if events.is_cuda:  # the upload below then queues without blocking the host
                    host_offsets = host_offsets.pin_memory()
            expected = (history.lengths().shape[0] + 1,)
            if host_offsets.device.type != "cpu" or host_offsets.shape != expected:
                raise ValueError(
                    f"sequence_offsets must be the {expected} history offsets on "
                    f"the CPU, got shape {tuple(host_offsets.shape)} on {host_offsets.device}"
                )
            # Dtype, start, order and total (remembered for the kernels' own checks).
            validate_offsets(host_offsets, "sequence_offsets", num_rows=events.shape[0])
            # The host copy is the one source of the split into histories (the lookups are per
            # id, so the tokens do not depend on it): the model's own index arithmetic reads
            # this upload of it, which queues behind the step's work instead of waiting for it.
            offsets = host_offsets.to(events.device, non_blocking=True)
        host_lengths = host_offsets_of(host_offsets).diff()
        if host_lengths.numel() and int(host_lengths.max()) > config.max_seq_len:
            raise ValueError(
                f"sequence_features has a history of {int(host_lengths.max())} tokens, "
                f"more than max_seq_len={config.max_seq_len}"
            )
        lengths = offsets.diff()
        # Recency: distance of each event from the end of its own history.
        sample_of_token = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=lengths.device),
            lengths,
            output_size=events.shape[0],  # known: no host sync
        )
        token_index = torch.arange(events.shape[0], device=events.device)
        from_end = offsets[1:][sample_of_token] - 1 - token_index
        positions = token_index - offsets[:-1][sample_of_token]  # index in the history (RoPE)

        # The candidate has exactly one id per sample; its embedding comes from the shared table.
        candidate_embedding = embedded[config.candidate_feature].values()
        if candidate_embedding.shape[0] != lengths.numel():
            raise ValueError(
                f"sparse_features[{config.candidate_feature!r}] must hold exactly one id per sample"
            )
        max_len = config.max_seq_len
        # The kernels take the host offsets: they plan from them and read no device offsets.
        with _region_scope("sequence"):
            _any_token_count(*embeddings, from_end)
            tokens = self.sequence_input(embeddings, from_end)
            for layer in self.sequence_layers:
                _any_token_count(tokens, positions)
                tokens = layer(tokens, host_offsets, max_len, positions)
        if self.history_cross is not None:
            features = torch.stack([*feature_tokens, candidate_embedding], dim=1)
            _any_token_count(tokens)
            with _region_scope("cross"):
                tokens = self.history_cross(tokens, host_offsets, max_len, features)
        _any_token_count(tokens)
        with _region_scope("pma"):
            tokens = self.sequence_norm(tokens)
            pma_tokens = self.pma(tokens, host_offsets, max_len)
        if self.cross_attention is None:
            return [*pma_tokens.unbind(1), candidate_embedding]
        with _region_scope("cross"):
            target_token = self.cross_attention(candidate_embedding, tokens, host_offsets, max_len)
        return [*pma_tokens.unbind(1), target_token, candidate_embedding]
