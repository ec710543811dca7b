"""Where a pipeline rank peaks: a case of the parallel matrix (``validation.parallel_matrix``) re-run on
gloo ranks with each pipeline action of the last step metered (torch 2.13
torch/distributed/pipelining/stage.py ``forward_one_chunk``, ``backward_one_chunk``,
``perform_reduce_grad``): the live bytes when it starts, its peak, the live bytes when it ends,
and what FSDP2 holds at its start and end (``fsdp_held``).
``validation.peak_probe`` names FSDP's state at a peak on the fake process group, whose single
rank cannot run a pipeline's sends and receives; this probe places the peak among the schedule's
actions instead (the FSDP × PP moments of ``memplan/parallel/step.py`` are read from it).

    python -m validation.pipeline_probe dp2-pp2-fsdp-m4
"""

from __future__ import annotations

import argparse
import os
import traceback

MiB = 2**20
ACTIONS = ("forward_one_chunk", "backward_one_chunk", "perform_reduce_grad")


def fsdp_held(module) -> dict[str, int]:
    """Bytes FSDP2 holds for ``module``'s units (torch 2.13 _fsdp_param.py): gradients unsharded
    (on the unsharded parameter or accumulated in the reduce dtype), parameters gathered (the
    unit's state UNSHARDED), gradients sharded (on the sharded DTensor parameter)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    held = {"unsharded_grads": 0, "gathered_params": 0, "sharded_grads": 0}
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        group = fully_shard.state(sub)._fsdp_param_group  # type: ignore[attr-defined]
        if group is None:
            continue
        for p in group.fsdp_params:
            unsharded = getattr(p, "_unsharded_param", None)
            grad = p.unsharded_accumulated_grad
            if grad is None and unsharded is not None:
                grad = unsharded.grad
            held["unsharded_grads"] += grad.numel() * grad.element_size() if grad is not None else 0
            if group.is_unsharded and unsharded is not None:
                held["gathered_params"] += unsharded.numel() * unsharded.element_size()
            shard = p.sharded_param.grad
            held["sharded_grads"] += shard._local_tensor.nbytes if shard is not None else 0
    return held


def install(log: list[dict]) -> None:
    """Meter every pipeline action into ``log`` (this process only)."""
    import torch
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from . import parallel_matrix

    meters = []
    make = parallel_matrix._meter

    def meter():
        meters.append(make())
        return meters[-1]

    parallel_matrix._meter = meter
    cpu = torch.device("cpu")

    def wrap(name: str):
        original = getattr(_PipelineStageBase, name)

        def metered(self, *args, **kwargs):
            tracker = meters[-1].tracker
            before = tracker._peak_mem.get(cpu, 0)
            start = tracker.get_tracker_snapshot("current").get(cpu, {}).get("Total", 0)
            tracker._peak_mem = {cpu: start}
            held = fsdp_held(self.submod)
            out = original(self, *args, **kwargs)
            peak = tracker._peak_mem.get(cpu, 0)
            end = tracker.get_tracker_snapshot("current").get(cpu, {}).get("Total", 0)
            tracker._peak_mem = {cpu: max(before, peak)}
            micro = args[0] if args and name != "perform_reduce_grad" else None
            log.append(
                {
                    "action": name,
                    "stage": self.stage_index,
                    "micro_batch": micro,
                    "start": start,
                    "peak": peak,
                    "end": end,
                    "fsdp_start": held,
                    "fsdp_end": fsdp_held(self.submod),
                }
            )
            return out

        setattr(_PipelineStageBase, name, metered)

    for name in ACTIONS:
        wrap(name)


def _worker(rank: int, world: int, port: int, job, results) -> None:
    import torch.distributed as dist

    from . import parallel_matrix

    log: list[dict] = []
    install(log)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        record = parallel_matrix.run_rank(job)
        # the last step's actions: every step runs the same number of them
        record["actions"] = log[-len(log) // parallel_matrix.STEPS :]
        results.put((rank, record, None))
    except BaseException as exc:  # reported to the parent
        results.put((rank, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))
    finally:
        dist.destroy_process_group()


def measure(case: str) -> list[dict]:
    """Every rank's record (``validation.parallel_matrix.run_rank``) with its last step's actions."""
    from . import parallel_matrix
    from .parallel_cases import CASES

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return parallel_matrix.measure(CASES[case], worker=_worker)


def render(ranks: list[dict]) -> list[str]:
    lines = []
    seen = set()
    for r in ranks:
        if r["pp_rank"] in seen:  # the data-parallel ranks of a stage run alike
            continue
        seen.add(r["pp_rank"])
        lines.append(f"rank {r['rank']} (pipeline rank {r['pp_rank']}), peak {r['peak_allocated_bytes'] / MiB:.2f} MiB")
        for a in r["actions"]:
            mb = "" if a["micro_batch"] is None else f" micro-batch {a['micro_batch']}"
            held = a["fsdp_end"]
            lines.append(
                f"  {a['action']:<20} stage {a['stage']}{mb:<15} start {a['start'] / MiB:7.2f}  "
                f"peak {a['peak'] / MiB:7.2f}  end {a['end'] / MiB:7.2f}  FSDP after: unsharded grads "
                f"{held['unsharded_grads'] / MiB:.2f}, gathered {held['gathered_params'] / MiB:.2f}, "
                f"sharded grads {held['sharded_grads'] / MiB:.2f}"
            )
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m validation.pipeline_probe")
    parser.add_argument("case")
    args = parser.parse_args(argv)
    print("\n".join(render(measure(args.case))))


if __name__ == "__main__":
    main()
