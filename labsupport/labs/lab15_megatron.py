"""Lab 15, frameworks: a real Megatron-DeepSpeed launch, read rather than run.

Megatron-LM trains on NVIDIA GPUs only (``megatron/training/initialize.py``: "Megatron
requires CUDA."), so the lab reads the launch of BLOOM-176B, the Slurm script
BigScience trained it with (``train/tr11-176B-ml/tr11-176B-ml.slurm`` of
github.com/bigscience-workshop/bigscience, at commit ``ed196cd``, 2022-06-19, the last
version for 48 nodes: commit ``95f8a8b``, 2022-07-05, switched it to 24), and says what
each argument maps to in the course.
"""

from __future__ import annotations

#: Where the script is, at the commit the lab quotes.
BLOOM_SCRIPT = (
    "https://github.com/bigscience-workshop/bigscience/blob/"
    "ed196cd266b120f1ece3efea9a1319da161d8f4b/train/tr11-176B-ml/tr11-176B-ml.slurm"
)

#: (argument as the script passes it, its value there, what it does, the course's counterpart)
BLOOM_LAUNCH = [
    # Slurm: the job
    ("#SBATCH --nodes", "48", "nodes of the Slurm job", "ch. 6: nodes, node rank"),
    ("#SBATCH --gres=gpu:", "8", "GPUs per node", "ch. 6: LOCAL_RANK picks the GPU"),
    (
        "#SBATCH --ntasks-per-node",
        "1",
        "one task per node: srun starts one torchrun there",
        "ch. 6: torchrun's agent",
    ),
    # torchrun: the processes
    ("--nproc_per_node", "8", "torchrun: workers per node", "ch. 6: nproc_per_node"),
    (
        "--rdzv_backend / --rdzv_endpoint",
        "c10d / $MASTER_ADDR:6000",
        "torchrun: where the nodes meet (the first node)",
        "ch. 6: rendezvous, MASTER_ADDR",
    ),
    (
        "--node_rank",
        "$SLURM_PROCID",
        "passed, but c10d rendezvous numbers the nodes as they join",
        "ch. 6: node rank",
    ),
    (
        "--max_restarts",
        "0",
        "torchrun restarts nothing: Slurm starts the next job",
        "ch. 16: restarts",
    ),
    # Megatron: the model and its split
    (
        "--tensor-model-parallel-size",
        "4",
        "Megatron: each layer split over 4 GPUs of a node",
        "parallel.tensor_parallel (ch. 12)",
    ),
    (
        "--pipeline-model-parallel-size",
        "12",
        "DeepSpeed's pipeline engine: 12 stages",
        "parallel.pipeline_parallel (ch. 11)",
    ),
    (
        "--pp-partition-method",
        "'type:transformer|embedding'",
        "balance the stages by counting transformer layers and embeddings",
        "pipeline_parallel.partition (ch. 11)",
    ),
    (
        "--num-layers / --hidden-size / --num-attention-heads",
        "70 / 14336 / 112",
        "the model's shape",
        "models.gpt: n_layer, n_embd, n_head",
    ),
    ("--seq-length", "2048", "tokens per sequence", "models.gpt: block_size"),
    (
        "--pad-vocab-size-to",
        "250880",
        "250,680 tokens padded: 62,720 rows per TP rank, 490 × 128; the same size at any TP",
        "VocabParallelEmbedding (ch. 12)",
    ),
    # the batch
    (
        "--micro-batch-size",
        "2",
        "sequences per micro-batch, per replica",
        "schedules: micro-batches (ch. 11)",
    ),
    (
        "--global-batch-size",
        "2048",
        "sequences per optimizer step, all replicas",
        "gradient accumulation (ch. 4)",
    ),
    (
        "--rampup-batch-size",
        "192 16 9_765_625",
        "start at 192 sequences, grow by 16 up to 2048 over the first 9.8 M samples",
        "(not in the course)",
    ),
    (
        "--train-samples",
        "220_000_000",
        "the script's budget, 450 B tokens (220 M × 2,048); the run stopped at about 366 B",
        "ch. 3: the compute wall, 6 N D",
    ),
    # precision, memory, optimizer
    ("--bf16", "", "bfloat16 compute, fp32 master weights", "mixed precision (ch. 4)"),
    (
        "--checkpoint-activations --deepspeed-activation-checkpointing",
        "",
        "recompute every layer's activations in backward, with DeepSpeed's code",
        "recompute='full' (ch. 4)",
    ),
    (
        "--optimizer adam --adam-beta1/2 --weight-decay",
        "0.9, 0.95 / 0.1",
        "apex's FusedAdam: AdamW (decay 0.1, none on biases and LayerNorms)",
        "torch.optim.Adam in parallel.zero",
    ),
    (
        "--lr / --min-lr / --lr-decay-style",
        "6e-5 / 6e-6 / cosine",
        "warm-up 183,105 samples; cosine to min-lr by 200 M samples (410 B tokens), then flat",
        "(not in the course: a constant lr)",
    ),
    (
        '--clip-grad, "gradient_clipping"',
        "1.0",
        "gradients clipped to a global norm of 1",
        "(not in the course)",
    ),
    # checkpoints
    ("--save-interval", "100", "a checkpoint every 100 steps", "ch. 16: checkpoint interval"),
    (
        "--save / --load",
        "$CHECKPOINT_PATH",
        "write to and resume from the same folder",
        "parallel.checkpoint (ch. 16)",
    ),
    (
        "--exit-duration-in-mins",
        "5990",
        "save and stop before Slurm's 100 h limit (--time 100:00:00)",
        "ch. 16: checkpoint/restart",
    ),
    # DeepSpeed
    ("--distributed-backend", "nccl", "the process group's backend", "ch. 6: backends"),
    (
        "--deepspeed --deepspeed_config",
        "ds_config.$SLURM_JOB_ID.json",
        "hand the optimizer and the pipeline to DeepSpeed",
        "ch. 15: the JSON config",
    ),
    (
        '--zero-stage, "zero_optimization": {"stage"}',
        "0",
        "bf16 runs DeepSpeed's BF16_Optimizer, which shards fp32 states itself (ZeRO-1)",
        "parallel.zero, stage 1 (ch. 14)",
    ),
]

