"""The held-out accuracy matrix: Hugging Face models trained by real frameworks' loops,
in shapes the tuned matrix (validation.accuracy_matrix: hidden 256, the tiny gpt2) never used.

Each case is a memplan Job as a user would type it today (its ``spec``) plus the loop that
really ran (calibrate.loops) and its conventions (the record's ``loop``), on real gloo
ranks (``local``) or one rank of a larger job on the fake process group (``emulate``).

    python -m validation.heldout            # measure every case not yet recorded
    python -m validation.heldout --report   # measured, estimated today, error %, peak phase

Each case runs in a child process (``--case ID --result FILE``), one at a time; a crash or
a timeout is recorded with status failed / timeout and the sweep goes on.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from calibrate import records
from calibrate.records import Run
from memplan.loop import fsdp_units
from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec

OUT = "validation/records/heldout_matrix_cpu.jsonl"
TIMEOUT_S = 240
STEPS, WARMUP = 2, 1
TODAY_AC = {"none": "none", "full": "full", "op": "selective"}
"""The --ac a user types today for each loop's policy: torchtitan's per-op SAC → selective."""

LLAMA_A = ModelSpec(
    name="llama-h512",
    arch="llama",
    num_layers=2,
    hidden=512,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden=1408,
    vocab_size=32000,
)
LLAMA_B = ModelSpec(
    name="llama-h384",
    arch="llama",
    num_layers=2,
    hidden=384,
    num_heads=6,
    num_kv_heads=2,
    ffn_hidden=1024,
    vocab_size=8192,
)
LLAMA_V128K = ModelSpec(
    name="llama-h384-v128k",
    arch="llama",
    num_layers=1,
    hidden=384,
    num_heads=3,
    num_kv_heads=1,
    ffn_hidden=1024,
    vocab_size=128256,
)
QWEN_A = ModelSpec(
    name="qwen2-h896",
    arch="llama",
    num_layers=2,
    hidden=896,
    num_heads=14,
    num_kv_heads=2,
    ffn_hidden=2432,
    vocab_size=16384,
    tied_embeddings=True,
    qkv_bias=True,
)
QWEN_B = ModelSpec(
    name="qwen2-h448",
    arch="llama",
    num_layers=2,
    hidden=448,
    num_heads=7,
    num_kv_heads=1,
    ffn_hidden=1216,
    vocab_size=8192,
    tied_embeddings=True,
    qkv_bias=True,
)
MISTRAL_A = ModelSpec(
    name="mistral-h640",
    arch="llama",
    num_layers=2,
    hidden=640,
    num_heads=5,
    num_kv_heads=1,
    ffn_hidden=1792,
    vocab_size=32768,
)
MISTRAL_B = ModelSpec(
    name="mistral-h512",
    arch="llama",
    num_layers=2,
    hidden=512,
    num_heads=8,
    num_kv_heads=2,
    ffn_hidden=1536,
    vocab_size=8192,
)
GPT2_A = ModelSpec(
    name="gpt2-h384",
    arch="gpt2",
    num_layers=2,
    hidden=384,
    num_heads=6,
    ffn_hidden=1536,
    vocab_size=50257,
    max_positions=1024,
    tied_embeddings=True,
    linear_bias=True,
    dropout=0.1,
)
GPT2_LONG = ModelSpec(
    name="gpt2-h384-s2048",
    arch="gpt2",
    num_layers=1,
    hidden=384,
    num_heads=3,
    ffn_hidden=1536,
    vocab_size=8192,
    max_positions=2048,
    tied_embeddings=True,
    linear_bias=True,
)
NEOX_A = ModelSpec(
    name="neox-h768",
    arch="neox",
    num_layers=2,
    hidden=768,
    num_heads=6,
    ffn_hidden=3072,
    vocab_size=12288,
    linear_bias=True,
)
NEOX_B = ModelSpec(
    name="neox-h512",
    arch="neox",
    num_layers=2,
    hidden=512,
    num_heads=8,
    ffn_hidden=2048,
    vocab_size=8192,
    linear_bias=True,
)
# the loop flags' cases (compile, float8, optimizer in backward, ac-every): shapes not used above
QWEN_C = ModelSpec(
    name="qwen2-h576-l4",
    arch="llama",
    num_layers=4,
    hidden=576,
    num_heads=9,
    num_kv_heads=3,
    ffn_hidden=1536,
    vocab_size=12288,
    tied_embeddings=True,
    qkv_bias=True,
)
LLAMA_C = ModelSpec(
    name="llama-h768",
    arch="llama",
    num_layers=2,
    hidden=768,
    num_heads=12,
    num_kv_heads=4,
    ffn_hidden=2048,
    vocab_size=16000,
)
LLAMA_D = ModelSpec(
    name="llama-h640",
    arch="llama",
    num_layers=2,
    hidden=640,
    num_heads=10,
    num_kv_heads=5,
    ffn_hidden=1728,
    vocab_size=24576,
)
MISTRAL_C = ModelSpec(
    name="mistral-h1024",
    arch="llama",
    num_layers=2,
    hidden=1024,
    num_heads=16,
    num_kv_heads=8,
    ffn_hidden=2816,
    vocab_size=8192,
)
# torchtune's own Llama 3.2 (calibrate.loops.TorchtuneLM): tied embeddings, GQA 4:1
TUNE_A = ModelSpec(
    name="llama3_2-h448",
    arch="llama",
    num_layers=2,
    hidden=448,
    num_heads=8,
    num_kv_heads=2,
    ffn_hidden=1216,
    vocab_size=32000,
    tied_embeddings=True,
)
# full AC's first block outside FSDP full shard (one process, DDP): shapes not used above
LLAMA_E = ModelSpec(
    name="llama-h320",
    arch="llama",
    num_layers=2,
    hidden=320,
    num_heads=5,
    num_kv_heads=1,
    ffn_hidden=864,
    vocab_size=6144,
)
NEOX_C = ModelSpec(
    name="neox-h320",
    arch="neox",
    num_layers=2,
    hidden=320,
    num_heads=5,
    ffn_hidden=1280,
    vocab_size=6144,
    linear_bias=True,
)
GPT2_B = ModelSpec(
    name="gpt2-h256",
    arch="gpt2",
    num_layers=2,
    hidden=256,
    num_heads=4,
    ffn_hidden=1024,
    vocab_size=6144,
    max_positions=512,
    tied_embeddings=True,
    linear_bias=True,
)
# their twins with a vocabulary small enough that the first block's backward, not the logits, peaks
LLAMA_F = replace(LLAMA_E, name="llama-h320-v2k", vocab_size=2048)
NEOX_D = replace(NEOX_C, name="neox-h320-v2k", vocab_size=2048)
GPT2_C = replace(GPT2_B, name="gpt2-h256-v2k", vocab_size=2048)
# torchtune's activation offloading (calibrate.offload's replica of its memory decisions): shapes not used above
LLAMA_G = ModelSpec(
    name="llama-h384-l2",
    arch="llama",
    num_layers=2,
    hidden=384,
    num_heads=6,
    num_kv_heads=2,
    ffn_hidden=1024,
    vocab_size=4096,
)
LLAMA_G4 = replace(LLAMA_G, name="llama-h384-l4", num_layers=4)
HF_TYPE = {
    "llama-h384-l2": "llama",
    "llama-h384-l4": "llama",
    "llama-h320-v2k": "llama",
    "neox-h320-v2k": "gpt_neox",
    "gpt2-h256-v2k": "gpt2",
    "llama-h320": "llama",
    "neox-h320": "gpt_neox",
    "gpt2-h256": "gpt2",
    "llama3_2-h448": "torchtune llama3_2",
    "qwen2-h576-l4": "qwen2",
    "llama-h768": "llama",
    "llama-h640": "llama",
    "mistral-h1024": "mistral",
    "llama-h512": "llama",
    "llama-h384": "llama",
    "llama-h384-v128k": "llama",
    "qwen2-h896": "qwen2",
    "qwen2-h448": "qwen2",
    "mistral-h640": "mistral",
    "mistral-h512": "mistral",
    "gpt2-h384": "gpt2",
    "gpt2-h384-s2048": "gpt2",
    "neox-h768": "gpt_neox",
    "neox-h512": "gpt_neox",
}
STRATEGY = {"single": "single", "ddp": "ddp", "fsdp": "fsdp-full-shard", "sgo": "fsdp-shard-grad-op"}


@dataclass(frozen=True)
class Case:
    id: str
    job: Job
    loop: str
    ac: str = "none"
    """The loop's own policy: none | full | op (torchtitan's per-op SAC)."""
    mode: str = "emulate"

    @property
    def hf_type(self) -> str:
        return HF_TYPE[self.job.model.name]

    def measure(self, emulated: bool):
        """Run the case's loop in this process (its process group initialised)."""
        from calibrate import loops

        return loops.run(
            self.job,
            loops.LOOPS[self.loop],
            hf_type=self.hf_type,
            ac=self.ac,
            emulated=emulated,
            steps=STEPS,
            warmup=WARMUP,
            adapt=self.adapt,
            **self.run_options(),
        )

    def adapt(self, model) -> None:
        """Change the built model before it is wrapped: a held-out case trains it as built."""

    def run_options(self) -> dict:
        """What calibrate.loops.run takes beyond the case's own fields (``TypedCase``'s too)."""
        return {}

    def record_fields(self) -> dict:
        """What a record of this case says beyond the held-out matrix's fields."""
        return {}


