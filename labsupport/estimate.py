"""The three walls of chapter 3, as calculators, and a small GPT that checks them.

* **Compute wall**: training a dense transformer of N parameters on D tokens takes about
  6·N·D floating-point operations (Kaplan et al. 2020, section 2.1): 2·N per token in
  the forward pass, 4·N in the backward pass. :func:`training_flops`,
  :func:`transformer_training_flops` (every matrix multiplication, attention included;
  Narayanan et al. 2021, appendix), :func:`training_days`.
* **Memory wall**: mixed-precision training with Adam keeps 16 bytes per parameter
  (Rajbhandari et al. 2020, ZeRO, section 3.1), before activations;
  :func:`training_memory`. Activations per transformer layer follow Korthikanti et al.
  2022, section 4: :func:`activation_memory`.
* **Communication wall**: a data-parallel step all-reduces the gradients; a ring sends
  2(N-1)/N of them out of every rank (Patarasuk and Yuan 2009), which
  :func:`labsupport.comm.all_reduce_time` turns into seconds. :func:`step_times`,
  :func:`walls`, :func:`explorer`.

The small GPT at the end (:class:`GPT`, nanoGPT's layout, written out so that every
tensor the formulas count is visible) is what the lab measures: its optimizer state,
the tensors autograd saves for the backward pass, the FLOPs of a training step, and the
bytes a data-parallel step all-reduces.

Datasheets and papers behind the numbers:

* A100: https://www.nvidia.com/en-us/data-center/a100/ (BF16 tensor core 312 TFLOPS
  dense, 624 with sparsity; 80 GB). H100 SXM: https://www.nvidia.com/en-us/data-center/h100/
  (BF16 1,979 TFLOPS *with sparsity*, so 989 dense; 80 GB).
* GPT-3: Brown et al. 2020, table 2.1 and table D.1. BLOOM: BigScience 2022, sections
  3.2 to 3.5. Llama 3: Grattafiori et al. 2024, sections 1, 3.1 to 3.3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from labsupport import comm, plotting

GB = 1e9  # decimal gigabytes, as datasheets use
SECONDS_PER_DAY = 86_400
ASSUMED_MFU = 0.40  # model FLOPs utilization assumed throughout (Llama 3 405B: 38-43%)
ASSUMED_ALPHA = 5e-6  # latency per message, as in chapter 5 (assumed, not measured)
BATCH_TOKENS = 4 * 1024 * 4096  # Llama 3 405B's first batch: 1,024 sequences of 4,096
RECOMPUTE = ("none", "selective", "full")  # activation recomputation: Korthikanti et al.

# --------------------------------------------------------------------------- datasheets

GPUS = {
    "A100": {
        "name": "NVIDIA A100 80GB SXM",
        "bf16_flops": 312e12,
        "memory": 80 * GB,
        "source": "https://www.nvidia.com/en-us/data-center/a100/",
    },
    "H100": {
        "name": "NVIDIA H100 SXM",
        "bf16_flops": 989e12,
        "memory": 80 * GB,
        "source": "https://www.nvidia.com/en-us/data-center/h100/",
    },
}

MODELS = {
    "GPT-3 175B": {
        "params": 175e9,
        "tokens": 300e9,
        "layers": 96,
        "hidden": 12288,
        "heads": 96,
        "seq_len": 2048,
        "batch_tokens": 3.2e6,
        "reported_flops": 3.14e23,
        "source": "Brown et al. 2020, tables 2.1 and D.1",
    },
    "BLOOM 176B": {
        "params": 176_247e6,
        "tokens": 366e9,
        "layers": 70,
        "hidden": 14336,
        "heads": 112,
        "seq_len": 2048,
        "batch_tokens": 2048 * 2048,
        "reported_gpu_hours": 1_082_990,
        "source": "BigScience 2022, sections 3.2 and 3.5",
    },
    "Llama 3 405B": {
        "params": 405e9,
        "tokens": 15.6e12,
        "layers": 126,
        "hidden": 16384,
        "heads": 128,
        "seq_len": 8192,
        "batch_tokens": 16 * 1024 * 1024,
        "reported_flops": 3.8e25,
        "source": "Grattafiori et al. 2024, sections 1 and 3",
    },
}

# --------------------------------------------------------------------------- compute wall

FORWARD_FLOPS_PER_PARAM = 2  # one multiply and one add per weight and token
BACKWARD_FLOPS_PER_PARAM = 4  # the gradient for the input and the gradient for the weight


def training_flops(num_params, num_tokens):
    """FLOPs to train a dense model of ``num_params`` parameters on ``num_tokens`` tokens.

    C ≈ 6·N·D (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section
    2.1): every weight does one multiply-add (2 FLOPs) per token in the forward pass, and
    twice that in the backward pass (one product for the gradient of the layer's input,
    one for the gradient of the weight). It leaves out attention's s×s products (see
    :func:`transformer_training_flops`) and recomputation.
    """
    return (FORWARD_FLOPS_PER_PARAM + BACKWARD_FLOPS_PER_PARAM) * num_params * num_tokens


def transformer_training_flops(num_tokens, layers, hidden, seq_len, vocab, recompute="none"):
    """Every matrix multiplication of training a GPT for ``num_tokens`` tokens, in FLOPs.

    Per token and layer, the forward pass multiplies by 12·h² weights (QKV 3h², output
    projection h², MLP 8h²) and computes two s×s attention products (Q·Kᵀ and the
    scores times V, 2·s·h FLOPs each per token); the output layer multiplies by h·V.
    Backward is twice forward. Narayanan et al. 2021 ("Efficient Large-Scale Language
    Model Training on GPU Clusters Using Megatron-LM", appendix) give the same count per
    batch of B sequences: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)). ``recompute="full"``
    runs every layer's forward once more in the backward pass (their 96·B·s·l·h²·(1 +
    s/(6h) + V/(16·l·h))); ``"selective"`` reruns only the two attention products.
    Biases, layer norms and softmax are not counted.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}")
    weights, attention = 2 * 12 * hidden**2, 4 * seq_len * hidden  # forward, per token
    per_layer = 3 * (weights + attention)
    if recompute == "full":
        per_layer += weights + attention
    elif recompute == "selective":
        per_layer += attention
    output_layer = 3 * 2 * hidden * vocab
    return num_tokens * (layers * per_layer + output_layer)


