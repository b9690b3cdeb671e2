"""LoRA adapters in the decoder: each linear layer the adapters may target is swapped for
a LoRALinear after the load (as backend/layers/quant.py swaps in quantized ones), holding
`max_loras` slots of low-rank weights beside the base layer. Every row of a step adds
its own slot's update; rows of the base model (slot -1) add nothing.

A fused projection (qkv, gate_up) keeps one pair of slot tensors per shard (q, k, v),
each adding into its columns of the fused output. An adapter of smaller rank, or one
that does not target a shard, leaves zeros there. The scaling (lora_alpha / r) is
folded into B when a slot is filled."""

from __future__ import annotations

import torch
from torch import nn

from backend.kernels import use_fused

# A PEFT target module -> (our layer's name in its decoder layer, shard index).
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_FUSED = {"self_attn.qkv_proj": "qkv_proj", "mlp.gate_up_proj": "gate_up_proj"}


class LoRARows:
    """The step's adapter slot for every token, shared by all LoRALinear layers (as the
    attention backend is): the runner sets it before each forward pass."""

    def __init__(self) -> None:
        self.slots: torch.Tensor | None = None  # [T] int64; None: no row has an adapter
        self._masks: dict[tuple[int, int, int, torch.dtype], torch.Tensor] = {}

    def set(self, slots: torch.Tensor | None) -> None:
        self.slots = slots
        self._masks.clear()

    def mask(self, shards: int, num_slots: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, shards * num_slots * rank]: 1 in the columns of each row's own slot (in
        every shard). Built once a step per layer shape, shared by the layers."""
        key = (shards, num_slots, rank, dtype)
        mask = self._masks.get(key)
        if mask is None:
            assert self.slots is not None
            columns = torch.arange(shards * num_slots * rank, device=self.slots.device)
            owner = columns // rank % num_slots
            mask = self._masks[key] = (owner[None, :] == self.slots[:, None]).to(dtype)
        return mask


class LoRALinear(nn.Module):
    """y = base(x) + (x @ A[s].T) @ B[s] for each row's slot s, shard by shard of a fused
    output: A [shards, L, max_rank, in], and B_i [L, max_rank, out_i] for shard i. On
    CUDA one Triton launch pair per shard covers the batch (backend/kernels/lora.py); on
    the CPU one matmul over every slot and shard, masked to each row's own slot, then one
    per shard into its columns (for a few slots of small rank, cheaper than gathering
    weights per row)."""

    lora_a: torch.Tensor

    def __init__(
        self,
        base: nn.Module,
        shard_sizes: list[int],
        max_loras: int,
        max_rank: int,
        rows: LoRARows,
        like: torch.Tensor,
    ) -> None:
        super().__init__()
        self.base = base
        self.rows = rows
        self.max_rank = max_rank
        self.shard_sizes = shard_sizes
        self.in_features: int = base.in_features  # type: ignore[assignment]
        self.out_features: int = base.out_features  # type: ignore[assignment]
        starts = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        self.columns = [slice(a, a + n) for a, n in zip(starts, shard_sizes, strict=True)]
        shards = len(shard_sizes)  # like: the model's dtype and device
        a = like.new_zeros(shards, max_loras, max_rank, self.in_features)
        self.register_buffer("lora_a", a)
        for i, size in enumerate(shard_sizes):
            self.register_buffer(f"lora_b{i}", like.new_zeros(max_loras, max_rank, size))

    def shard(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Shard i's (A [L, R, in], B [L, R, out_i])."""
        return self.lora_a[i], self.get_buffer(f"lora_b{i}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        slots = self.rows.slots
        if slots is None:
            return y
        if use_fused(x):
            from backend.kernels.lora import lora_add  # imported on first CUDA use only

            for i, columns in enumerate(self.columns):
                lora_add(y[:, columns], x, *self.shard(i), slots)
            return y
        shards, num_slots, rank, _ = self.lora_a.shape
        width = num_slots * rank
        shrunk = x @ self.lora_a.view(shards * width, -1).T
        shrunk.mul_(self.rows.mask(shards, num_slots, rank, shrunk.dtype))
        for i, columns in enumerate(self.columns):
            b = self.get_buffer(f"lora_b{i}").view(width, -1)
            y[:, columns].addmm_(shrunk[:, i * width : (i + 1) * width], b)
        return y

    def fill(
        self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]], scaling: float
    ) -> None:
        """Slot `slot` takes the adapter's (A [r, in], B [out_shard, r]) of each shard it
        targets; the rest of the slot is zeroed."""
        for i in range(len(self.shard_sizes)):
            a, b = self.shard(i)
            a[slot].zero_()
            b[slot].zero_()
            if i in shards:
                lora_a, lora_b = shards[i]
                r = lora_a.shape[0]
                a[slot, :r] = lora_a.to(a.dtype)
                b[slot, :r] = (lora_b.float().T * scaling).to(b.dtype)


def add_lora_layers(model: nn.Module, max_loras: int, max_rank: int) -> dict[str, LoRALinear]:
    """Swap every targetable linear layer of the decoder for a LoRALinear, in place.
    Returns them by "layer index.our name" (e.g. "3.self_attn.qkv_proj"); their shared
    LoRARows is `rows_of(layers)`."""
    rows = LoRARows()
    like = model.get_parameter("model.embed_tokens.weight")
    layers: dict[str, LoRALinear] = {}
    names = {name for name, _ in TARGETS.values()}
    for index, decoder_layer in enumerate(model.model.layers):  # type: ignore[union-attr, arg-type]
        for name in sorted(names):
            parent_name, _, child = name.rpartition(".")
            parent = decoder_layer.get_submodule(parent_name)
            base = getattr(parent, child)
            fused = _FUSED.get(name)
            shards = model.shard_sizes(fused) if fused else [base.out_features]  # type: ignore[operator]
            wrapped = LoRALinear(base, shards, max_loras, max_rank, rows, like)
            setattr(parent, child, wrapped)
            layers[f"{index}.{name}"] = wrapped
    return layers


def rows_of(layers: dict[str, LoRALinear]) -> LoRARows:
    return next(iter(layers.values())).rows
