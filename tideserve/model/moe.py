"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks ``top_k`` of ``num_experts`` SwiGLU experts
per token and the block returns their outputs weighted by the routing probabilities.

The experts run as one GEMM each over the rows routed to them, not token by token: the (token, expert)
assignments are sorted by expert, each expert with tokens multiplies its gathered rows, and the weighted
products are scatter-added back (``index_add_``). A decode step of one sequence runs ``top_k`` small
GEMMs; a prefill of T tokens runs at most ``num_experts`` GEMMs of about ``T * top_k / num_experts`` rows.

Each expert is a ``LlamaMLP`` (fused gate|up ``Linear`` and a down ``Linear``) rather than one stacked
[n_expert, out, in] tensor per projection: every weight format a ``Linear`` takes then works per expert
unchanged (float, GGUF blocks through the native kernels, ``--quantization int8``/``int4``, quantization
while loading), a GGUF file's stacked tensors slice into per-expert blocks without a copy of the layout,
and tensor parallelism shards each expert as it shards a dense MLP. The cost is one Python call per
active expert, which the sort above bounds by the experts that have tokens.

The router stays float (``Router``, never a ``Linear``): quantizing it would move which experts a token
reaches, an error no later layer can undo, for no measurable speed (it is [num_experts, hidden]).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tideserve.model.arch_config import ArchConfig

if TYPE_CHECKING:
    from tideserve.model.layers.linear import CollectiveGroup

# Mixtral checkpoints: block_sparse_moe.{gate, experts.N.w1|w3|w2} -> our mlp.{gate, experts.N.gate|up|down}
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_RE = re.compile(r"\.block_sparse_moe\.(?:(gate)|experts\.(\d+)\.(w[123]))\.")
# transformers 5's fused experts: experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]
_FUSED_RE = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)(\.weight)?$")


class Router(nn.Module):
    """The float [num_experts, hidden] gate; its softmax is taken in float32, as transformers does."""

    def __init__(self, num_experts: int, hidden: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> routing probabilities [T, num_experts], float32."""
        return torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)


class SparseMoeBlock(nn.Module):
    """``num_experts`` SwiGLU experts of ``moe_intermediate_size``; each token's output is the sum of its
    ``top_k`` experts' outputs weighted by their routing probabilities (renormalised over the top k when
    ``norm_topk_prob``). Weighted sums accumulate in float32 and are cast to the model's dtype once.

    Under tensor parallelism (``group`` set) each rank holds every expert's slice of the intermediate
    dimension, so each expert's product is a partial sum; the block all-reduces once, after every expert,
    as the dense MLP does after its down projection. The router is replicated, so ranks route alike.
    """

    def __init__(self, arch: ArchConfig, experts: Iterable[nn.Module], dtype: torch.dtype,
                 device: torch.device | str) -> None:
        """``experts``: ``arch.num_experts`` SwiGLU MLPs (the model's ``LlamaMLP``s of
        ``moe_intermediate_size``), built by the model so that this module needs none of its classes."""
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        self.gate = Router(arch.num_experts, arch.hidden_size, dtype, device)
        self.experts = nn.ModuleList(experts)
        if len(self.experts) != arch.num_experts:
            raise ValueError(f"{len(self.experts)} experts for num_experts={arch.num_experts}")
        self.group: CollectiveGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x).topk(self.top_k, dim=-1)  # [T, k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if x.shape[0] == 1:
            return self._one_token(x, weights[0].tolist(), chosen[0].tolist())
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # the assignments grouped by expert, in token order within each
        tokens = order // self.top_k
        scale = weights.reshape(-1)[order].unsqueeze(1)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                rows = tokens[start:start + n]
                y = expert(x.index_select(0, rows))
                out.index_add_(0, rows, y.float().mul_(scale[start:start + n]))
                start += n
        if self.group is not None:
            self.group.all_reduce(out)
        return out.to(x.dtype)

    def _one_token(self, x: torch.Tensor, weights: list[float], chosen: list[int]) -> torch.Tensor:
        """A single token (one sequence's decode step): its ``top_k`` experts on ``x`` itself, with no
        gather or scatter; a third of the operators of the grouped path, which at one token are most of
        the block's time beside the weights' own streaming. The same sums in the same order."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert, weight in zip(chosen, weights, strict=True):
            out.add_(self.experts[expert](x).float(), alpha=weight)
        if self.group is not None:
            self.group.all_reduce(out)
        return out.to(x.dtype)


def checkpoint_tensors(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Checkpoint tensors under the names the model's modules take: Mixtral's ``block_sparse_moe`` names
    become ``mlp.gate`` / ``mlp.experts.N.{gate,up,down}_proj``, and transformers 5's fused 3-D expert
    parameters are split into those per-expert matrices. Everything else passes through unchanged."""
    for name, tensor in weights:
        m = _MIXTRAL_RE.search(name)
        if m:
            part = "gate" if m.group(1) else f"experts.{m.group(2)}.{_MIXTRAL_EXPERT[m.group(3)]}"
            name = f"{name[:m.start()]}.mlp.{part}.{name[m.end():]}"
        m = _FUSED_RE.match(name)
        if m and isinstance(tensor, torch.Tensor) and tensor.dim() == 3:
            prefix, fused = m.group(1), m.group(2)
            for e, matrix in enumerate(tensor.unbind(0)):
                if fused == "down_proj":
                    yield f"{prefix}.{e}.down_proj.weight", matrix
                else:
                    gate, up = matrix.chunk(2, dim=0)
                    yield f"{prefix}.{e}.gate_proj.weight", gate
                    yield f"{prefix}.{e}.up_proj.weight", up
            continue
        yield name, tensor