@dataclass(frozen=True)
class TypedCase:
    """A case of a matrix beside this one (MoE, head dims, MLA): ``Case``'s fields with the
    model type given; ``record_id``, ``make_record`` and ``measure_on_ranks`` serve it."""

    id: str
    job: Job
    loop: str
    ac: str
    mode: str
    hf_type: str

    def record_fields(self) -> dict:
        return {}

    def run_options(self) -> dict:
        """What calibrate.loops.run takes beyond the case's own fields (a LoRA case's adapters,
        a model's config overrides)."""
        return {}


def config_json(case: TypedCase, **overrides) -> dict:
    """The config.json of a typed case's llama-family model, as a user would hand it to memplan:
    its experts' keys those calibrate.moe_ep builds the model with, ``overrides`` last."""
    from calibrate.moe_ep import hf_moe_kwargs

    m = case.job.model
    cfg = {
        "model_type": case.hf_type,
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden,
        "intermediate_size": m.ffn_hidden,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_size,
        "hidden_act": "silu",
        "tie_word_embeddings": m.tied_embeddings,
    }
    if m.num_experts:
        cfg |= {k: v for k, v in hf_moe_kwargs(m, case.hf_type).items() if k != "experts_implementation"}
    return cfg | overrides


def _case(
    loop: str,
    model: ModelSpec,
    strategy: str,
    precision: str,
    *,
    gpus: int,
    b: int,
    s: int,
    ac: str = "none",
    mode: str = "emulate",
    attention: str = "sdpa",
    ac_every: int = 1,
    compile: bool = False,
    float8: bool = False,
    in_backward: bool = False,
    zero_grad: str = "none",
    optimizer: str = "adamw",
    offload: bool = False,
) -> Case:
    """A case; the flags (ac_every, compile, float8, optimizer in backward) are in its spec,
    as a user types them, and the loop applies them (calibrate.loops.run)."""
    job = Job(
        model=model,
        train=TrainSpec(
            seq_len=s,
            micro_batch=b,
            precision=precision,
            activation_checkpointing=TODAY_AC[ac],
            attention=attention,
            device="cpu",
            ac_every=ac_every,
            compile=compile,
            float8=float8,
            optimizer_in_backward=in_backward,
            zero_grad=zero_grad,
            optimizer=optimizer,
            offload_activations=offload,
        ),
        cluster=ClusterSpec(gpus=gpus),
        plan=Plan(strategy=STRATEGY[strategy]),
    )
    where = "g" if mode == "local" else "w"
    flags = (f"-every{ac_every}" if ac_every > 1 else "") + (f"-zg{zero_grad}" if zero_grad != "none" else "")
    named = (("compile", compile), ("float8", float8), ("oib", in_backward), ("offload", offload))
    flags += "".join(f"-{flag}" for flag, on in named if on)
    flags += f"-{optimizer}" if optimizer != "adamw" else ""
    name = f"{model.name}-{loop}-{strategy}-{precision}-ac{ac}{flags}-{where}{gpus}-b{b}s{s}"
    return Case(name, job, loop, ac, mode)