def training_days(flops, num_gpus, peak_flops, mfu=ASSUMED_MFU):
    """Days of training for ``flops`` on ``num_gpus`` GPUs at model FLOPs utilization ``mfu``.

    MFU (Chowdhery et al. 2022, PaLM, section 4.1) is the share of the GPUs' peak FLOP/s
    that goes into the model's own FLOPs (6·N per token, recomputation not counted).
    """
    return flops / (num_gpus * peak_flops * mfu) / SECONDS_PER_DAY


# --------------------------------------------------------------------------- memory wall

BYTES_PER_PARAM = {
    # ZeRO (Rajbhandari et al. 2020), section 3.1: fp16 weights and gradients, and an fp32
    # copy of the weights, momentum and variance that the optimizer updates: 2 + 2 + 12.
    "mixed": {
        "weights": 2,
        "gradients": 2,
        "master weights": 4,
        "momentum": 4,
        "variance": 4,
    },
    # plain fp32 training with Adam: no separate master copy, the weights are fp32.
    "fp32": {"weights": 4, "gradients": 4, "master weights": 0, "momentum": 4, "variance": 4},
}


def training_memory(num_params, precision: str = "mixed") -> dict:
    """Bytes of model state to train ``num_params`` parameters with Adam, per part.

    ``precision="mixed"`` is mixed-precision training as the ZeRO paper counts it
    (Rajbhandari et al. 2020, section 3.1): fp16 (or bf16) weights and gradients, 2
    bytes each, plus the optimizer's fp32 master weights, momentum and variance, 4 bytes
    each: 16 bytes per parameter; their example is 7.5 billion parameters, 120 GB.
    ``precision="fp32"`` is plain fp32 Adam: 4 + 4 + 4 + 4, also 16. Activations,
    temporary buffers and fragmentation come on top (:func:`activation_memory`).
    """
    if precision not in BYTES_PER_PARAM:
        raise ValueError(f"precision must be one of {', '.join(BYTES_PER_PARAM)}")
    return {part: size * num_params for part, size in BYTES_PER_PARAM[precision].items()}


