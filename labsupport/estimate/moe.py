"""Mixture-of-experts numbers: total against active parameters, and the bytes expert
parallelism moves.

* :func:`moe_params` counts a decoder's parameters from its published configuration, and
  how many a token uses: all of them but the routed experts it is not sent to. For
  Mixtral 8x7B (Jiang et al. 2024, table 1) it gives 46.7B and 12.9B, Mistral AI's
  figures (the paper rounds them to 47B and 13B); for DeepSeek-V3 (DeepSeek-AI 2024,
  section 4.2) 671.0B and 37.6B, which the report gives as 671B and 37B.
* :func:`gpt_moe_params`: the same for the course GPT with ``GPTConfig(moe=...)``.
* :func:`all_to_all_bytes` and :func:`balanced_all_to_all_bytes`: what each rank of an
  expert-parallel group sends per MoE layer and training step, from the routing, and
  when every expert gets the same share.
"""

from __future__ import annotations

#: Mixtral 8x7B, Jiang et al. 2024 ("Mixtral of Experts", table 1): Mistral 7B's
#: attention (grouped-query, 8 key-value heads) and 8 SwiGLU experts per layer, top-2.
MIXTRAL_8X7B = {
    "layers": 32,
    "hidden": 4096,
    "vocab": 32000,
    "tied": False,
    "attention": {"kind": "gqa", "heads": 32, "kv_heads": 8, "head_dim": 128},
    "expert_ffn": 14336,
    "n_expert": 8,
    "top_k": 2,
    "source": "Jiang et al. 2024, table 1",
}

#: DeepSeek-V3, DeepSeek-AI 2024 (section 4.2 and the released config): 61 layers, the
#: first 3 dense (FFN 18,432 wide), the others 1 shared and 256 routed experts of width
#: 2,048 with 8 routed per token; multi-head latent attention (MLA, section 2.1.1).
#: The multi-token-prediction module (14B more) is not part of the 671B.
DEEPSEEK_V3 = {
    "layers": 61,
    "hidden": 7168,
    "vocab": 129280,
    "tied": False,
    "attention": {
        "kind": "mla",
        "heads": 128,
        "q_rank": 1536,
        "kv_rank": 512,
        "nope_dim": 128,
        "rope_dim": 64,
        "v_dim": 128,
    },
    "dense_layers": 3,
    "dense_ffn": 18432,
    "expert_ffn": 2048,
    "n_expert": 256,
    "n_shared": 1,
    "top_k": 8,
    "source": "DeepSeek-AI 2024, sections 2.1 and 4.2",
}


def attention_params(hidden: int, a: dict) -> int:
    """One layer's attention weights (no biases, as both models): grouped-query attention's
    Q, K, V and output projections, or MLA's low-rank projections and their norms."""
    if a["kind"] == "gqa":
        q_and_out = 2 * hidden * a["heads"] * a["head_dim"]
        return q_and_out + 2 * hidden * a["kv_heads"] * a["head_dim"]
    qk = a["nope_dim"] + a["rope_dim"]
    query = hidden * a["q_rank"] + a["q_rank"] + a["q_rank"] * a["heads"] * qk
    key_value = hidden * (a["kv_rank"] + a["rope_dim"]) + a["kv_rank"]
    key_value += a["kv_rank"] * a["heads"] * (a["nope_dim"] + a["v_dim"])
    return query + key_value + a["heads"] * a["v_dim"] * hidden


def swiglu_params(hidden: int, width: int) -> int:
    """A SwiGLU FFN: gate, up and down projections."""
    return 3 * hidden * width


def moe_params(m: dict) -> dict:
    """``{"total", "active", "routed experts"}``: every parameter, those one token uses
    (the ``top_k`` routed experts of each MoE layer, not all ``n_expert``), and those
    of the routed experts. RMSNorms (2 per layer and a final one) included."""
    h, layers = m["hidden"], m["layers"]
    dense_layers = m.get("dense_layers", 0)
    moe_layers = layers - dense_layers
    expert = swiglu_params(h, m["expert_ffn"])
    shared = m.get("n_shared", 0) * expert + h * m["n_expert"]  # shared experts, router
    always = layers * (attention_params(h, m["attention"]) + 2 * h) + h
    always += dense_layers * swiglu_params(h, m.get("dense_ffn", 0))
    always += moe_layers * shared + m["vocab"] * h * (1 if m["tied"] else 2)
    routed = moe_layers * m["n_expert"] * expert
    active = always + moe_layers * m["top_k"] * expert
    return {"total": always + routed, "active": active, "routed experts": routed}


def gpt_moe_params(vocab: int, block: int, n_embd: int, n_layer: int, n_expert: int, top_k: int):
    """``{"total", "active"}`` of the course GPT (tied embeddings, biases) whose every
    MLP is an MoE of ``n_expert`` such MLPs (``8d² + 5d`` each) with a router (``d·E``)."""
    d = n_embd
    expert = 8 * d * d + 5 * d
    always = vocab * d + block * d + 2 * d + n_layer * (4 * d * d + 4 * d + 4 * d + d * n_expert)
    return {
        "total": always + n_layer * n_expert * expert,
        "active": always + n_layer * top_k * expert,
    }


def all_to_all_bytes(rows_to: list[list[int]], hidden: int, bytes_per_value: int = 4) -> list:
    """Bytes each rank sends per MoE layer and step, ``rows_to[i][j]`` rows going from rank
    ``i`` to rank ``j`` in the dispatch: rank ``i`` sends its rows for other ranks (the
    dispatch) and the results of the rows it got from them (the combine), and the
    backward pass does both again, ``2 · h · bytes`` per row sent or received."""
    ranks = range(len(rows_to))
    return [
        2 * hidden * bytes_per_value * sum(rows_to[i][j] + rows_to[j][i] for j in ranks if j != i)
        for i in ranks
    ]


def balanced_all_to_all_bytes(
    tokens: int, top_k: int, ep: int, hidden: int, bytes_per_value: int = 4
) -> float:
    """The same when every rank's ``tokens · top_k`` choices spread evenly over the ``ep``
    ranks and nothing is dropped: each rank sends and receives ``(ep - 1)/ep`` of them,
    ``4 · T · k · (ep - 1)/ep · h · bytes``."""
    return 4 * tokens * top_k * (ep - 1) / ep * hidden * bytes_per_value