# bf16/fp16 matmuls run several times slower than fp32 on this CPU (no AVX512-BF16):
# the low-precision cases use the smaller models and fewer tokens
CASES = (
    _case("plain-kept", LLAMA_A, "ddp", "fp32", gpus=2, b=2, s=256, mode="local"),
    _case("plain-freed", LLAMA_A, "ddp", "fp32", gpus=2, b=2, s=256, mode="local"),
    _case("hf-trainer", LLAMA_A, "ddp", "fp32", gpus=2, b=2, s=256, mode="local"),
    _case("accelerate", LLAMA_A, "ddp", "fp32", gpus=4, b=2, s=256),
    _case("torchtitan", LLAMA_A, "fsdp", "fp32", gpus=8, b=2, s=512, ac="op"),
    _case("torchtitan", LLAMA_A, "sgo", "fp32", gpus=8, b=2, s=512),
    _case("torchtune", LLAMA_A, "fsdp", "fp32", gpus=8, b=2, s=512),
    _case("hf-trainer", LLAMA_A, "fsdp", "fp32", gpus=4, b=4, s=256, ac="full"),
    _case("plain-kept", LLAMA_B, "ddp", "amp-bf16", gpus=2, b=1, s=128, mode="local"),
    _case("hf-trainer", LLAMA_B, "fsdp", "amp-bf16", gpus=16, b=1, s=128),
    _case("torchtitan", LLAMA_B, "fsdp", "mixed-bf16", gpus=32, b=1, s=256, ac="op"),
    _case("torchtune", LLAMA_B, "fsdp", "bf16", gpus=8, b=1, s=128, ac="full"),
    _case("plain-freed", LLAMA_B, "ddp", "bf16", gpus=4, b=1, s=128),
    _case("plain-kept", LLAMA_B, "fsdp", "mixed-bf16", gpus=2, b=1, s=128, mode="local"),
    _case("plain-freed", LLAMA_B, "fsdp", "fp32", gpus=4, b=8, s=128),
    _case("plain-freed", LLAMA_V128K, "fsdp", "fp32", gpus=64, b=1, s=128),
    _case("torchtune", LLAMA_V128K, "fsdp", "fp32", gpus=16, b=1, s=128),
    _case("plain-kept", QWEN_A, "fsdp", "fp32", gpus=2, b=1, s=256, mode="local"),
    _case("hf-trainer", QWEN_A, "fsdp", "fp32", gpus=8, b=2, s=256, ac="full"),
    _case("plain-freed", QWEN_A, "ddp", "fp32", gpus=4, b=1, s=512),
    _case("hf-trainer", QWEN_B, "ddp", "amp-fp16", gpus=4, b=1, s=128),
    _case("plain-kept", QWEN_B, "fsdp", "mixed-fp16", gpus=8, b=1, s=128),
    _case("torchtitan", QWEN_B, "fsdp", "bf16", gpus=16, b=1, s=128, ac="op"),
    _case("plain-kept", MISTRAL_A, "fsdp", "fp32", gpus=16, b=1, s=1024),
    _case("torchtitan", MISTRAL_A, "fsdp", "fp32", gpus=32, b=1, s=1024, ac="full"),
    _case("accelerate", MISTRAL_A, "ddp", "fp32", gpus=2, b=1, s=512, mode="local"),
    _case("hf-trainer", MISTRAL_B, "fsdp", "mixed-bf16", gpus=4, b=1, s=128, ac="full"),
    _case("plain-freed", MISTRAL_B, "ddp", "amp-bf16", gpus=8, b=1, s=128),
    _case("plain-kept", GPT2_A, "ddp", "fp32", gpus=2, b=2, s=256, mode="local", attention="eager"),
    _case("hf-trainer", GPT2_A, "fsdp", "fp32", gpus=4, b=2, s=256, ac="full"),
    _case("plain-freed", GPT2_A, "fsdp", "amp-bf16", gpus=8, b=1, s=128),
    _case("plain-kept", GPT2_LONG, "fsdp", "fp32", gpus=4, b=1, s=2048),
    _case("plain-kept", NEOX_A, "ddp", "fp32", gpus=8, b=2, s=256),
    _case("hf-trainer", NEOX_A, "fsdp", "fp32", gpus=4, b=1, s=512, ac="full"),
    _case("plain-freed", NEOX_B, "fsdp", "bf16", gpus=8, b=1, s=128),
    _case("torchtune", NEOX_B, "ddp", "amp-fp16", gpus=4, b=1, s=128),
    _case("hf-trainer", NEOX_B, "fsdp", "amp-fp16", gpus=16, b=1, s=128),
    # the loop's flags, each applied by the framework's own code (calibrate.loops.run)
    _case("torchtitan", QWEN_C, "fsdp", "fp32", gpus=8, b=2, s=256, ac="full", ac_every=2),
    _case("plain-freed", QWEN_C, "ddp", "fp32", gpus=4, b=1, s=512, ac="full", ac_every=3),
    _case("torchtune", LLAMA_D, "fsdp", "fp32", gpus=8, b=1, s=256, in_backward=True),
    _case("torchtune", QWEN_C, "fsdp", "mixed-bf16", gpus=16, b=1, s=128, in_backward=True),
    _case("torchtitan", MISTRAL_C, "fsdp", "mixed-bf16", gpus=8, b=1, s=128, float8=True),
    _case("torchtitan", LLAMA_C, "ddp", "bf16", gpus=4, b=1, s=128, float8=True),
    _case("torchtitan", LLAMA_C, "fsdp", "fp32", gpus=8, b=1, s=256, compile=True),
    _case("torchtitan", LLAMA_C, "fsdp", "fp32", gpus=8, b=1, s=256),  # the compiled case's eager twin
    _case("torchtune", LLAMA_D, "fsdp", "fp32", gpus=4, b=2, s=128, compile=True),
    # gradients zero-filled between steps (optimizer.zero_grad(set_to_none=False)), measured
    # before the convention was modelled
    _case("hf-trainer", LLAMA_A, "ddp", "fp32", gpus=2, b=2, s=256, mode="local", zero_grad="zeros"),
    _case("plain-kept", QWEN_A, "fsdp", "fp32", gpus=2, b=1, s=256, mode="local", zero_grad="zeros"),
    _case("torchtitan", LLAMA_C, "fsdp", "mixed-bf16", gpus=8, b=1, s=128, ac="full", zero_grad="zeros"),
    _case("torchtitan", LLAMA_C, "fsdp", "mixed-bf16", gpus=8, b=1, s=128, ac="full"),  # its twin, gradients freed
    # torchtune's own model and single-device recipe with the standard cross-entropy (the published
    # Llama-3.2-3B '+ Compile' row's loop), compiled and its eager twin
    _case("torchtune-model", TUNE_A, "single", "bf16", gpus=1, b=2, s=256, compile=True),
    _case("torchtune-model", TUNE_A, "single", "bf16", gpus=1, b=2, s=256),
    # the published '+ 8-bit AdamW' row's optimizer (its config's bitsandbytes PagedAdamW8bit, one per
    # parameter under optimizer-in-backward); on CPU its states are ordinary tensors (get_state_buffer)
    _case(
        "torchtune-model", TUNE_A, "single", "bf16", gpus=1, b=2, s=256, in_backward=True, optimizer="paged-adamw8bit"
    ),
    # full AC outside FSDP full shard, the first block's backward (memplan issue 12): measured before
    # the model of that block's backward changed
    _case("hf-trainer", LLAMA_E, "single", "fp32", gpus=1, b=2, s=256, ac="full", attention="eager"),
    _case("plain-freed", LLAMA_E, "ddp", "fp32", gpus=2, b=1, s=512, ac="full"),
    _case("hf-trainer", NEOX_C, "ddp", "fp32", gpus=4, b=2, s=256, ac="full", attention="eager"),
    _case("plain-freed", GPT2_B, "single", "fp32", gpus=1, b=2, s=256, ac="full"),
    _case("hf-trainer", LLAMA_F, "single", "fp32", gpus=1, b=1, s=512, ac="full", attention="eager"),
    _case("plain-freed", LLAMA_F, "ddp", "fp32", gpus=2, b=2, s=256, ac="full"),
    _case("hf-trainer", NEOX_D, "ddp", "fp32", gpus=2, b=1, s=512, ac="full", attention="eager"),
    _case("plain-freed", GPT2_C, "single", "fp32", gpus=1, b=2, s=256, ac="full"),
    # cut-cross-entropy's linear_cross_entropy in place of the head and the loss, its torch_compile
    # implementation (its Triton one needs a GPU); the flag a user types for it: --loss fused-linear-ce
    # (SGD on one device: AdamW's step would be the peak and hide the loss)
    _case("cce-compile", LLAMA_A, "single", "fp32", gpus=1, b=2, s=256, optimizer="sgd"),
    _case("cce-compile", LLAMA_B, "single", "bf16", gpus=1, b=2, s=256, optimizer="sgd"),
    _case("cce-compile", QWEN_B, "ddp", "fp32", gpus=4, b=2, s=256),
    _case("cce-compile", LLAMA_B, "fsdp", "fp32", gpus=8, b=2, s=256),
    _case("cce-compile", QWEN_B, "fsdp", "fp32", gpus=4, b=2, s=256, ac="full"),
    _case("cce-compile", MISTRAL_B, "fsdp", "mixed-bf16", gpus=4, b=1, s=128),
    # autocast (its casts inside the compiled graph), measured after the autocast terms were modelled
    _case("cce-compile", LLAMA_B, "ddp", "amp-bf16", gpus=4, b=2, s=256),
    # torchtune's activation offloading (its recipes require full AC): the replica of its pack and
    # unpack hooks (calibrate.offload), measured before the model of it changed
    _case("torchtune", LLAMA_G, "single", "fp32", gpus=1, b=4, s=512, ac="full", offload=True, optimizer="sgd"),
    _case("torchtune", LLAMA_G4, "fsdp", "fp32", gpus=4, b=2, s=256, ac="full", offload=True),
    _case("torchtune", LLAMA_G4, "ddp", "fp32", gpus=2, b=1, s=512, ac="full", offload=True),
)
BY_ID = {case.id: case for case in CASES}