def activation_memory(
    seq_len, batch, hidden, heads, layers, recompute: str = "none",
    bytes_per_value: int = 2, mask_bytes: int = 1,
    tensor_parallel: int = 1, sequence_parallel: bool = False,
):  # fmt: skip
    """Bytes of activations a GPT keeps for the backward pass, summed over ``layers``.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
    Models", section 4) count, per layer, with s = ``seq_len``, b = ``batch``,
    h = ``hidden``, a = ``heads``, 16-bit activations and 1-byte dropout masks:

    * no recomputation: s·b·h·(34 + 5·a·s/h) bytes. 34 = 16 tensors of s·b·h values at
      2 bytes (layer-norm inputs 2, attention 5, MLP 9) plus 2 dropout masks; 5·a·s/h =
      the softmax output and its dropout output (2 bytes) and mask (1 byte), a·s² each;
    * selective recomputation (the attention core recomputed): 34·s·b·h;
    * full recomputation (only each layer's input kept): 2·s·b·h.

    ``bytes_per_value`` and ``mask_bytes`` generalise the counts (34 = 16·2 + 2·1 and
    5 = 2·2 + 1) to other dtypes. ``tensor_parallel`` = t divides the tensors that
    tensor parallelism splits (s·b·h·(10 + 24/t + 5·a·s/(h·t)) at 2 bytes), and
    ``sequence_parallel`` splits the rest too (s·b·h·(34/t + 5·a·s/(h·t))), as in the
    paper's table 2.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}")
    p, m, t = bytes_per_value, mask_bytes, tensor_parallel
    sbh = seq_len * batch * hidden
    if recompute == "full":
        return layers * sbh * p
    split = 12 * p  # Q, K, V, attention output, the MLP's 4h input and output
    unsplit = 4 * p + 2 * m  # two layer-norm inputs, QKV and MLP inputs, two masks
    per_token = (split + unsplit) / t if sequence_parallel else split / t + unsplit
    per_layer = sbh * per_token
    if recompute == "none":
        per_layer += heads * seq_len**2 * batch * (2 * p + m) / t
    return layers * per_layer


# --------------------------------------------------------------------------- communication


def all_reduce_bytes(nbytes, world_size: int):
    """Bytes each rank sends in a bandwidth-optimal (ring) all-reduce: 2(N-1)/N · S.

    Patarasuk and Yuan 2009; :func:`labsupport.collectives.bytes_sent` gives the exact
    count of the course's ring, chunk by chunk.
    """
    return 2 * (world_size - 1) / world_size * nbytes


def step_times(
    num_params, batch_tokens, devices, peak_flops, bandwidth,
    mfu=ASSUMED_MFU, alpha=ASSUMED_ALPHA, grad_bytes=2, sharded=False,
) -> dict:  # fmt: skip
    """Seconds of compute and of gradient communication in one data-parallel step.

    Compute: 6·N·(batch tokens) FLOPs, split over ``devices`` at ``mfu`` of
    ``peak_flops``. Communication: a ring all-reduce of the 16-bit gradients (2 bytes
    per parameter) at ``bandwidth`` bytes/s per direction and ``alpha`` s per message,
    :func:`labsupport.comm.all_reduce_time`. ``sharded=True`` models ZeRO-3 / FSDP,
    which moves 1.5 times as much (Rajbhandari et al. 2020, section 7). No overlap of
    communication with compute is assumed: both are what a step would take alone.
    """
    compute = training_flops(num_params, batch_tokens) / (devices * peak_flops * mfu)
    nbytes = grad_bytes * num_params
    communication = float(comm.all_reduce_time("ring", devices, nbytes, alpha, 1 / bandwidth))
    if sharded:
        communication *= 1.5
    return {"compute": compute, "communication": communication}


def walls(
    num_params, num_tokens, devices, bandwidth, gpu: str = "H100", mfu=ASSUMED_MFU,
    batch_tokens=BATCH_TOKENS, alpha=ASSUMED_ALPHA, sharded=False,
) -> dict:  # fmt: skip
    """Which wall binds first for data-parallel training of a dense model.

    In order: the **memory wall** binds if the model states (16 bytes per parameter,
    divided by ``devices`` when ``sharded``, as in ZeRO-3) exceed one GPU's memory;
    otherwise the **communication wall** binds if the gradient all-reduce takes longer
    than the step's compute; otherwise the **compute wall**: the run takes as long as
    its FLOPs say. Activations are left out (they depend on the architecture and on
    recomputation; see :func:`activation_memory`).
    """
    spec = GPUS[gpu]
    states = sum(training_memory(num_params).values())
    per_device = states / devices if sharded else states
    step = step_times(num_params, batch_tokens, devices, spec["bf16_flops"], bandwidth, mfu,
                      alpha, sharded=sharded)  # fmt: skip
    steps = num_tokens / batch_tokens
    if per_device > spec["memory"]:
        binds = "memory"
    elif step["communication"] > step["compute"]:
        binds = "communication"
    else:
        binds = "compute"
    return {
        "flops": training_flops(num_params, num_tokens),
        "compute_days": steps * step["compute"] / SECONDS_PER_DAY,
        "communication_days": steps * step["communication"] / SECONDS_PER_DAY,
        "state_bytes_per_device": per_device,
        "device_memory": spec["memory"],
        "step_compute": step["compute"],
        "step_communication": step["communication"],
        "binds": binds,
    }


ADVICE = {
    "memory": "shard the model states (ZeRO, FSDP: ch. 14) or split the model (ch. 11-13)",
    "communication": "fewer, larger steps, overlap (ch. 10), or model parallelism (ch. 11-13)",
    "compute": "more GPUs (or better MFU: ch. 4) shorten the run",
}


def describe_walls(num_params, num_tokens, devices, bandwidth, sharded=False, **kw) -> str:
    """A few lines of text: the three walls for one setting, and which one binds."""
    w = walls(num_params, num_tokens, devices, bandwidth, sharded=sharded, **kw)
    gpu = kw.get("gpu", "H100")
    strategy = "ZeRO-3 / FSDP" if sharded else "data parallel"
    fits = "fits" if w["state_bytes_per_device"] <= w["device_memory"] else "does not fit"
    lines = [
        f"{num_params / 1e9:,.0f}B parameters, {num_tokens / 1e9:,.0f}B tokens, "
        f"{devices:,} x {gpu} at {kw.get('mfu', ASSUMED_MFU):.0%} MFU, "
        f"{bandwidth / GB:g} GB/s per GPU, {strategy}",
        f"  compute:       {w['flops']:.2e} FLOPs = {w['compute_days']:,.1f} days of compute",
        f"  memory:        {w['state_bytes_per_device'] / GB:,.1f} GB of model states per GPU "
        f"({fits} in {w['device_memory'] / GB:.0f} GB)",
        f"  communication: {w['step_communication']:.3g} s of all-reduce per step, "
        f"against {w['step_compute']:.3g} s of compute",
        f"  -> the {w['binds']} wall binds: {ADVICE[w['binds']]}",
    ]
    return "\n".join(lines)


def explorer():
    """An ipywidgets explorer: model size, tokens, devices and bandwidth -> which wall binds.

    Returns an ``ipywidgets.interactive`` whose last child shows :func:`describe_walls`
    for the sliders' values, starting from Llama 3 405B's size and tokens on 16,384 H100s
    at 50 GB/s. The text goes into an HTML widget rather than to stdout, so the stored
    notebook holds it in the widget state, the same on every run.
    """
    import html

    import ipywidgets as widgets

    style = {"description_width": "150px"}
    layout = widgets.Layout(width="520px")
    report = widgets.HTML()

    def show(params_b, tokens_b, devices, bandwidth_gb_s, sharded):
        text = describe_walls(params_b * 1e9, tokens_b * 1e9, devices, bandwidth_gb_s * GB,
                              sharded=sharded)  # fmt: skip
        report.value = f"<pre>{html.escape(text)}</pre>"

    box = widgets.interactive(
        show,
        params_b=widgets.FloatLogSlider(value=405, base=10, min=-1, max=4, step=0.05,
                                        description="parameters (B)", style=style,
                                        layout=layout, readout_format=".3g"),
        tokens_b=widgets.FloatLogSlider(value=15_600, base=10, min=0, max=5, step=0.05,
                                        description="tokens (B)", style=style,
                                        layout=layout, readout_format=".3g"),
        devices=widgets.IntSlider(value=16_384, min=1, max=32_768, step=1,
                                  description="GPUs (H100)", style=style, layout=layout),
        bandwidth_gb_s=widgets.FloatLogSlider(value=50, base=10, min=0, max=3, step=0.05,
                                              description="bandwidth (GB/s)", style=style,
                                              layout=layout, readout_format=".3g"),
        sharded=widgets.Checkbox(value=False, description="shard states (ZeRO-3)",
                                 style=style),
    )  # fmt: skip
    box.children = (*box.children, report)
    return box


# --------------------------------------------------------------------------- a small GPT


@dataclass
class GPTConfig:
    """A GPT-2-shaped model, small enough to train on a laptop's CPU."""

    vocab: int = 256
    seq_len: int = 64
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, written out (no fused kernel hides a tensor)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        future = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).triu(1)
        self.register_buffer("future", future, persistent=False)

    def core(self, q, k, v):
        """softmax(Q·Kᵀ/√d, causal)·V: the part selective recomputation recomputes."""
        s = q.size(-2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        scores = scores.masked_fill(self.future[:s, :s], float("-inf"))
        return self.attn_drop(F.softmax(scores, dim=-1)) @ v

    def forward(self, x, recompute_core: bool = False):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        if recompute_core:
            y = torch.utils.checkpoint.checkpoint(self.core, q, k, v, use_reentrant=True)
        else:
            y = self.core(q, k, v)
        y = y.transpose(1, 2).contiguous().view(b, s, h)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-norm transformer layer: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden)
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.fc_proj = nn.Linear(4 * cfg.hidden, cfg.hidden)
        self.mlp_drop = nn.Dropout(cfg.dropout)

    def forward(self, x, recompute_core: bool = False):
        x = x + self.attn(self.ln_1(x), recompute_core)
        return x + self.mlp_drop(self.fc_proj(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    """nanoGPT's model: token and position embeddings, layers, a tied output layer."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)

    def embed(self, idx):
        positions = torch.arange(idx.size(1), device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(positions))

    def run_block(self, block, x, recompute: str = "none"):
        """One layer, with ``recompute`` = "none", "selective" (the attention core) or
        "full" (the whole layer recomputed in the backward pass)."""
        if recompute == "full":
            return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
        return block(x, recompute_core=recompute == "selective")

    def forward(self, idx, targets=None, recompute: str = "none"):
        x = self.embed(idx)
        for block in self.blocks:
            x = self.run_block(block, x, recompute)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # weights tied with wte
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt_params(cfg: GPTConfig) -> int:
    """Parameters of :class:`GPT`: 12·h² + 13·h per layer, plus embeddings and final LN."""
    h = cfg.hidden
    return cfg.layers * (12 * h * h + 13 * h) + (cfg.vocab + cfg.seq_len) * h + 2 * h


def random_batch(cfg: GPTConfig, batch: int, seed: int):
    """``batch`` sequences of random tokens and their next-token targets."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(cfg.vocab, (batch, cfg.seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def build(cfg: GPTConfig, seed: int = 0, dtype=torch.float32, device="cpu") -> GPT:
    """A :class:`GPT` with weights drawn from ``seed``, in training mode."""
    torch.manual_seed(seed)
    return GPT(cfg).to(device=device, dtype=dtype).train()


# --------------------------------------------------------------------------- measuring


def measure_model_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes of weights, gradients and optimizer state, read from the tensors themselves.

    Call after at least one ``optimizer.step()`` (Adam creates its state lazily). Adam's
    per-parameter ``step`` counters are reported apart: one scalar per parameter tensor.
    """
    params = list(model.parameters())
    state = [optimizer.state[p] for p in params]
    return {
        "weights": sum(p.nbytes for p in params),
        "gradients": sum(p.grad.nbytes for p in params if p.grad is not None),
        "momentum": sum(s["exp_avg"].nbytes for s in state),
        "variance": sum(s["exp_avg_sq"].nbytes for s in state),
        "step counters": sum(s["step"].nbytes for s in state),
    }


def measure_activations(model: GPT, idx, recompute: str = "none") -> list[int]:
    """Bytes autograd saves for the backward pass in each layer, over one forward pass.

    Every tensor saved for backward passes through a ``saved_tensors_hooks`` pack hook;
    this one adds up the storages it sees (a view and its base count once), leaving out
    the model's parameters and buffers. Full recomputation uses the reentrant
    checkpoint, which saves the layer's input with ``save_for_backward``, where the hook
    sees it.
    """
    state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    per_layer = []
    with torch.no_grad():
        x = model.embed(idx)
    x.requires_grad_(True)
    for block in model.blocks:
        saved = {}

        def pack(tensor, saved=saved):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in state:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            x = model.run_block(block, x, recompute)
        per_layer.append(sum(saved.values()))
    return per_layer


def count_step_flops(model: GPT, idx, targets, recompute: str = "none") -> int:
    """FLOPs of one forward and backward pass, counted by PyTorch's ``FlopCounterMode``.

    It counts matrix multiplications (2 FLOPs per multiply-add), the operations the
    formulas count; elementwise operations, softmax and layer norms are left out.
    """
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(idx, targets, recompute=recompute).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def data_parallel_step(cfg_kwargs: dict, batch_per_rank: int, seed: int = 0) -> dict:
    """One data-parallel step of the small GPT (run on every rank).

    Every rank builds the same model (same seed), computes the gradient of its own batch
    (seed ``seed + 1 + rank``), and all-reduces the gradients, flattened into one fp32
    buffer, with the course's ring (:func:`labsupport.collectives.all_reduce`) while
    :func:`labsupport.collectives.count_traffic` counts the bytes this rank sends. The
    same sum from ``torch.distributed.all_reduce`` is the reference.
    """
    from labsupport import collectives
    from labsupport.runtime import device

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**cfg_kwargs)
    model = build(cfg, seed, device=device())
    idx, targets = random_batch(cfg, batch_per_rank, seed + 1 + rank)
    model(idx.to(device()), targets.to(device())).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    reference = grads.clone()
    dist.all_reduce(reference)
    with collectives.count_traffic() as traffic:
        collectives.all_reduce(grads)
    return {
        "rank": rank,
        "numel": grads.numel(),
        "bytes_sent": traffic.bytes_sent,
        "messages": len(traffic.messages),
        "max_diff_vs_torch": (grads - reference).abs().max().item(),
        "mean_gradient": (grads / world).cpu() if rank == 0 else None,
    }


# --------------------------------------------------------------------------- figures

PART_COLORS = {
    "weights": plotting.rank_color(0),
    "gradients": plotting.rank_color(1),
    "master weights": plotting.rank_color(2),
    "momentum": plotting.rank_color(3),
    "variance": plotting.rank_color(4),
}


def memory_breakdown_figure(models=None, gpu: str = "H100"):
    """Chapter 3: mixed-precision Adam model states, part by part, for a few model sizes.

    ``models`` maps a label to a parameter count (default 7B, 70B, 175B). Each panel has
    its own scale, with one GPU's memory drawn as a dashed line.
    """
    import matplotlib.pyplot as plt

    models = models or {"7B": 7e9, "70B": 70e9, "175B": 175e9}
    plt.rcParams.update(plotting.STYLE)
    fig, axes = plt.subplots(1, len(models), figsize=(3.1 * len(models), 3.6))
    limit = GPUS[gpu]["memory"] / GB
    for ax, (label, n) in zip(np.atleast_1d(axes), models.items(), strict=True):
        bottom = 0.0
        for part, nbytes in training_memory(n).items():
            ax.bar(0, nbytes / GB, bottom=bottom, width=0.6, color=PART_COLORS[part],
                   edgecolor="black", linewidth=0.5, label=part)  # fmt: skip
            bottom += nbytes / GB
        ax.axhline(limit, color="black", ls="--", lw=1)
        ax.text(0.33, limit, f" one {gpu}: {limit:.0f} GB", va="bottom", fontsize=8)
        ax.text(0, bottom, f"{bottom:,.0f} GB", ha="center", va="bottom", fontsize=9)
        ax.set_xlim(-0.6, 1.2)
        ax.set_ylim(0, max(bottom, limit) * 1.15)
        ax.set_xticks([0], [f"{label} parameters"])
        ax.set_ylabel("GB")
    handles, labels = np.atleast_1d(axes)[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.suptitle("Model states of mixed-precision Adam: 16 bytes per parameter", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def time_to_train_figure(model: str = "GPT-3 175B", gpu: str = "A100", bandwidth=50 * GB):
    """Chapter 3: days of compute and of gradient all-reduce against the number of GPUs.

    Plain data parallelism, the model's published batch, ``gpu`` at 40% MFU, a ring
    all-reduce of 16-bit gradients at ``bandwidth`` per GPU with alpha = 5 µs, and no
    overlap. Memory is ignored here, as if every GPU could hold the model states.
    """
    spec, peak = MODELS[model], GPUS[gpu]["bf16_flops"]
    devices = np.unique(np.geomspace(8, 16384, 60).astype(int))
    steps = spec["tokens"] / spec["batch_tokens"]
    compute, communication = [], []
    for g in devices:
        t = step_times(spec["params"], spec["batch_tokens"], int(g), peak, bandwidth)
        compute.append(steps * t["compute"] / SECONDS_PER_DAY)
        communication.append(steps * t["communication"] / SECONDS_PER_DAY)
    compute, communication = np.array(compute), np.array(communication)
    cross = crossover_devices(spec["batch_tokens"], peak * ASSUMED_MFU, bandwidth)
    fig, ax = plotting.figure(7.5, 3.8)
    ax.plot(devices, compute, color=plotting.rank_color(0), lw=2, label="compute")
    ax.plot(devices, communication, color=plotting.rank_color(1), lw=2,
            label="gradient all-reduce (ring)")  # fmt: skip
    ax.plot(devices, compute + communication, color="black", lw=1.2, ls="--",
            label="total, without overlap")  # fmt: skip
    ax.axvline(cross, color="#999999", lw=1, ls=":")
    ax.text(cross * 1.08, compute.max() / 3, f"communication\ndominates beyond\n"
            f"~{cross:,.0f} GPUs", fontsize=8, color="#555555")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"number of {gpu} GPUs (data parallel)")
    ax.set_ylabel("days")
    ax.set_title(
        f"{model} on {spec['tokens'] / 1e9:.0f}B tokens: {gpu} at 40% MFU, "
        f"{bandwidth / GB:g} GB/s per GPU",
        fontsize=10,
    )
    ax.legend(fontsize=8, frameon=False, loc="lower left")
    return fig


def crossover_devices(batch_tokens, effective_flops, bandwidth):
    """GPUs beyond which a ring all-reduce of 16-bit gradients outlasts a step's compute.

    Compute 6·N·B/(G·F) equals communication 2(G-1)/G · 2N/bandwidth (alpha neglected)
    at G = 1 + 1.5·B·bandwidth/F, whatever N: both grow in proportion to the model.
    """
    return 1 + 1.5 * batch_tokens * bandwidth / effective_flops


# --------------------------------------------------------------------------- exercises


def check_training_days(fn) -> None:
    """Exercise 1: ``fn(num_params, num_tokens, num_gpus, peak_flops, mfu)`` in days."""
    cases = [
        (175e9, 300e9, 1024, 312e12, 0.4),
        (405e9, 15.6e12, 16384, 989e12, 0.4),
        (7e9, 2e12, 64, 989e12, 0.5),
        (1e9, 1e9, 1, 1e12, 1.0),
    ]
    for case in cases:
        got = float(fn(*case))
        want = training_days(training_flops(case[0], case[1]), *case[2:])
        hint = ""
        if math.isclose(got, want * SECONDS_PER_DAY, rel_tol=1e-6):
            hint = " (that is in seconds: a day has 86,400)"
        elif math.isclose(got, want / 3, rel_tol=1e-6):
            hint = " (2 FLOPs per parameter and token is the forward pass only)"
        assert math.isclose(got, want, rel_tol=1e-6), (
            f"num_params={case[0]:g}, num_tokens={case[1]:g}, num_gpus={case[2]}: got "
            f"{got:.6g} days, expected {want:.6g}{hint}"
        )
    print("Correct: 6·N·D FLOPs / (GPUs × peak × MFU), in days.")


def check_min_gpus(fn) -> None:
    """Exercise 2: ``fn(num_params, gpu_memory)``, the fewest GPUs whose memory holds the
    mixed-precision Adam states when they are sharded evenly (ZeRO-3)."""
    cases = [(175e9, 80e9, 35), (7.5e9, 80e9, 2), (405e9, 80e9, 81), (1e9, 16e9, 1),
             (70e9, 40e9, 28), (5e9, 80e9, 1)]  # fmt: skip
    for n, memory, want in cases:
        got = fn(n, memory)
        assert got == want, f"num_params={n:g}, gpu_memory={memory:g}: got {got}, expected {want}"
    print("Correct: ceil(16·N / memory) GPUs, before any activation.")


def check_crossover(fn) -> None:
    """Exercise 3: ``fn(batch_tokens, effective_flops, bandwidth)``, the number of GPUs at
    which one step's ring all-reduce (alpha = 0) takes as long as its compute."""
    cases = [(3.2e6, 312e12 * 0.4, 50e9), (4 * 2**20, 989e12 * 0.4, 50e9),
             (1e6, 1e15, 450e9), (2**16, 1e14, 12.5e9)]  # fmt: skip
    for tokens, flops, bandwidth in cases:
        g = float(fn(tokens, flops, bandwidth))
        for n in (1e9, 175e9):
            t = step_times(n, tokens, g, flops, bandwidth, mfu=1.0, alpha=0.0)
            assert math.isclose(t["compute"], t["communication"], rel_tol=1e-6), (
                f"batch_tokens={tokens:g}, F={flops:g}, bandwidth={bandwidth:g}: at {g:.6g} "
                f"GPUs, compute takes {t['compute']:.4g} s and the all-reduce "
                f"{t['communication']:.4g} s per step (model of {n:g} parameters)"
            )
    print("Correct: G = 1 + 1.5·B·bandwidth / F, whatever the model's size.")
