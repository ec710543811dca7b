"""FSDP2's integer ``reshard_after_forward`` (issue 27), measured as torch runs it: Hugging Face
models built from their configs, wrapped by ``calibrate.wrappers.fsdp_on`` (``fully_shard`` on
each block and the recipe's other units, ``reshard_after_forward=N`` where the job's plan gives
N), one rank of 4 or 8 on the fake process group, the held-out matrix's loops
(``validation.heldout``: MemTracker's peak of live tensors over the last step). Torch's
``_get_post_forward_mesh_info`` (torch 2.13 _fsdp_init.py) turns N into a mesh of N ranks; after
a unit's forward ``to_sharded_post_forward`` (_fsdp_param.py) keeps a clone of its 1/N slice of
the all-gather output, freed when its backward's all-gather copies out (``to_unsharded``).

The shapes are new (deeper than the held-out matrix's two-block models, so the post-forward
copies add up); the first table, before memplan read the keyword, is
validation/records/fsdp2_reshard_cpu.first.md.

    python -m validation.fsdp2_reshard            # measure every case not yet recorded
    python -m validation.fsdp2_reshard --report   # measured, estimated today, error %
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memplan.specs import ModelSpec

from . import heldout
from .heldout import MISTRAL_A, QWEN_B, Case, _case

OUT = "validation/records/fsdp2_reshard_cpu.jsonl"
TIMEOUT_S = heldout.TIMEOUT_S

LLAMA_L6 = ModelSpec(
    name="llama-h512-l6",
    arch="llama",
    num_layers=6,
    hidden=512,
    num_heads=8,
    num_kv_heads=2,
    ffn_hidden=1408,
    vocab_size=8192,
)
QWEN_L4 = replace(QWEN_B, name="qwen2-h448-l4", num_layers=4)
MISTRAL_L5 = replace(MISTRAL_A, name="mistral-h640-l5", num_layers=5)
HF_TYPE = {LLAMA_L6.name: "llama", QWEN_L4.name: "qwen2", MISTRAL_L5.name: "mistral"}


@dataclass(frozen=True)
class ReshardCase(Case):
    @property
    def hf_type(self) -> str:
        return HF_TYPE[self.job.model.name]


def _reshard(group: int, loop: str, model: ModelSpec, precision: str, **kwargs) -> ReshardCase:
    """A full-shard case with ``fully_shard(reshard_after_forward=group)``."""
    case = _case(loop, model, "fsdp", precision, **kwargs)
    job = replace(case.job, plan=replace(case.job.plan, reshard_after_forward=group))
    return ReshardCase(f"{case.id}-raf{group}", job, case.loop, case.ac, case.mode)


CASES = (
    _reshard(2, "plain-kept", LLAMA_L6, "fp32", gpus=8, b=2, s=256),
    _reshard(4, "plain-kept", LLAMA_L6, "fp32", gpus=8, b=2, s=256),
    _reshard(4, "plain-kept", LLAMA_L6, "fp32", gpus=4, b=2, s=256),
    _reshard(2, "hf-trainer", LLAMA_L6, "mixed-bf16", gpus=8, b=4, s=256, ac="full"),
    _reshard(2, "plain-freed", QWEN_L4, "mixed-bf16", gpus=4, b=2, s=512),
    _reshard(4, "accelerate", MISTRAL_L5, "mixed-bf16", gpus=8, b=1, s=512, ac="full"),
    _reshard(2, "torchtune", LLAMA_L6, "bf16", gpus=8, b=2, s=256),
)
BY_ID = {case.id: case for case in CASES}

# the held-out matrix's child, record, table and command line serve this one (heldout.main's matrix)
measure_case, make_record, record_id = heldout.measure_case, heldout.make_record, heldout.record_id
render_report = heldout.render_cases


if __name__ == "__main__":  # the cases as validation.fsdp2_reshard's, which the child processes import
    from validation import fsdp2_reshard

    heldout.main(matrix=fsdp2_reshard)
