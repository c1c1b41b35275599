"""Context parallelism by the numbers: bytes per rank, attention work per rank, memory.

Per attention layer and rank, with ``b`` sequences of ``s`` tokens split over ``cp``
ranks, ``a`` query heads and ``a_kv`` key/value heads of dimension ``d``:

* :func:`bytes_per_rank`: what each variant sends, forward and backward, with the
  course's implementations (:mod:`labsupport.parallel.context_parallel` and
  ``context_parallel_variants``). Let ``KV = 2·b·a_kv·(s/cp)·d`` values, one rank's keys
  and values, and ``Q = b·a·(s/cp)·d``.

  - ring: forward ``(cp-1)·KV`` (the K/V chunks passed on ``cp - 1`` times); backward
    the same again, and ``(cp-1)·KV`` of gradients following them home;
  - all-gather K/V (Llama 3): an all-gather forward, an all-gather and a reduce-scatter
    backward, each ``(cp-1)/cp`` of ``cp·KV`` per rank in a ring (chapter 8): the ring's
    bytes exactly, in 3 collectives instead of ``3(cp-1)`` messages;
  - Ulysses (Jacobs et al. 2023): all-to-alls of Q, K, V and the output forward, of their
    gradients backward, each sending ``(cp-1)/cp`` of what a rank holds:
    ``2·(cp-1)/cp·(2Q + KV)``. DeepSpeed's "4Nh/P per link" is this forward half, with
    ``a_kv = a`` and ``(cp-1)/cp ≈ 1``.

* :func:`score_blocks`: the query-key scores each rank computes under a causal mask,
  contiguous or zig-zag: the imbalance and its cure.
* :func:`activation_per_gpu`: Korthikanti et al.'s activation bytes per layer
  (:func:`labsupport.estimate.memory.activation_memory`) with tensor and sequence
  parallelism over ``t`` and the sequence split over ``cp``.
* :func:`min_block_tokens`: Liu et al.'s condition for hiding the ring's transfers,
  ``c ≥ F/B`` tokens per block (section 3, "Arithmetic Intensity Between Hosts").
"""

from __future__ import annotations

from labsupport.estimate.memory import activation_memory

VARIANTS = ("ring", "all_gather", "ulysses")


def bytes_per_rank(
    variant: str,
    b: int,
    s: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    cp: int,
    bytes_per_value: int = 4,
    grad_bytes: int = 4,
) -> dict:
    """Bytes one rank sends in one attention layer: ``{"forward", "backward", "total",
    "messages"}`` (point-to-point messages for the ring, collectives for the others).
    ``grad_bytes``: the K/V gradients of the ring and the all-gather travel in float32
    (as PyTorch's ring does); Ulysses sends its gradients in the activations' dtype."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    kv = 2 * b * kv_heads * s // cp * head_dim
    q = b * heads * s // cp * head_dim
    if variant == "ulysses":
        one_way = (cp - 1) / cp * (2 * q + kv) * bytes_per_value
        forward, backward, messages = one_way, one_way, 8
    else:
        forward = (cp - 1) * kv * bytes_per_value
        backward = (cp - 1) * kv * (bytes_per_value + grad_bytes)
        messages = 3 * (cp - 1) if variant == "ring" else 3
    if cp == 1:
        messages = 0
    return {
        "forward": forward,
        "backward": backward,
        "total": forward + backward,
        "messages": messages,
    }


def score_blocks(cp: int, layout: str = "zigzag", causal: bool = True) -> list[int]:
    """Score blocks each rank computes in one forward pass, in units of
    ``(s / 2cp)²`` query-key scores (a chunk of the zig-zag layout squared).

    Contiguous: rank ``r``'s queries see the ``r`` chunks before theirs in full and their
    own causally, ``r + 1`` blocks of ``(s/cp)²``, ``4(r + 1)`` units: the last rank does
    ``cp`` times the first's. Zig-zag: every rank computes its own two chunks causally
    (two diagonal units and the full unit between them) and two units with each other
    rank, ``2cp + 1``. Without a mask, ``4cp`` each. A diagonal block counts whole, as
    the kernels compute it (masking half of it).
    """
    if not causal:
        return [4 * cp] * cp
    if layout == "contiguous":
        return [4 * (r + 1) for r in range(cp)]
    if layout == "zigzag":
        return [2 * cp + 1] * cp
    raise ValueError(f"layout must be 'zigzag' or 'contiguous', got {layout!r}")


def imbalance(work: list) -> float:
    """The slowest rank's work over the mean: what a step waits for, relative to a
    perfect split."""
    return max(work) / (sum(work) / len(work))


def activation_per_gpu(
    seq_len, batch, hidden, heads, layers, tp: int = 1, cp: int = 1, recompute: str = "selective"
) -> float:
    """Activation bytes per GPU for ``layers`` layers with tensor and sequence
    parallelism over ``tp`` and context parallelism over ``cp`` (16-bit values, 1-byte
    masks). Every per-token tensor of Korthikanti et al.'s count shrinks to ``s/cp``
    tokens; ``recompute="none"`` keeps each rank's rows of the score matrices too,
    ``a·(s/cp)·s`` values per sequence and layer, split over ``tp`` ranks by heads;
    ``"selective"`` (or FlashAttention, which never stores them) keeps none."""
    local = seq_len / cp
    if recompute == "full":
        return activation_memory(local, batch, hidden, heads, layers, "full", 2, 1, tp, True)
    kept = activation_memory(local, batch, hidden, heads, layers, "selective", 2, 1, tp, True)
    if recompute == "none":
        kept += layers * heads * local * seq_len * batch * (2 * 2 + 1) / tp
    return kept


def min_block_tokens(flops_per_s: float, bytes_per_s: float) -> float:
    """Liu et al. 2023: a block of ``c`` tokens costs ``4·d·c²`` FLOPs of attention and
    its K and V ``4·c·d`` bytes (bf16) to pass on, so the transfer hides behind the
    compute when ``c ≥ F/B`` tokens."""
    return flops_per_s / bytes_per_s
