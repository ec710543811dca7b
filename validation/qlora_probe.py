"""What a QLoRA step holds at its peak, storage by storage, beside memplan's peak moment: one
llama block of the given width built by transformers from a config, every linear of it as
bitsandbytes' Linear4bit (validation.qlora_quant's adaptation), peft's LoRA on the attention
projections, bf16, three steps on CPU; the storage meter of calibrate.alloctrace (``LiveBytes``:
no module hooks) snapshots the live storages at the last step's peak, each named by the operator
that made it.

At hidden 1536 the peak is the MLP output projection's backward (``aten.mm`` in bitsandbytes'
MatMul4Bit.backward): its dequantized weight beside the one input gradient it makes, the block's
kept tensors all live (memplan.finetune.transient_in_place).

    python -m validation.qlora_probe [HIDDEN]
"""

from __future__ import annotations

import sys
from collections import Counter

import torch

from calibrate.alloctrace import LiveBytes
from memplan.memory import estimate
from memplan.specs import ModelSpec

from . import qlora_quant

STEPS = 3


class _PeakStorages(LiveBytes):
    """``LiveBytes`` that names each storage by its operator, shape and dtype and keeps the live
    ones at each new peak once armed."""

    def __init__(self) -> None:
        super().__init__()
        self.named: dict[int, tuple[str, tuple[int, ...], str]] = {}
        self.op = "parameter or state"
        self.armed = False
        self.at_peak: tuple[str, dict[int, tuple[int, tuple]]] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.op = func.__name__
        return super().__torch_dispatch__(func, types, args, kwargs)

    def see(self, tensor: torch.Tensor) -> None:
        fresh = tensor.untyped_storage() not in self.slots
        super().see(tensor)
        if fresh:
            dtype = str(tensor.dtype).removeprefix("torch.")
            self.named[self.slots[tensor.untyped_storage()]] = (self.op, tuple(tensor.shape), dtype)

    def _alloc(self, slot: int, nbytes: int) -> None:
        before = self.peak_bytes
        super()._alloc(slot, nbytes)
        if self.armed and self.peak_bytes > before:
            self.at_peak = (self.op, {s: (n, self.named.get(s, (self.op, (), "?"))) for s, n in self.sizes.items()})


def probe(hidden: int) -> None:
    from transformers import AutoModelForCausalLM

    from calibrate.workloads import hf_config

    spec = ModelSpec(
        name=f"llama-h{hidden}-l1",
        arch="llama",
        num_layers=1,
        hidden=hidden,
        num_heads=8,
        num_kv_heads=2,
        ffn_hidden=hidden * 11 // 4 // 64 * 64,
        vocab_size=2048,
    )
    qlora_quant.HF_TYPE[spec.name] = "llama"
    case = qlora_quant._qlora(spec, double_quant=True, b=2, s=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(spec, attention="sdpa")).to(torch.bfloat16)
    case.adapt(type("Built", (), {"hf": model, "layers": model.model.layers}))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(0, spec.vocab_size, (2, 64))
    meter = _PeakStorages()
    for tensor in [*model.parameters(), *model.state_dict().values()]:
        meter.see(tensor)
    with meter:
        for step in range(STEPS):
            if step == STEPS - 1:
                meter.reset_peak()
                meter.armed = True
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert meter.at_peak is not None
    op, live = meter.at_peak
    print(f"measured peak {meter.peak_bytes:,} B, at {op}")
    rows = Counter((named, n) for n, named in live.values())
    for ((made_by, shape, dtype), n), count in sorted(rows.items(), key=lambda kv: -kv[0][1] * kv[1]):
        print(f"  {count:3d} × {n:12,d} B  {dtype:9s} {shape!s:22s} {made_by}")
    # the loop keeps no output: the logits are freed once the loss is taken (memplan's plain-freed)
    est = estimate(case.job.with_(recipe="plain", logits="freed", kv_copies=False))
    print(f"memplan {est.allocated_bytes:,} B, at {est.peak.label}")
    for t in est.peak.terms:
        print(f"  {t.bytes:14,d} B  {t.name}")


if __name__ == "__main__":
    probe(int(sys.argv[1]) if len(sys.argv) > 1 else 1536)
