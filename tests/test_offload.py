"""calibrate.offload, the replica of torchtune 0.6.1 OffloadActivations' memory decisions, on
CPU under MemTracker: what it moves to the host leaves the measured device, the step's
gradients are the ones without it, and its stash rule keeps the last ids on the device."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from calibrate.measure import _CpuMeter
from calibrate.offload import OffloadActivationsReplica, offloading_context


class _Net(nn.Module):
    def __init__(self, width: int = 64, layers: int = 7):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.output = nn.Linear(width, 8)

    def forward(self, x):
        for layer in self.layers:  # full AC: each block packs only its input
            x = checkpoint(layer, x, use_reentrant=False)
        return self.output(x)


def _step(net, x, offload):
    """Forward under ``offload`` (or none), then backward; the live bytes at the end of forward."""
    with _CpuMeter() as meter:
        with offload or torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            out = net(x)
        live = meter.tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        out.sum().backward()
    return live


def test_offloaded_inputs_leave_the_device_and_gradients_match():
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(32, 64)  # each block's input: 32·64·4 = 8 KiB >= 1024 B
    plain = _step(net, x, None)
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    ctx = offloading_context(net.output)
    offloaded = _step(net, x, ctx)
    # the seven blocks' inputs (x, then six block outputs: ids 1-7) are copied to the host; the
    # last offload (id 7) drops ids <= 7 - 5 from the stash (the head runs under NoOpManager,
    # nothing packed after it): x, the caller's, stays alive anyway, the first block's output
    # (id 2, 8 KiB) leaves the device, the other five stay in the stash until backward
    assert ctx.offloaded_bytes == 7 * 32 * 64 * 4
    assert plain - offloaded == 32 * 64 * 4
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), grads))
    assert not ctx.tracker and not ctx.fwd_stash and not ctx.bwd_tensor_stash


def test_stash_drops_ids_at_least_max_fwd_stash_size_old_and_keeps_small_tensors():
    ctx = OffloadActivationsReplica(max_fwd_stash_size=2)
    big, small = torch.ones(256), torch.ones(8)  # 1024 B (offloaded) and 32 B (kept as is)
    ids = [ctx._pack(t) for t in (big, big * 2, small, big * 3)]
    assert ctx.tracker[ids[2]] == (small, False)
    assert list(ctx.fwd_stash) == [ids[3]]  # ids 1 and 2 are at least 2 below id 4
    assert ctx.offloaded_bytes == 3 * 1024


@pytest.mark.slow
def test_host_bytes_are_what_the_replica_copied(monkeypatch):
    """The held-out one-GPU offloading case run again: the bytes the replica copied to the host
    in the measured step are memplan's host RAM for it (the blocks' inputs, the final norm's
    packs, the input ids)."""
    from calibrate import offload
    from memplan.memory import estimate
    from validation import heldout

    made, original = [], offload.offloading_context

    def capture(head):  # calibrate.loops.run imports it when the case's loop starts
        made.append(original(head))
        return made[-1]

    monkeypatch.setattr(offload, "offloading_context", capture)
    case = next(c for c in heldout.CASES if c.job.train.offload_activations and c.job.cluster.gpus == 1)
    outcome = heldout.measure_case(case)
    assert outcome["status"] == "ok", outcome["error"]
    record = {"spec": heldout.make_record(case, outcome, 0.0)["spec"]} | heldout.loop_fields(case)
    assert made[-1].offloaded_bytes == estimate(heldout.loop_job(record)).host_bytes