#: Who provided what in one BLOOM-176B training process, top (the job) to bottom, as the
#: script above and BigScience's Megatron-DeepSpeed (``megatron/training.py``,
#: ``initialize.py``, ``checkpointing.py``, ``model/gpt_model.py``) wire it:
#: (layer, provider, what runs there).
BLOOM_STACK = [
    ("job", "Slurm", "sbatch: 48 nodes of 8 A100; srun starts one task per node"),
    ("processes", "PyTorch", "torchrun: 8 workers per node, c10d rendezvous"),
    ("training loop, data", "Megatron-LM", "pretrain_gpt.py: indexed datasets, ramp-up, lr"),
    ("engine", "DeepSpeed", "deepspeed.initialize -> PipelineEngine: steps, bf16, clipping"),
    ("pipeline parallel, 12", "DeepSpeed", "GPTModelPipe(PipelineModule): stages, schedule"),
    ("tensor parallel, 4", "Megatron-LM", "mpu: ColumnParallelLinear, RowParallelLinear"),
    ("data parallel, 8", "DeepSpeed", "BF16_Optimizer: fp32 states sharded (ZeRO-1)"),
    ("optimizer", "apex", "FusedAdam (AdamW), stepped by BF16_Optimizer"),
    ("recomputation", "DeepSpeed", "deepspeed.checkpointing, replacing Megatron's own"),
    ("kernels", "Megatron-LM", "fused softmax and LayerNorm: CUDA, compiled at start"),
    ("checkpoints", "DeepSpeed", "engine.save_checkpoint, every 100 steps"),
    ("collectives", "PyTorch", "torch.distributed on NCCL (deepspeed.init_distributed)"),
]

#: One colour per provider (the course palette, in order of first appearance).
PROVIDERS = ("Slurm", "PyTorch", "Megatron-LM", "DeepSpeed", "apex")


def bloom_stack_figure(stack=BLOOM_STACK):
    """Chapter 15: the layers of one BLOOM-176B training process, coloured by the
    project that provided each (drawn by :func:`labsupport.viz.frameworks.stack_figure`)."""
    from labsupport.viz.frameworks import stack_figure

    return stack_figure(stack, PROVIDERS, "BLOOM-176B's training process: who provides what")
