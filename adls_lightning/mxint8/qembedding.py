"""``QEmbeddingPacked``: an embedding table stored as MXINT8 (groups along the embedding dimension).

Optional when exporting (``pack_embeddings=true``): in a small BERT the word embeddings are about half the
bytes (MiniLM: 46.9 of 90.9 MB), and a lookup only dequantizes the rows it gathers.
"""

from __future__ import annotations

import torch
from torch import nn

from adls_lightning.mxint8.ops import dequantize, quantize


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
        if group_size <= 0 or embedding_dim % group_size:
            raise ValueError(
                f"QEmbeddingPacked: group_size={group_size} must be a positive divisor of "
                f"embedding_dim={embedding_dim}"
            )
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.group_size = group_size
        self.register_buffer(
            "weight_mantissa", torch.zeros(num_embeddings, embedding_dim, dtype=torch.int8, device=device)
        )
        self.register_buffer(
            "weight_scale",
            torch.zeros(num_embeddings, embedding_dim // group_size, dtype=torch.uint8, device=device),
        )

    @classmethod
    @torch.no_grad()
    def from_embedding(cls, embedding: nn.Embedding, group_size: int = 32) -> QEmbeddingPacked:
        weight = embedding.weight.detach()
        packed = cls(embedding.num_embeddings, embedding.embedding_dim, group_size, device=weight.device)
        mantissa, scale = quantize(weight, group_size)
        packed.weight_mantissa.copy_(mantissa)
        packed.weight_scale.copy_(scale)
        return packed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.weight_mantissa[ids], self.weight_scale[ids], self.group_size, torch.float32)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, group_size={self.group_size}"
