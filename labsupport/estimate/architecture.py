"""A decoder-only transformer as it is built: its parameters, FLOPs, activations and the
shapes of its matrix multiplications, from its configuration.

:class:`Transformer` covers the course GPT and GPT-3 (GELU MLP, biases, LayerNorm, learned
positions, tied embeddings), Llama (SwiGLU with its own FFN width, grouped-query attention,
RMSNorm, untied output layer) and mixture-of-experts models (routed and shared SwiGLU
experts, a few dense layers first, as DeepSeek-V3). Sources:

* parameters: Narayanan et al. 2021, eq. (2) for a GPT; :mod:`labsupport.estimate.moe`
  for the experts and multi-head latent attention (``attention_weights``);
* FLOPs: 6 per weight a token uses (forward 2, backward 4), attention's two products
  ``2·s·(a·d_qk + a·d_v)`` forward per token and layer, the output layer; recomputation
  reruns the forward (Narayanan et al. 2021, appendix; Korthikanti et al. 2022, appendix A);
* activations per token and layer, 16-bit values and 1-byte dropout masks, counted tensor by
  tensor as Korthikanti et al. 2022 (section 4.1) count a GPT's ``34·s·b·h``:
  :meth:`Transformer.activation_bytes`. A SwiGLU MLP keeps its input, the gate and up
  projections, the gate's SiLU and their product (``2h + 8f`` bytes, PyTorch's unfused
  ``F.silu(gate) * up``); Llama has no dropout. For Llama 3 405B that is ``38.25·s·b·h``.
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("gpt", "llama")


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer's shape. ``family="gpt"``: GELU MLP of ``ffn`` (4h by
    default), biases, LayerNorms and dropout; ``"llama"``: SwiGLU (three matrices), no
    biases, RMSNorm, no dropout. ``kv_heads`` for grouped-query attention; ``head_dim``
    and ``v_head_dim`` when they are not ``h/a``; ``attention_weights`` overrides the
    attention's weight count (multi-head latent attention). ``positions``: learned
    position embeddings; ``tied``: the output layer reuses the token embedding.

    Mixture of experts (``n_expert > 0``): every layer after the first ``dense_layers``
    holds ``n_expert`` routed SwiGLU experts of width ``expert_ffn`` (``top_k`` per token),
    ``n_shared`` shared ones and a router; the dense layers' FFN is ``ffn``."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    ffn: int = 0
    kv_heads: int = 0
    family: str = "gpt"
    positions: bool = True
    tied: bool = True
    head_dim: int = 0
    v_head_dim: int = 0
    attention_weights: int = 0
    n_expert: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    n_shared: int = 0
    dense_layers: int = 0

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.n_expert and not (0 < self.top_k <= self.n_expert and self.expert_ffn):
            raise ValueError("an MoE model needs 0 < top_k <= n_expert and expert_ffn")

    # ------------------------------------------------------------------ widths
    @property
    def widths(self) -> dict:
        """Columns of Q, K, V and of the attention's output (the out-projection's input)."""
        d = self.head_dim or self.hidden // self.heads
        dv = self.v_head_dim or d
        kv = self.kv_heads or self.heads
        return {"q": self.heads * d, "k": kv * d, "v": kv * dv, "o": self.heads * dv}

    def splits_heads(self, tp: int) -> bool:
        """Whether ``tp`` tensor-parallel ranks each get whole query heads and whole
        key-value heads (Megatron-core: ``num_query_groups_per_partition =
        divide(num_query_groups, world_size)``)."""
        return not (self.heads % tp or (self.kv_heads or self.heads) % tp)

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.n_expert else 0

    def _ffn(self) -> int:
        return self.ffn or 4 * self.hidden

    # ------------------------------------------------------------------ parameters
    def attention_params(self) -> int:
        w = self.widths
        return self.attention_weights or self.hidden * (w["q"] + w["k"] + w["v"] + w["o"])

    def mlp_params(self, moe: bool = False, active: bool = False) -> int:
        """One layer's FFN weights: dense, or (``moe``) the shared experts, the router
        and all routed experts (``active``: only the ``top_k`` a token uses)."""
        h = self.hidden
        if not moe:
            return (3 if self.family == "llama" else 2) * h * self._ffn()
        expert = 3 * h * self.expert_ffn
        routed = self.top_k if active else self.n_expert
        return self.n_shared * expert + h * self.n_expert + routed * expert

    def layer_weights(self, moe: bool = False, active: bool = False) -> int:
        """Weights of one layer's matrix multiplications."""
        return self.attention_params() + self.mlp_params(moe, active)

    def layer_params(self, moe: bool = False, active: bool = False) -> int:
        """A layer's weights, biases and norms (GPT: QKV, projection, MLP biases, two
        LayerNorms; Llama: two RMSNorm weights)."""
        h, w = self.hidden, self.widths
        if self.family == "llama":
            return self.layer_weights(moe, active) + 2 * h
        biases = w["q"] + w["k"] + w["v"] + h + self._ffn() + h
        return self.layer_weights(moe, active) + biases + 4 * h

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + (self.seq_len * self.hidden if self.positions else 0)

    def params(self, active: bool = False) -> int:
        """All parameters (``active``: those one token uses): layers, embeddings, the final
        norm, an untied output layer."""
        norm = 2 * self.hidden if self.family == "gpt" else self.hidden
        output = 0 if self.tied else self.vocab * self.hidden
        dense = (self.layers - self.moe_layers) * self.layer_params()
        moe = self.moe_layers * self.layer_params(True, active)
        return dense + moe + self.embedding_params() + norm + output

    def expert_params(self) -> int:
        """Parameters of all routed experts: what expert parallelism divides."""
        return self.moe_layers * self.n_expert * 3 * self.hidden * self.expert_ffn

    # ------------------------------------------------------------------ FLOPs
    def attention_flops(self) -> float:
        """Forward FLOPs per token and layer of attention's two products (Q·Kᵀ and the
        scores times V), every key counted (the convention of Narayanan et al.)."""
        w = self.widths
        return 2 * self.seq_len * (w["q"] + w["o"])

    def flops_per_token(self, recompute: str = "none") -> float:
        """Training FLOPs per token: 6 per weight a token uses, attention's products, the
        output layer; ``"full"`` recomputation reruns each layer's forward, ``"selective"``
        its attention products (FlashAttention's backward does the same)."""
        attention, total = self.attention_flops(), 0.0
        for moe, count in ((False, self.layers - self.moe_layers), (True, self.moe_layers)):
            weights = 2 * self.layer_weights(moe, active=True)
            extra = {"none": 0, "selective": attention, "full": weights + attention}[recompute]
            total += count * (3 * (weights + attention) + extra)
        return total + 6 * self.hidden * self.vocab

    # ------------------------------------------------------------------ activations
    def activation_bytes(
        self,
        recompute: str = "selective",
        tp: int = 1,
        sequence_parallel: bool = False,
        fused_attention: bool = False,
        moe: bool = False,
    ) -> float:
        """Bytes one layer keeps for the backward pass, per token this GPU holds (16-bit
        values, 1-byte masks), tensor by tensor (Korthikanti et al. 2022, section 4.1):

        * norms: their two inputs, ``4h``; attention: the QKV input ``2h``, Q, K, V and the
          out-projection's input ``2(q + k + v + o)`` (``8h`` for a GPT), a GPT's dropout
          mask ``h``; MLP: its input ``2h``, GELU's input and output ``4f`` and a mask
          ``h`` (GPT), or SwiGLU's ``8f``; an MoE layer keeps, per routed copy of a
          token, the expert's input ``2h`` and its ``8f``, and the shared experts' ``8f``;
        * without recomputation, the score matrices too, ``a·s`` values per token (the
          softmax output, and a GPT's dropout output and mask: ``5·a·s`` bytes), unless
          attention is fused (FlashAttention keeps none);
        * ``"full"``: only the layer's input, ``2h``.

        Tensor parallelism over ``tp`` splits Q, K, V, the heads and the FFN's width;
        sequence parallelism splits the rest too. For a GPT: ``34 + 5·a·s/h`` times
        ``h``, as :func:`labsupport.estimate.memory.activation_memory`."""
        h, w, gpt = self.hidden, self.widths, self.family == "gpt"
        t = tp
        if recompute == "full":
            return 2 * h / (t if sequence_parallel else 1)
        mask = 1 if gpt else 0
        split = 2 * (w["q"] + w["k"] + w["v"] + w["o"])
        unsplit = 4 * h + 2 * h + mask * h  # norms, QKV input, attention's dropout mask
        if moe:  # the MLP's input, and an expert's input per routed copy of the token
            split += 8 * self.expert_ffn * (self.top_k + self.n_shared)
            unsplit += 2 * h * (1 + self.top_k)
        else:
            split += (8 if self.family == "llama" else 4) * self._ffn()
            unsplit += 2 * h + mask * h
        per_token = (split + unsplit) / t if sequence_parallel else split / t + unsplit
        if recompute == "none" and not fused_attention:
            per_token += self.heads * self.seq_len * (5 if gpt else 2) / t
        return per_token