def _run(case: Case) -> Run:
    return Run(job=case.job, mode=case.mode, workload="hf", steps=STEPS, warmup=WARMUP)


def record_id(case: Case) -> str:
    """A record's id: its run's key with the loop, policy and model type that ran it."""
    key = json.dumps([_run(case).key, case.loop, case.ac, case.hf_type])
    return hashlib.sha1(key.encode()).hexdigest()[:10]


# --- the child: one case in this process ---------------------------------------------


def _measure_emulated(case: Case):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=case.job.cluster.gpus)
    try:
        return case.measure(emulated=True)
    finally:
        dist.destroy_process_group()


def _loop_measurement(case: Case) -> dict:
    """This rank's measurement of the case's loop (a rank of ``run_ranks``)."""
    import dataclasses

    return dataclasses.asdict(case.measure(emulated=False))


def _rank(rank: int, world: int, port: int, work, arg, results) -> None:
    import traceback

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results.put((rank, work(arg), None))
    except BaseException as exc:  # reported to the parent with its traceback
        results.put((rank, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, work, arg, *, worst=None):
    """``work(arg)`` (a module-level function, ``arg`` picklable) on ``world`` spawned gloo ranks;
    rank 0's result, or with ``worst`` (a key) the largest rank's."""
    import torch.multiprocessing as mp

    from calibrate import launch

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    port = launch._free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, work, arg, results)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    out = {}
    while not results.empty():
        rank, result, error = results.get()
        if error:
            raise RuntimeError(f"rank {rank} failed: {error}")
        out[rank] = result
    if len(out) != world:
        raise RuntimeError(f"ranks {sorted(set(range(world)) - set(out))} exited without reporting")
    return max(out.values(), key=worst) if worst else out[0]


