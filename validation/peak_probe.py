"""What FSDP2 holds at a measured peak: a held-out case (validation.heldout) re-run on the fake
process group under MemTracker, each live storage at the peak named by the FSDP state that holds
it (torch 2.13 _fsdp_param_group.py / _fsdp_collectives.py): a unit's sharded parameters and
gradients, its unsharded parameters and gradients, an all-gather buffer still pending
(``_all_gather_result``) or retained (``FSDPCommContext.all_gather_state``), a reduce-scatter
input retained (``reduce_scatter_states``), the gradients handed to ``foreach_reduce``; the rest
by MemTracker's category. Besides the step's peak, the largest instant inside each block's
forward and backward (ModTracker's parents).

    python -m validation.peak_probe CASE_ID [--from-mib 50]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

MiB = 2**20


@dataclass
class Snapshot:
    total_bytes: int
    backward: bool
    parents: list[str]
    bytes_by_holder: dict[str, int]


@dataclass
class Probe:
    """The instants a run keeps: the step's peak and the largest inside each region."""

    from_bytes: int = 0
    model: Any = None
    peak: Snapshot | None = None
    regions: dict[str, Snapshot] = field(default_factory=dict)
    in_reduce: Any = None  # storage -> "gradient in foreach_reduce [param]" (weak keys)


def _holders(probe: Probe) -> dict[int, str]:
    """data_ptr -> holder name, from the FSDP states of the wrapped model."""
    names: dict[int, str] = {}

    def put(tensor, name: str) -> None:
        if tensor is None:
            return
        tensor = getattr(tensor, "_local_tensor", tensor)
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in names:
            names[storage.data_ptr()] = name

    for storage, name in list(probe.in_reduce.items()):
        if storage.nbytes():
            names[storage.data_ptr()] = name
    contexts = set()
    modules = probe.model.named_modules() if probe.model is not None else ()
    for path, module in modules:
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = state._fsdp_param_group if state is not None else None
        if group is None:
            continue
        unit = path or "<root>"
        for param in group.fsdp_params:
            if hasattr(param, "_unsharded_param"):
                put(param._unsharded_param, f"unsharded parameters [{unit}]")
                put(param._unsharded_param.grad, f"unsharded gradients [{unit}]")
            for out in getattr(param, "all_gather_outputs", None) or []:
                put(out, f"unsharded parameters [{unit}]")
            put(param.sharded_param.grad, f"gradient shard [{unit}]")
            put(param._sharded_param_data, f"parameter shard [{unit}]")
        if group._all_gather_result is not None:
            put(group._all_gather_result.all_gather_output, f"all-gather buffer, pending [{unit}]")
        if id(group.comm_ctx) not in contexts:
            contexts.add(id(group.comm_ctx))
            if group.comm_ctx.all_gather_state is not None:
                put(group.comm_ctx.all_gather_state.all_gather_result.all_gather_output, "all-gather buffer, retained")
            for state_ in group.comm_ctx.reduce_scatter_states:
                put(state_.reduce_scatter_input, "reduce-scatter input, retained")
    return names


def _snapshot(tracker, probe: Probe, total: int) -> Snapshot:
    names = _holders(probe)
    held: Counter = Counter()
    for storage, (info, _) in list(tracker._WINFO.items()):
        if info.mem_consumed:
            category = getattr(info.reftype, "value", str(info.reftype))
            held[names.get(storage.data_ptr(), f"<{category}>")] += info.mem_consumed
    parents = sorted(tracker._mod_tracker.parents)
    return Snapshot(total, tracker._mod_tracker.is_bw, parents, dict(held))


def install(probe: Probe):
    """Hook the harness: the meter's MemTracker records the instants, the wrapper keeps the
    model, ``foreach_reduce`` names the gradients it is handed. Returns what undoes it."""
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from torch.utils.weak import WeakIdKeyDictionary

    from calibrate import loops, measure

    probe.in_reduce = WeakIdKeyDictionary()
    make_tracker = measure._frozen_aware_tracker

    def tracker():
        base = make_tracker()

        class Recording(type(base)):  # type: ignore[misc]
            def _update_peak_stats(self, peak_state):
                device = torch.device("cpu")
                before = self._peak_mem.get(device, 0)
                super()._update_peak_stats(peak_state)
                now = self._curr_mem_snap.get(device, {}).get("Total", 0)
                blocks = sorted(
                    {m.group(1) for p in self._mod_tracker.parents if (m := re.search(r"((?:layers|h)\.\d+)", p))}
                )
                region = ("backward " if self._mod_tracker.is_bw else "forward ") + (",".join(blocks) or "outside")
                kept = probe.regions.get(region)
                if now >= probe.from_bytes and (kept is None or now > kept.total_bytes):
                    probe.regions[region] = _snapshot(self, probe, now)
                after = self._peak_mem.get(device, 0)
                if after > before and after >= probe.from_bytes:
                    probe.peak = _snapshot(self, probe, after)

        base.__class__ = Recording
        return base

    measure._frozen_aware_tracker = tracker
    wrap = loops.wrap

    def keep(model, job, emulated):
        probe.model = wrap(model, job, emulated)
        return probe.model

    loops.wrap = keep
    reduce = _fsdp_param_group.foreach_reduce

    def named_reduce(fsdp_params, unsharded_grads, *args, **kwargs):
        for param, grad in zip(fsdp_params, unsharded_grads):
            probe.in_reduce[grad.untyped_storage()] = f"gradient in foreach_reduce [{param._param_fqn}]"
        return reduce(fsdp_params, unsharded_grads, *args, **kwargs)

    _fsdp_param_group.foreach_reduce = named_reduce

    def uninstall() -> None:
        measure._frozen_aware_tracker, loops.wrap, _fsdp_param_group.foreach_reduce = make_tracker, wrap, reduce

    return uninstall


def run(case_id: str, from_mib: float = 0.0) -> tuple[Any, Probe]:
    """Measure the held-out case ``case_id`` emulated (its rank 0 on the fake process group)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from . import heldout

    probe = Probe(from_bytes=int(from_mib * MiB))
    uninstall = install(probe)
    case = heldout.BY_ID[case_id]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=case.job.cluster.gpus)
    try:
        measurement = case.measure(emulated=True)
    finally:
        dist.destroy_process_group()
        uninstall()
    return measurement, probe


def render(title: str, snap: Snapshot) -> list[str]:
    where = ", ".join(p for p in snap.parents if p.count(".") < 5)
    lines = [f"{title}: {snap.total_bytes / MiB:.3f} MiB ({'backward' if snap.backward else 'forward'}; in {where})"]
    lines += [f"  {name:<64} {n / MiB:10.3f} MiB" for name, n in sorted(snap.bytes_by_holder.items())]
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m validation.peak_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("case", help="a held-out case id (validation.heldout)")
    parser.add_argument("--from-mib", type=float, default=0.0, help="record instants from this many MiB live")
    args = parser.parse_args(argv)
    measurement, probe = run(args.case, args.from_mib)
    print(f"{args.case}: peak {measurement.peak_allocated_bytes / MiB:.3f} MiB in {measurement.phase}")
    if probe.peak is not None:
        print("\n".join(render("the peak", probe.peak)))
    for region, snap in probe.regions.items():
        print("\n".join(render(region, snap)))


if __name__ == "__main__":
    main()
