"""``QEmbeddingPacked``: an embedding table stored as MXINT8 (groups along the embedding dimension).

Optional when exporting (``pack_embeddings=true``): in a small BERT the word embeddings are about half the
bytes (MiniLM: 46.9 of 90.9 MB), and a lookup only dequantizes the rows it gathers.
"""

from __future__ import annotations

import torch
from torch import nn

from adls_lightning.mxint8.ops import dequantize
from adls_lightning.mxint8.packed_weight import register_packed_weight, store_packed_weight


class QEmbeddingPacked(nn.Module):
    """``nn.Embedding`` lookup from ``weight_mantissa`` (int8) and ``weight_scale`` (uint8) buffers (inference)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group_size: int = 32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        register_packed_weight(self, num_embeddings, embedding_dim, group_size, "embedding_dim", device)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim

    @classmethod
    @torch.no_grad()
    def from_embedding(cls, embedding: nn.Embedding, group_size: int = 32) -> QEmbeddingPacked:
        weight = embedding.weight
        packed = cls(embedding.num_embeddings, embedding.embedding_dim, group_size, device=weight.device)
        store_packed_weight(packed, weight)
        return packed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.weight_mantissa[ids], self.weight_scale[ids], self.group_size, torch.float32)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, group_size={self.group_size}"
