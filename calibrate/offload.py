"""A CPU replica of the part of torchtune's activation offloading that decides device memory.

torchtune 0.6.1 ``training/_activation_offloading.py`` ``OffloadActivations`` cannot run on
CPU: its constructor calls ``torch.cuda.default_stream()`` and its copies run under
``torch.cuda.stream``. This module is NOT torchtune's class. It keeps the class's decisions
that set which tensors hold device memory and for how long (its pack and unpack hooks'
control flow with ``use_streams=True``, the default the recipes get from
``get_act_offloading_ctx_manager``, copied line for line and cited below) and replaces only:

- the host copy (``torch.empty_like(activation, pin_memory=..., device="cpu")`` and
  ``copy_``): here a CPU tensor made with every dispatch mode paused
  (``_disable_current_modes``), so MemTracker (a TorchDispatchMode that counts the storages
  of the outputs of the ops it sees, mem_tracker.py ``__torch_dispatch__`` ->
  ``_track``) never sees it: it stands for host RAM, outside the measured device;
- the copy back (``maybe_gpu_tensor.to("cuda", non_blocking=True)``): here ``clone()`` under
  the tracker, a new device allocation of the same size, as the copy to the GPU is;
- the streams' events and waits (``s0.wait_event``, ``s1.wait_stream``, ``record_stream``):
  no-ops, CPU ops being synchronous; what they guard, the references the stashes hold, is
  kept exactly (a reference is what keeps an allocation alive in the caching allocator's
  allocated bytes).

Unmeasured by this replica: the CUDA streams' overlap and timing, pinned host buffers, and
``record_stream``'s deferred reuse (it changes reserved bytes, not allocated ones).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import _disable_current_modes


def _host_copy(activation: torch.Tensor) -> torch.Tensor:
    """The offloaded copy, made where no dispatch mode (MemTracker) sees it: host RAM."""
    with _disable_current_modes():
        cpu_tensor = torch.empty_like(activation, device="cpu")
        cpu_tensor.copy_(activation)
    return cpu_tensor


class OffloadActivationsReplica(saved_tensors_hooks):
    """torchtune 0.6.1 ``OffloadActivations(use_streams=True)``'s memory decisions on CPU
    (see the module's docstring for what is replaced). Line numbers are
    training/_activation_offloading.py's."""

    def __init__(self, max_fwd_stash_size: int = 5, min_offload_size: int = 1024) -> None:
        # l.66-111: the defaults and the state use_streams=True keeps
        self.min_tensor_size_bytes = min_offload_size
        self.tracker: dict[int, tuple[torch.Tensor, bool]] = {}
        self.tensor_id = 0
        self.is_first_forward_call = True
        self.is_first_backward_call = True
        if max_fwd_stash_size < 1:
            raise ValueError(f"max_fwd_stash_size should be at least 1 but is {max_fwd_stash_size}")
        self.max_fwd_stash_size = max_fwd_stash_size
        self.fwd_stash: dict[int, torch.Tensor] = {}  # tensor_id -> activation kept alive (l.97)
        self.bwd_tensor_stash: dict[int, torch.Tensor] = {}  # tensor_id -> brought-back tensor
        self.bwd_ev_stash: dict[int, bool] = {}  # tensor_id -> "event recorded" (l.105)
        self.curr_graph_id: int | None = None
        self.curr_autograd_node: object = None
        self.offloaded_bytes = 0
        """Bytes copied to the host in this step's forward (what stands for host RAM)."""
        super().__init__(self._pack, self._unpack)

    def _pack(self, activation: torch.Tensor) -> int:
        # l.133-203 pack_tensor
        if self.is_first_forward_call:
            assert not self.tracker, "backward pass should have cleared tracker of all tensors"
            self.is_first_forward_call = False
            self.is_first_backward_call = True
            self.offloaded_bytes = 0
        num_bytes = activation.element_size() * activation.nelement()  # l.126-131 get_num_bytes_tensor
        self.tensor_id += 1
        tensor_id = self.tensor_id
        # l.150-153: only tensors of at least min_offload_size bytes that are not parameters or buffers
        if num_bytes >= self.min_tensor_size_bytes and not isinstance(activation, (nn.Parameter, nn.Buffer)):
            # l.155-165: dereference the stashed activations at least max_fwd_stash_size ids old
            for old in list(self.fwd_stash):
                if old <= tensor_id - self.max_fwd_stash_size:
                    del self.fwd_stash[old]
                else:
                    break
            # l.169-190: the host copy, tracked as modified (to be brought back)
            self.tracker[tensor_id] = (_host_copy(activation), True)
            self.offloaded_bytes += num_bytes
            # l.192-193: the activation stays referenced until the copy is known done
            self.fwd_stash[tensor_id] = activation
        else:
            self.tracker[tensor_id] = (activation, False)  # l.194-198
        return tensor_id

    def _unpack(self, unpack_tensor_id: int) -> torch.Tensor:
        # l.227-353 unpack_tensor_with_streams
        if self.is_first_backward_call:
            self.curr_graph_id = torch._C._current_graph_task_id()

            def wait_and_del_remaining_references() -> None:  # l.233-244
                for old in list(self.bwd_tensor_stash):
                    del self.bwd_tensor_stash[old]

            torch.autograd.variable.Variable._execution_engine.queue_callback(  # type: ignore[attr-defined]
                wait_and_del_remaining_references
            )
            self.is_first_backward_call = False
            self.is_first_forward_call = True
        assert unpack_tensor_id in self.tracker, f"untracked tensor with id {unpack_tensor_id}"
        maybe_gpu_tensor, modified = self.tracker[unpack_tensor_id]
        if modified:
            graph_id = torch._C._current_graph_task_id()
            node = torch._C._current_autograd_node()
            prev_node_ids: list[int] = []
            # l.263-266: on a new autograd node, the previous node's brought-back tensors are freed after it
            if graph_id == self.curr_graph_id and self.curr_autograd_node != node:
                self.curr_autograd_node = node
                prev_node_ids = list(self.bwd_tensor_stash)
            brought_back_from_cpu = True
            storage_refcount = 0
            if unpack_tensor_id in self.fwd_stash:  # l.268-271: still on the device
                maybe_gpu_tensor = self.fwd_stash[unpack_tensor_id]
                brought_back_from_cpu = False
            else:
                # l.272-299: the copy back to the device, kept in the backward stash
                maybe_gpu_tensor = maybe_gpu_tensor.clone()
                self.bwd_tensor_stash[unpack_tensor_id] = maybe_gpu_tensor
                storage_refcount = torch._C._storage_Use_Count(maybe_gpu_tensor.untyped_storage()._cdata)

            def hook(outputs, inputs):  # l.301-340, the node's post hook
                if brought_back_from_cpu:
                    unpacked = self.bwd_tensor_stash[unpack_tensor_id]
                    if torch._C._storage_Use_Count(unpacked.untyped_storage()._cdata) > storage_refcount:
                        # l.314-323: record_stream, then dropped from the stash (alive while referenced)
                        del self.bwd_tensor_stash[unpack_tensor_id]
                    else:
                        self.bwd_ev_stash[unpack_tensor_id] = True  # l.324-326
                for old in list(self.fwd_stash):  # l.328-332: forward's stash emptied in backward
                    del self.fwd_stash[old]
                for old in prev_node_ids:  # l.334-338: the previous node's tensors
                    self.bwd_tensor_stash.pop(old, None)
                return outputs

            node.register_hook(hook)
        del self.tracker[unpack_tensor_id]
        return maybe_gpu_tensor


class NoOpManager(saved_tensors_hooks):
    """torchtune's NoOpManager (l.356-370): saved tensors kept as they are, the innermost
    hooks winning over the offloading ones."""

    def __init__(self) -> None:
        super().__init__(lambda tensor: tensor, lambda tensor: tensor)


def offloading_context(output: nn.Module) -> OffloadActivationsReplica:
    """get_act_offloading_ctx_manager (l.373-446) on a model whose output head is ``output``:
    the replica, with the head's forward run under NoOpManager (its saved tensors stay)."""
    ctx = OffloadActivationsReplica()
    noop = NoOpManager()
    output.register_forward_pre_hook(lambda *args: noop.__enter__())
    output.register_forward_hook(lambda *args: noop.__exit__(), always_call=True)
    return ctx
