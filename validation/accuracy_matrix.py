"""The accuracy matrix: small real jobs on CPU whose measured peak memplan must predict.

Each case is one Job plus where it runs: ``local`` (real gloo processes) or
``emulate`` (one rank of a larger job on the fake process group), on the native
reference blocks or on a Hugging Face ``transformers`` model built from a config.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec

LLAMA = ModelSpec(
    name="llama-tiny",
    arch="llama",
    num_layers=4,
    hidden=256,
    num_heads=8,
    num_kv_heads=4,
    ffn_hidden=688,
    vocab_size=4096,
)
GPT2 = ModelSpec(
    name="gpt2-tiny",
    arch="gpt2",
    num_layers=4,
    hidden=256,
    num_heads=8,
    ffn_hidden=1024,
    vocab_size=4096,
    max_positions=256,
    tied_embeddings=True,
    linear_bias=True,
    dropout=0.1,
)

# 128×128 images in 8×8 patches: 256 patches + the class token, about the decoders' 256 tokens
VIT = ModelSpec(
    name="vit-tiny",
    arch="vit",
    num_layers=4,
    hidden=256,
    num_heads=8,
    ffn_hidden=1024,
    vocab_size=10,
    linear_bias=True,
    max_positions=257,
    patch_size=8,
)
VIT_TOKENS = VIT.max_positions


@dataclass(frozen=True)
class Case:
    id: str
    job: Job
    mode: str = "emulate"
    """local: real gloo processes (world = cluster.gpus); emulate: fake process group."""
    workload: str = "native"
    covers: str = ""


def _job(
    model=LLAMA,
    *,
    strategy,
    precision,
    gpus=2,
    ac="none",
    attention="sdpa",
    seq_len=256,
    micro_batch=0,
    grad_accum=1,
    optimizer="adamw",
    impl=None,
    gpus_per_node=0,
) -> Job:
    # bf16 matmuls run ~50x slower than fp32 on CPUs without AVX512-BF16: half the batch keeps
    # a bf16 case's time near an fp32 one's
    micro_batch = micro_batch or (4 if precision == "fp32" else 2)
    return Job(
        model=model,
        train=TrainSpec(
            seq_len=seq_len,
            micro_batch=micro_batch,
            grad_accum=grad_accum,
            precision=precision,
            optimizer=optimizer,
            optimizer_impl=impl,
            activation_checkpointing=ac,
            attention=attention,
            device="cpu",
        ),
        cluster=ClusterSpec(gpus=gpus, gpus_per_node=gpus_per_node),
        plan=Plan(strategy=strategy),
    )


CASES = (
    Case("ddp-fp32", _job(strategy="ddp", precision="fp32"), mode="local", covers="DDP, fp32, activations peak"),
    Case(
        "ddp-amp-eager",
        _job(strategy="ddp", precision="amp-bf16", attention="eager"),
        mode="local",
        covers="autocast, eager attention",
    ),
    Case("full-fp32", _job(strategy="fsdp-full-shard", precision="fp32"), mode="local", covers="FULL_SHARD"),
    Case(
        "full-mixed",
        _job(strategy="fsdp-full-shard", precision="mixed-bf16"),
        mode="local",
        covers="MixedPrecisionPolicy",
    ),
    Case(
        "sgo-mixed-ac",
        _job(strategy="fsdp-shard-grad-op", precision="mixed-bf16", ac="full"),
        mode="local",
        covers="SHARD_GRAD_OP, full AC",
    ),
    Case(
        "full-mixed-ac-w8",
        _job(strategy="fsdp-full-shard", precision="mixed-bf16", ac="full", gpus=8),
        covers="emulated world size 8",
    ),
    Case(
        "full-amp-eager-w4",
        _job(strategy="fsdp-full-shard", precision="amp-bf16", attention="eager", gpus=4),
        covers="emulated world size 4, eager",
    ),
    Case("sgo-fp32-w4", _job(strategy="fsdp-shard-grad-op", precision="fp32", gpus=4), covers="SHARD_GRAD_OP fp32"),
    Case(
        "full-selective-w4",
        _job(strategy="fsdp-full-shard", precision="mixed-bf16", ac="selective", gpus=4, attention="eager"),
        covers="selective AC",
    ),
    Case(
        "hybrid-mixed-w8",
        _job(strategy="fsdp-hybrid-shard", precision="mixed-bf16", gpus=8, gpus_per_node=4),
        covers="HYBRID_SHARD on a 2x4 mesh",
    ),
    Case("noshard-fp32-w4", _job(strategy="fsdp-no-shard", precision="fp32", gpus=4), covers="NO_SHARD"),
    Case(
        "full-fp32-w1",
        _job(strategy="fsdp-full-shard", precision="fp32", gpus=1),
        covers="FSDP2 on one rank: no all-gather, no prefetch buffer",
    ),
    Case(
        "ddp-fp32-optimizer-peak",
        _job(strategy="ddp", precision="fp32", seq_len=16, micro_batch=1, impl="foreach"),
        covers="optimizer step is the peak (foreach AdamW)",
    ),
    Case(
        "full-bf16-ga2-w4",
        _job(strategy="fsdp-full-shard", precision="bf16", grad_accum=2, gpus=4),
        covers="pure bf16, gradient accumulation",
    ),
    Case(
        "gpt2-ddp-fp32-eager",
        _job(GPT2, strategy="ddp", precision="fp32", attention="eager"),
        mode="local",
        covers="gpt2 style: LayerNorm, GELU, dropout, tied head",
    ),
    Case(
        "gpt2-full-mixed-w4",
        _job(GPT2, strategy="fsdp-full-shard", precision="mixed-bf16", attention="eager", gpus=4),
        covers="gpt2 style under FSDP",
    ),
    Case(
        "gpt2-sgo-amp-sdpa-w8",
        _job(GPT2, strategy="fsdp-shard-grad-op", precision="amp-bf16", gpus=8),
        covers="CPU sdpa with dropout (math path)",
    ),
    Case(
        "single-bf16-ac",
        _job(strategy="single", precision="bf16", gpus=1, ac="full"),
        covers="one GPU without a wrapper, pure bf16 (torchtune's single-device recipes)",
    ),
    Case(
        "single-amp",
        _job(strategy="single", precision="amp-bf16", gpus=1),
        mode="local",
        covers="one process without a wrapper, autocast",
    ),
    Case(
        "hf-llama-ddp-fp32",
        _job(strategy="ddp", precision="fp32"),
        workload="hf",
        covers="transformers LlamaForCausalLM",
    ),
    Case(
        "hf-llama-full-mixed-ac-w4",
        _job(strategy="fsdp-full-shard", precision="mixed-bf16", ac="full", gpus=4),
        workload="hf",
        covers="transformers model, FSDP, gradient checkpointing",
    ),
    Case(
        "hf-gpt2-sgo-fp32-w2",
        _job(GPT2, strategy="fsdp-shard-grad-op", precision="fp32", attention="eager"),
        workload="hf",
        covers="transformers GPT2LMHeadModel",
    ),
    Case(
        "hf-vit-ddp-fp32",
        _job(VIT, strategy="ddp", precision="fp32", seq_len=VIT_TOKENS),
        mode="local",
        workload="hf",
        covers="transformers ViTForImageClassification: patches + class token, classifier head",
    ),
    Case(
        "hf-vit-full-amp-eager-w4",
        _job(VIT, strategy="fsdp-full-shard", precision="amp-bf16", attention="eager", gpus=4, seq_len=VIT_TOKENS),
        workload="hf",
        covers="ViT, autocast, eager, FSDP",
    ),
    Case(
        "hf-vit-full-mixed-ac-w4",
        _job(VIT, strategy="fsdp-full-shard", precision="mixed-bf16", ac="full", gpus=4, seq_len=VIT_TOKENS),
        workload="hf",
        covers="ViT, FSDP mixed, full AC",
    ),
    Case(
        "hf-vit-single-bf16",
        _job(VIT, strategy="single", precision="bf16", gpus=1, seq_len=VIT_TOKENS),
        workload="hf",
        covers="ViT, pure bf16, one rank",
    ),
)


def measure_case(case: Case, **run_kwargs):
    """Run the case for real; returns rank 0's Measurement."""
    from calibrate import launch

    # one warm-up step suffices: the second step already holds every optimizer state, and
    # measured peaks equal those after two warm-up steps in every case
    kwargs = dict(workload=case.workload, steps=2, warmup=1) | run_kwargs
    if case.mode == "local":
        return launch.local(case.job, nprocs=case.job.cluster.gpus, **kwargs)[0]
    return launch.emulate(case.job, world_size=case.job.cluster.gpus, **kwargs)


def runs(cases=CASES):
    """The cases as calibration runs (same steps as ``measure_case``)."""
    from calibrate.records import Run

    return [Run(job=c.job, mode=c.mode, workload=c.workload, steps=2, warmup=1) for c in cases]


def main(out: str = "validation/records/accuracy_matrix_cpu.jsonl") -> None:
    """Record every case with the calibration sweep (``--resume`` semantics), then print
    ``memplan calibrate report`` of the records: the README's accuracy table."""
    from calibrate import records
    from calibrate.report import render_table, rows
    from calibrate.runs import sweep

    print(sweep(runs(), out=out, timeout_s=600, resume=True).line(out))
    print(render_table(rows(records.read([out]))))


if __name__ == "__main__":
    import sys

    main(*sys.argv[1:])
