"""A top-k mixture of experts (Qwen3-MoE, Mixtral), computed grouped over a step's tokens.

The router scores every expert for each token (a softmax over ``num_experts`` logits, in float32) and keeps the
``num_experts_per_tok`` best, renormalised where the model asks. The step's (token, expert) pairs are then sorted by
expert, so each expert runs one matmul over all of its tokens, never a loop per token:

    x [T, H] --router--> top-k experts [T, k] --sort by expert--> rows [T*k, H] grouped:  | e0 ... | e1 ... | e5 |
    each group: down(act(gate(x)) * up(x)) with that expert's weights, times its routing weight
    y [T, H] = the groups' rows added back to their tokens (index_add, experts in increasing order)

Expert weights live stacked, ``experts_gate_up`` [E, 2I, H] (gate rows first) and ``experts_down`` [E, H, I]; the
loader (``CausalLM.load_hf_tensors``) copies a checkpoint's per-expert tensors into their slices, under either
model's names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def activation(name: str):
    """The gated MLP's activation by ModelArgs.hidden_act."""
    return F.silu if name == "silu" else lambda x: F.gelu(x, approximate="tanh")


class SparseMoE(nn.Module):
    """One layer's experts and router. Parameters: ``gate`` (the router, [E, H]), ``experts_gate_up``,
    ``experts_down``."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool, act: str):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate = intermediate
        self.act = activation(act)
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) of each token's chosen experts."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.route(x)
        flat = ids.flatten()  # [T*k]
        order = flat.argsort(stable=True)  # (token, expert) pairs grouped by expert, tokens in order within
        tokens = order // self.top_k
        rows = x.index_select(0, tokens)  # [T*k, H]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync a layer
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                gate, up = F.linear(rows[start : start + n], self.experts_gate_up[e]).split(self.intermediate, -1)
                out[start : start + n] = F.linear(self.act(gate) * up, self.experts_down[e])
                start += n
        out *= weights.flatten().index_select(0, order)[:, None]
        return torch.zeros_like(x).index_add_(0, tokens, out)
