"""Llama, Qwen2 and Mistral: one decoder, configured by ModelConfig.

Parameter names follow Hugging Face, except that q/k/v and gate/up are fused;
`packed_weights` tells the loader where each checkpoint tensor goes."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from backend.attention_metadata import AttentionMetadata
from backend.layers.attention import AttentionBackend
from backend.layers.mlp import GatedMLP
from backend.layers.rmsnorm import RMSNorm
from backend.layers.rotary import RotaryEmbedding
from backend.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cfg = self.cfg
        qkv = self.qkv_proj(x)
        # The query and key heads are adjacent in qkv: rotated together, as one tensor.
        qk = qkv[:, : cfg.q_size + cfg.kv_size].view(
            -1, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim
        )
        q, k = rotary(positions, qk).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
        self.backend.write_kv(k, v, kv_cache, meta)
        out = self.backend.attend(q, kv_cache, meta, self.scale)
        return self.o_proj(out.flatten(1))  # type: ignore[no-any-return]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, backend)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next
        norm adds the two, fused with the norm on CUDA."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, positions, rotary, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, backend: AttentionBackend) -> None:
        super().__init__()
        # Given its weight, Embedding skips its random init: on the meta device that init
        # goes through torch._refs, whose first call imports torch._dynamo (~2.4 s at
        # every start). The loader fills the weight from the checkpoint anyway.
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)


class LlamaForCausalLM(nn.Module):
    # checkpoint name part -> (our fused parameter name part, shard index)
    packed_weights = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, max_positions: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, max_positions, backend)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def shard_sizes(self, fused: str) -> list[int]:
        """Row counts of the checkpoint tensors stacked into a fused parameter."""
        cfg = self.cfg
        if fused == "qkv_proj":
            return [cfg.q_size, cfg.kv_size, cfg.kv_size]
        return [cfg.intermediate_size, cfg.intermediate_size]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
        between_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches: [layers, 2, blocks, block_size, kv_heads, D].
        Returns hidden states [T, hidden]; call `logits` on the rows that sample.
        `between_layers` is called before each layer: raising there abandons the pass
        (the engine's step that gives way to a newcomer, Engine._run_sync)."""
        m = self.model
        x = m.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(m.layers):
            if between_layers is not None:
                between_layers()
            x, residual = layer(x, residual, positions, m.rotary, kv_caches[i], meta)
        if residual is None:  # no layers
            return m.norm(x)  # type: ignore[no-any-return]
        return m.norm.add_and_norm(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # type: ignore[no-any-return]
