"""Forward passes of a transformers Llama/Qwen2-family causal LM (dense or MoE) with our own KV cache.

The weights and the layer modules are the transformers model's own (`q_proj`, `input_layernorm`,
`mlp`, `rotary_emb`, ...); only the *orchestration* of a step is ours, because an engine needs
control over the cache that `model.forward` does not give:

* prefill of one sequence on top of a reused prefix (prefix cache), in chunks so an 8k-token
  prompt never builds an 8k x 8k attention matrix;
* one decode step for many sequences of different lengths at once, reading and writing a
  batch KV buffer in place (`BatchKV`), so a step costs one forward, not one per sequence;
* logits only where they are needed (the last position, or the scored positions), because the
  LM head is the most expensive matmul of a small model with a large vocabulary.

Numerics follow the transformers implementation (tested against `model(input_ids).logits`).

Mixture-of-experts models (Qwen3-MoE, GLM-4.5) run their transformers MLP blocks as they are; a
forward hook on each router records which experts every token was sent to (`Routing`), so the
KV of a sequence carries its routing beside it (`SeqKV.routing`) through the batch and the prefix
cache, and a cached prefix answers with the routing it was computed with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Glm4MoeForCausalLM",
)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Glm4MoeForCausalLM")


@dataclass
class SeqKV:
    """One sequence's keys and values: per layer a (K, V) pair of shape [kv_heads, length, head_dim];
    for an MoE model also the experts each of its tokens was routed to (see `Routing`)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    routing: torch.Tensor | None = None
    """int32 [length, num_layers, top_k] (MoE models only): row p is token p's experts per layer."""

    def __post_init__(self) -> None:
        if self.routing is not None and self.layers and self.routing.shape[0] != self.length:
            raise ValueError(f"routing covers {self.routing.shape[0]} tokens, the KV {self.length}")

    @property
    def length(self) -> int:
        return 0 if not self.layers else self.layers[0][0].shape[1]

    def prefix(self, n: int) -> SeqKV:
        routing = self.routing[:n] if self.routing is not None else None
        return SeqKV([(k[:, :n], v[:, :n]) for k, v in self.layers], routing)

    def nbytes(self) -> int:
        routing = self.routing.nbytes if self.routing is not None else 0
        return routing + sum(k.nbytes + v.nbytes for k, v in self.layers)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    # cos/sin: [batch, seq, rotary_dim] -> broadcast over heads. A rotary_dim below head_dim is a
    # partial rotary embedding (GLM-4.5: the first half of each head rotates, the rest passes).
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    rot = cos.shape[-1]
    if rot == q.shape[-1]:
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    q_rot, k_rot = q[..., :rot], k[..., :rot]
    q_rot = q_rot * cos + _rotate_half(q_rot) * sin
    k_rot = k_rot * cos + _rotate_half(k_rot) * sin
    return torch.cat([q_rot, q[..., rot:]], dim=-1), torch.cat([k_rot, k[..., rot:]], dim=-1)