def _measure_local(case: Case):
    from calibrate import measure

    return measure.Measurement(**run_ranks(case.job.cluster.gpus, _loop_measurement, case))


def outcome(measure) -> dict:
    """``measure()`` (a dict of the record's fields) as a case's outcome, ``status`` ok; or, whatever
    went wrong, the failure's status and traceback (the sweep goes on)."""
    import traceback

    from calibrate import launch

    try:
        return {"status": "ok", "error": None, **measure()}
    except BaseException as exc:
        return {
            "status": launch.failure_status(exc),
            "measurement": None,
            "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}".strip(),
        }


def measure_case(case: Case) -> dict:
    """The case's outcome here: ``{"status", "measurement", "error"}`` (rank 0's measurement)."""
    import dataclasses

    def measure() -> dict:
        m = _measure_local(case) if case.mode == "local" else _measure_emulated(case)
        return {"measurement": dataclasses.asdict(m)}

    return outcome(measure)


# --- the parent: one child per case, one record per case -------------------------------


def loop_fields(case: Case) -> dict:
    """The record's ``loop`` (the conventions that ran) and ``loop_source`` (whose code)."""
    from calibrate import loops

    loop = loops.LOOPS[case.loop]
    return {
        "loop": loop.conventions(case.ac, case.job.train),
        "loop_source": loop.loop_source(),
        "case": case.id,
        "hf_model_type": case.hf_type,
        "fsdp_units": fsdp_units(loop.recipe),
    }