class Routing:
    """Records the experts an MoE model routes each token to, by forward hooks on its routers.

    Both transformers MoE blocks served here call their router (``mlp.gate``) once per forward
    with the tokens flattened and get ``(logits, weights, indices)`` back; ``indices`` [tokens,
    top_k] are the experts chosen, after whatever the router chooses by (GLM: sigmoid score plus
    ``e_score_correction_bias``, while the weights use the score alone), so the hook records what
    the MoE block then computes with. Dense layers (GLM's first) have no router and report expert
    0 in every slot, as SGLang's buffer does. `load` counts the tokens routed to each expert of
    each layer since the engine started (the /metrics counters).
    """

    def __init__(self, model: torch.nn.Module, num_layers: int, top_k: int, num_experts: int):
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.long)
        self._step: dict[int, torch.Tensor] = {}
        self.moe_layers: list[int] = []
        for li, layer in enumerate(model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(layer.mlp, "experts"):
                self.moe_layers.append(li)
                gate.register_forward_hook(self._hook(li))

    def _hook(self, layer: int):
        def record(_module, _inputs, output) -> None:
            indices = output[2]
            self._step[layer] = indices.to(torch.int32)
            self.load[layer] += torch.bincount(indices.reshape(-1), minlength=self.num_experts)

        return record

    def take(self, tokens: int) -> torch.Tensor:
        """The experts of the `tokens` tokens of the forward that just ran: int32 [tokens, layers, top_k]."""
        out = torch.zeros(tokens, self.num_layers, self.top_k, dtype=torch.int32)
        for layer, indices in self._step.items():
            out[:, layer] = indices.view(tokens, self.top_k)
        self._step.clear()
        return out


class BatchKV:
    """KV buffer of the running batch: per layer [rows, kv_heads, capacity, head_dim].

    Row i holds sequence i's cache at positions 0..len-1 (right padding, masked in attention).
    Active rows are always 0..n-1: removing a row moves the last row into its place.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = num_layers, kv_heads, head_dim, dtype
        self.rows = 0
        self.lengths: list[int] = []
        self.routing: list[list[torch.Tensor]] = []  # MoE: per row, the routing of its tokens in chunks
        self._alloc(4, 256)

    def _alloc(self, row_cap: int, len_cap: int) -> None:
        shape = (row_cap, self.kv_heads, len_cap, self.head_dim)
        new = [
            (torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
            for _ in range(self.num_layers)
        ]
        if self.rows:
            longest = max(self.lengths)
            for (nk, nv), (ok, ov) in zip(new, self.k_v, strict=True):
                nk[: self.rows, :, :longest] = ok[: self.rows, :, :longest]
                nv[: self.rows, :, :longest] = ov[: self.rows, :, :longest]
        self.k_v = new
        self.row_cap, self.len_cap = row_cap, len_cap

    def ensure(self, rows: int, length: int) -> None:
        if rows <= self.row_cap and length <= self.len_cap:
            return
        row_cap, len_cap = self.row_cap, self.len_cap
        while row_cap < rows:
            row_cap *= 2
        while len_cap < length:
            len_cap *= 2
        self._alloc(row_cap, len_cap)

    def add(self, kv: SeqKV) -> int:
        n = kv.length
        self.ensure(self.rows + 1, n + 1)
        row = self.rows
        for (bk, bv), (k, v) in zip(self.k_v, kv.layers, strict=True):
            bk[row, :, :n] = k
            bv[row, :, :n] = v
        self.rows += 1
        self.lengths.append(n)
        self.routing.append([kv.routing] if kv.routing is not None else [])
        return row

    def extract(self, row: int) -> SeqKV:
        n = self.lengths[row]
        routing = torch.cat(self.routing[row]) if self.routing[row] else None
        return SeqKV([(k[row, :, :n].clone(), v[row, :, :n].clone()) for k, v in self.k_v], routing)

    def remove(self, row: int) -> int | None:
        """Drops `row`; returns the index of the row that moved into its place (or None)."""
        last = self.rows - 1
        moved = None
        if row != last:
            n = self.lengths[last]
            for k, v in self.k_v:
                k[row, :, :n] = k[last, :, :n]
                v[row, :, :n] = v[last, :, :n]
            self.lengths[row] = n
            self.routing[row] = self.routing[last]
            moved = last
        self.lengths.pop()
        self.routing.pop()
        self.rows -= 1
        return moved


class ModelRunner:
    """Runs prefill and batched decode over a transformers causal LM on CPU."""

    def __init__(self, model: torch.nn.Module, prefill_chunk: int = 1024):
        arch = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"the embedded engine runs {', '.join(SUPPORTED_ARCHITECTURES)}; this model is {arch}"
            )
        if getattr(model.config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported by the embedded engine")
        self.model = model.eval()
        cfg = model.config
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.dtype = next(model.parameters()).dtype
        self.prefill_chunk = prefill_chunk
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context_length = int(getattr(cfg, "max_position_embeddings", 4096))
        self.routing: Routing | None = None
        if arch in MOE_ARCHITECTURES:
            experts = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
            self.routing = Routing(model, self.num_layers, cfg.num_experts_per_tok, experts)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a weight update may name: the parameters and buffers under their
        transformers names and, for MoE models, each expert's projections under the per-expert
        checkpoint names (``...mlp.experts.<e>.gate_proj.weight``, ``up_proj``, ``down_proj``: what
        Hub checkpoints, SGLang and the trainer's conversion use) as views into the fused tensors
        transformers 5 keeps (``experts.gate_up_proj`` [experts, 2 x inter, hidden] with the gate
        rows first, ``experts.down_proj`` [experts, hidden, inter]). Writing a view writes the model."""
        tensors = dict(self.model.named_parameters())
        tensors.update(dict(self.model.named_buffers()))
        for name, module in self.model.named_modules():
            gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
            if not name.endswith(".experts") or not isinstance(gate_up, torch.Tensor) or down is None:
                continue
            inter = gate_up.shape[1] // 2
            for e in range(gate_up.shape[0]):
                tensors[f"{name}.{e}.gate_proj.weight"] = gate_up.data[e, :inter]
                tensors[f"{name}.{e}.up_proj.weight"] = gate_up.data[e, inter:]
                tensors[f"{name}.{e}.down_proj.weight"] = down.data[e]
        return tensors

    def new_batch(self) -> BatchKV:
        return BatchKV(self.num_layers, self.kv_heads, self.head_dim, self.dtype)

    # -- one transformer layer, shared by prefill and decode ---------------------------------
    def _qkv(self, layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        attn = layer.self_attn
        b, t, _ = h.shape
        q = attn.q_proj(h).view(b, t, -1, self.head_dim)
        k = attn.k_proj(h).view(b, t, -1, self.head_dim)
        v = attn.v_proj(h).view(b, t, -1, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = _apply_rope(q, k, cos, sin)
        return q, k, v

    def _attend_out(self, layer, residual, q, k, v, mask):
        attn = layer.self_attn
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=self.kv_heads != self.num_heads
        )
        b, _, t, _ = q.shape
        h = residual + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _rope(self, h: torch.Tensor, positions: torch.Tensor):
        return self.model.model.rotary_emb(h, positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head, float32 out."""
        return self.model.lm_head(self.model.model.norm(hidden)).float()

    # -- prefill -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, tokens: list[int], past: SeqKV | None, logits_from: int) -> tuple[SeqKV, torch.Tensor]:
        """Runs `tokens` on top of `past`; returns the full KV and logits for positions >= logits_from.

        Positions are absolute (past.length + i). Logits at absolute position p predict token p+1.
        """
        start = past.length if past is not None else 0
        layers = [(k, v) for k, v in past.layers] if past is not None else None
        ids = torch.tensor(tokens, dtype=torch.long)
        outs: list[torch.Tensor] = []
        routes = [past.routing] if past is not None and past.routing is not None else []
        for c0 in range(0, len(tokens), self.prefill_chunk):
            chunk = ids[c0 : c0 + self.prefill_chunk]
            t = chunk.shape[0]
            pos0 = start + c0
            positions = torch.arange(pos0, pos0 + t).unsqueeze(0)
            h = self.model.model.embed_tokens(chunk.unsqueeze(0))
            cos, sin = self._rope(h, positions)
            total = pos0 + t
            # query i (absolute pos0+i) sees keys 0..pos0+i
            mask = torch.arange(total).unsqueeze(0) <= (torch.arange(t) + pos0).unsqueeze(1)
            new_layers = []
            for li, layer in enumerate(self.model.model.layers):
                residual = h
                x = layer.input_layernorm(h)
                q, k, v = self._qkv(layer, x, cos, sin)
                k, v = k[0], v[0]
                if layers is not None:
                    k = torch.cat([layers[li][0], k], dim=1)
                    v = torch.cat([layers[li][1], v], dim=1)
                new_layers.append((k, v))
                h = self._attend_out(layer, residual, q, k.unsqueeze(0), v.unsqueeze(0), mask)
            layers = new_layers
            if self.routing is not None:
                routes.append(self.routing.take(t))
            keep_from = max(logits_from - pos0, 0)
            if keep_from < t:
                outs.append(self.logits(h[0, keep_from:]))
        assert layers is not None
        logits = torch.cat(outs) if outs else torch.empty(0, self.vocab_size)
        return SeqKV(layers, torch.cat(routes) if routes else None), logits

    # -- decode ------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, batch: BatchKV, tokens: list[int]) -> torch.Tensor:
        """Feeds one token per active row (row i gets tokens[i]); returns logits [rows, vocab]."""
        n = batch.rows
        assert len(tokens) == n, (len(tokens), n)
        pos = torch.tensor(batch.lengths, dtype=torch.long)
        longest = int(pos.max()) + 1
        batch.ensure(n, longest)
        rows = torch.arange(n)
        h = self.model.model.embed_tokens(torch.tensor(tokens, dtype=torch.long).unsqueeze(1))
        cos, sin = self._rope(h, pos.unsqueeze(1))
        mask = (torch.arange(longest).unsqueeze(0) <= pos.unsqueeze(1)).view(n, 1, 1, longest)
        for li, layer in enumerate(self.model.model.layers):
            residual = h
            x = layer.input_layernorm(h)
            q, k, v = self._qkv(layer, x, cos, sin)
            bk, bv = batch.k_v[li]
            bk[rows, :, pos] = k[:, :, 0]
            bv[rows, :, pos] = v[:, :, 0]
            h = self._attend_out(layer, residual, q, bk[:n, :, :longest], bv[:n, :, :longest], mask)
        for i in range(n):
            batch.lengths[i] += 1
        if self.routing is not None:
            for i, row in enumerate(self.routing.take(n).split(1)):
                batch.routing[i].append(row)
        return self.logits(h[:, 0])