def execute_child(case, timeout_s: float, *, module: str = "validation.heldout") -> dict:
    """The outcome of ``python -m MODULE --case ID --result FILE`` run in a child process."""
    with tempfile.TemporaryDirectory(prefix="heldout-") as tmp:
        result, log = Path(tmp, "result.json"), Path(tmp, "log.txt")
        command = [sys.executable, "-m", module, "--case", case.id, "--result", str(result)]
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(
                filter(None, [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")])
            ),
        )
        with open(log, "wb") as log_file:
            try:
                code = subprocess.run(
                    command, stdout=log_file, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, check=False
                ).returncode
            except subprocess.TimeoutExpired:
                return {"status": "timeout", "measurement": None, "error": f"no result after {timeout_s:g} s"}
        if result.exists():
            return json.loads(result.read_text(encoding="utf-8"))
        tail = "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-15:])
        return {"status": "failed", "measurement": None, "error": f"exit code {code} without a result:\n{tail}"}


def make_record(case: Case, outcome: dict, wall_s: float) -> dict:
    record = records.make_record(_run(case), **outcome, wall_s=wall_s)
    return record | {"id": record_id(case)} | loop_fields(case) | case.record_fields()


def _typed_rank_measurement(case: TypedCase) -> dict:
    """This rank's measurement of a typed case's loop (in this process, or a rank of ``run_ranks``)."""
    import dataclasses

    from calibrate import loops

    m = loops.run(
        case.job,
        loops.LOOPS[case.loop],
        hf_type=case.hf_type,
        ac=case.ac,
        emulated=False,
        steps=STEPS,
        warmup=WARMUP,
        **case.run_options(),
    )
    return dataclasses.asdict(m)


def measure_on_ranks(case: TypedCase) -> dict:
    """A typed case's outcome here: one rank in this process, else the case's spawned gloo ranks,
    the largest rank's peak."""
    import dataclasses

    from calibrate import measure

    def run() -> dict:
        if case.job.cluster.gpus == 1:
            return {"measurement": _typed_rank_measurement(case)}
        worst = run_ranks(
            case.job.cluster.gpus, _typed_rank_measurement, case, worst=lambda m: m["peak_allocated_bytes"]
        )
        return {"measurement": dataclasses.asdict(measure.Measurement(**worst))}

    return outcome(run)


def _module_name(module) -> str:
    """The importable name of a matrix module, also when it runs as ``__main__`` (``python -m``)."""
    return getattr(module.__spec__, "name", module.__name__)


def sweep(cases=CASES, *, out=OUT, timeout_s: float = TIMEOUT_S, matrix=None) -> None:
    """Measure every case ``out`` holds no ok record of, appending its record as it ends.
    ``matrix``: the module whose cases, records and child these are (this one by default;
    validation.dsmatrix has the same functions)."""
    m = matrix or sys.modules[__name__]
    done = {r["id"] for r in records.read([out]) if r["status"] == "ok"} if Path(out).exists() else set()
    for case in cases:
        if m.record_id(case) in done:
            continue
        start = time.perf_counter()
        outcome = execute_child(case, timeout_s, module=_module_name(m))
        record = m.make_record(case, outcome, time.perf_counter() - start)
        records.append(out, record)
        print(f"{record['status']:7} {record['wall_s']:6.1f} s  {case.id}", flush=True)


# --- the report ----------------------------------------------------------------------


def _convention(record: dict) -> str:
    loop = record["loop"]
    return f"{loop['recipe']} logits-{loop['logits']} {loop['loss']} ac-{loop['ac']}"


def latest(recs: list[dict]) -> list[dict]:
    """The last record of each case (a re-measured case appends a new one), in first-seen order."""
    by_id: dict[str, dict] = {}
    for record in recs:
        by_id[record["id"]] = record  # a dict keeps a key's first position when its value is replaced
    return list(by_id.values())


def latest_ok(path: str | Path) -> list[dict]:
    """A committed matrix's measured cases: the last record of each, those that ran."""
    return [r for r in latest(records.read([path])) if r["status"] == "ok"]


LOSS_IMPLS = {"cce-torch-compile": "cce-compile"}
"""A fused loss's implementation (the record's ``loop_impl``) -> memplan's --loss for it: the
cases were recorded as a user typed them before it had one (``--loss fused-linear-ce``)."""


def loop_job(record: dict) -> Job:
    """The record's Job with the loop that ran it (its ``loop``) as memplan's inputs: the
    conventions and the recipe's FSDP units (calibrate.wrappers lays them out as the framework
    does), not its optimizer implementation (the loops step the spec's optimizer)."""
    loop = record["loop"]
    return records.job_from_spec(record["spec"]).with_(
        logits=loop["logits"],
        loss=LOSS_IMPLS.get(loop.get("loss_impl", ""), loop["loss"]),
        activation_checkpointing=loop["ac"],
        loss_chunks=loop["loss_chunks"] if loop["loss"] == "chunked-ce" else TrainSpec.loss_chunks,
        ac_every=max(1, loop["ac_every"]),
        compile=loop["compile"],
        float8=loop.get("float8", False),
        offload_activations=loop["offload_activations"],
        optimizer_in_backward=loop["optimizer_in_backward"],
        zero_grad=loop.get("zero_grad", "none"),
        use_cache=loop.get("use_cache", False),
        recipe=loop["recipe"],
        # Hugging Face blocks under a framework's loop: sdpa's own grouped-query path, no k/v copies
        kv_copies=None if record["hf_model_type"].startswith("torchtune") else False,
    )


def table_rows(recs: list[dict], *, with_loop: bool = True, job_of=loop_job) -> list[dict]:
    """report.rows, the run named by its case (model, loop, strategy, precision, AC, world, shape),
    estimated with the record's loop (``job_of``: ``loop_job``) or, ``with_loop=False``, on its spec alone."""
    from calibrate.report import rows

    table = rows(recs, job_of) if with_loop else rows(recs)
    return [row | {"run": record["case"]} for row, record in zip(table, recs)]


def _errors(table: list[dict], recs: list[dict], key) -> dict[str, list[float]]:
    groups: dict[str, list[float]] = {}
    for row, record in zip(table, recs):
        if row["status"] == "ok" and row["error_pct"] is not None:
            groups.setdefault(key(record), []).append(row["error_pct"])
    return groups


def _spread(errs: list[float]) -> str:
    return f"{statistics.median(abs(e) for e in errs):.2f} | {max(abs(e) for e in errs):.2f}"


def _group_lines(before: list[dict], after: list[dict], recs: list[dict], key) -> list[str]:
    was, now = _errors(before, recs, key), _errors(after, recs, key)
    return [
        f"| {name} | {len(errs)} | {_spread(was[name])} | {_spread(errs)} | {min(errs):+.2f} … {max(errs):+.2f} |"
        for name, errs in sorted(now.items())
    ]


def render_cases(recs: list[dict]) -> str:
    """The table of a matrix's records, each run named by its case (the matrices beside this one)."""
    from calibrate.report import render_table

    return render_table(table_rows(recs))


def render_report(recs: list[dict]) -> str:
    from calibrate.report import render_table

    table, before = table_rows(recs), table_rows(recs, with_loop=False)
    header = [
        "| convention | cases | before: median abs error % | before: max | after: median abs error % | "
        "after: max | after: error range % |",
        "|---|---|---|---|---|---|---|",
    ]
    sections = [
        ("by logits", lambda r: f"logits {r['loop']['logits']}"),
        ("by loss", lambda r: r["loop"]["loss"]),
        ("by activation checkpointing", lambda r: f"ac {r['loop']['ac']}"),
        ("by recipe", lambda r: r["loop"]["recipe"]),
        ("by precision", lambda r: r["spec"]["train"]["precision"]),
        ("by strategy", lambda r: r["spec"]["plan"]["strategy"]),
    ]
    lines = [render_table(table), ""]
    sections.append(("all", lambda r: "all cases"))
    for title, key in sections:
        lines += [f"{title}:", "", *header, *_group_lines(before, table, recs, key), ""]
    return "\n".join(lines)


def main(argv=None, matrix=None) -> None:
    """The command line of this matrix, or of ``matrix`` (a module with the same functions)."""
    import argparse
    import sys

    m = matrix or sys.modules[__name__]
    parser = argparse.ArgumentParser(
        prog=f"python -m {_module_name(m)}", description=(m.__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--out", default=m.OUT)
    parser.add_argument("--report", action="store_true", help="print the table of the records and exit")
    parser.add_argument("--case", help="(child) measure this one case here")
    parser.add_argument("--result", help="(child) where to write the case's outcome")
    parser.add_argument("--only", nargs="*", help="measure only these case ids")
    parser.add_argument("--timeout", type=float, default=m.TIMEOUT_S)
    args = parser.parse_args(argv)
    if args.report:
        print(m.render_report(latest(records.read([args.out]))))
    elif args.case:
        outcome = m.measure_case(m.BY_ID[args.case])
        Path(args.result).write_text(json.dumps(outcome), encoding="utf-8")
    else:
        cases = [m.BY_ID[i] for i in args.only] if args.only else m.CASES
        sweep(cases, out=args.out, timeout_s=args.timeout, matrix=m)


if __name__ == "__main__":
    main()
