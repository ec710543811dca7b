"""The step assembly: one job's training step as the instants where live memory can peak.

A step is walked through the instants where live memory can peak; each instant is a
``Moment`` made of named terms, and the estimate is the largest (``memplan.memory``). Between
these instants memory moves monotonically (activations freed and gradients produced block by
block), so the maximum over the step is at one of them. Which instant wins, and by how much, was
checked against real DDP / FSDP2 steps (``validation/accuracy_matrix.py``, README).

Which terms live at each instant is declared as data (``MOMENTS``): a moment lists groups
of terms by key; each framework adapter (``memplan.frameworks``) fills the groups it owns and
inserts its own moments beside the ones it names (``Framework.schedule``).
"""

from __future__ import annotations

from functools import cached_property
from itertools import chain

from . import loss, moe
from .activations import model_saved
from .breakdown import Component, Moment, Term, term
from .checkpointing import (
    block_kept_under,
    block_transient_under,
    checkpointed,
    num_checkpointed,
    offload_stash_blocks,
    offloaded,
    offloaded_outside,
)
from .errors import MemplanError
from .finetune import (
    PLACES,
    block_place,
    dora_forward_saved,
    kept_in_place,
    outside_saved,
    transient_in_place,
)
from .loss import CCE_AUTOCAST_DROPS, FUSED_DROPS
from .moments import MomentSpec, insert
from .quantities import Quantities
from .saved import GRADIENT_TEMPORARIES, Saved
from .shapes import shapes

# one letter per component, as the paper's P/G/O notation (E741 dislikes the letter O)
P, G, O, A, B = (  # noqa: E741
    Component.PARAMS,
    Component.GRADIENTS,
    Component.OPTIMIZER,
    Component.ACTIVATIONS,
    Component.BUFFERS,
)


def _terms(component: Component, saved: list[Saved], key: str) -> list[Term]:
    """Terms of saved tensors, keyed by their own key or else by the group's."""
    return [term(component, s.key or key, s.name, s.formula, s.bytes) for s in saved]


MOMENTS = (
    MomentSpec(
        name="forward.end",
        phase="forward",
        label="end of forward (cross-entropy)",
        groups=(
            "states",
            "grads.carried",
            "activations.blocks",
            "activations.outside",
            "logits.forward",
            "gathered.forward",
            "loss.forward",
        ),
    ),
    MomentSpec(
        name="backward.start",
        phase="backward",
        label="start of backward (loss gradient)",
        groups=(
            "states",
            "grads.carried",
            "activations.blocks",
            "activations.outside",
            "logits.loss",
            "gathered.loss",
            "loss.backward",
        ),
    ),
    MomentSpec(
        name="block.last",
        phase="backward",
        label="backward of the last block",
        groups=(
            "states",
            "grads.last_block",
            "activations.last_block",
            "logits.block",
            "gathered.last_block",
            "block.backward.last",
        ),
    ),
    MomentSpec(
        name="block.first",
        phase="backward",
        label="backward of the first block",
        groups=(
            "states",
            "grads.first_block",
            "activations.first_block",
            "logits.block",
            "gathered.first_block",
            "block.backward.first",
        ),
    ),
    MomentSpec(
        name="optimizer", phase="optimizer", label="optimizer step", groups=("states", "grads", "optimizer.step")
    ),
)
HEAD_BACKWARD = MomentSpec(
    name="head",
    phase="backward",
    label="backward of the LM head, chunk by chunk",
    groups=("states", "grads.carried", "activations.blocks", "activations.outside", "gathered.head", "loss.head"),
)
"""torchtune's chunked output (the head applied per chunk): every chunk's logit gradient waits
for the head, whose weight gradient autograd sums chunk by chunk out of place (two chunks' and
their sum live at each add; measured: the held-out torchtune FSDP cases, peak in the head's
backward)."""
COMPILED_HEAD_BACKWARD = MomentSpec(
    name="head.compiled",
    phase="backward",
    label="backward of the compiled head and loss",
    groups=("states", "grads.carried", "activations.blocks", "activations.outside", "gathered.head", "loss.head"),
)
"""cut-cross-entropy's torch_compile graph (--loss cce-compile): its backward writes the logit
gradient into the saved logits' buffer (inductor's buffer reuse), then makes the head weight's
gradient (unsharded under FSDP) and the head input's beside it (measured: the allocator's
timeline of the loss alone, and the held-out cce-compile cases)."""
COMPILED_HEAD_UPCAST = MomentSpec(
    name="head.compiled.upcast",
    phase="backward",
    label="backward of the compiled head and loss: fp32 gradients (autocast)",
    groups=("states", "grads.carried", "activations.blocks", "activations.outside", "gathered.head", "loss.upcast"),
)
"""cce-compile under autocast: once the logits' buffer and the head weight's cast are freed, the
graph's fp32 gradients come beside the compute-dtype ones (which take the casts' places): the
head input's and two fp32 V·h (measured, whole step and the loss alone: a second fp32 copy of
the weight's gradient follows the first while the compute-dtype one is still live)."""
LAST_CHECKPOINTED = MomentSpec(
    name="block.last_checkpointed",
    phase="backward",
    label="backward of the last checkpointed block",
    groups=(
        "states",
        "grads.last_checkpointed",
        "activations.last_checkpointed",
        "logits.block",
        "gathered.block",
        "block.backward.last_checkpointed",
    ),
)
"""With ``ac_every`` N > 1 and the last block not checkpointed, the backward of block
⌊L/N⌋·N − 1 (the last checkpointed one) recomputes its forward with blocks 0..it still kept."""
FIRST_BLOCK_END = MomentSpec(
    name="block.first.end",
    phase="backward",
    label="end of the first block's backward",
    groups=("states", "grads.first_block_end", "activations.below_first", "logits.block"),
)
"""One GPU or DDP, the first block checkpointed under full AC: its recompute runs before any of its
own gradients, so the instant of the block's backward (``MOMENTS``' first-block moment) holds the
one weight gradient it makes first beside the recompute (``recompute_first_grads``); all of them
exist only at its end, inside its input norm's backward (``Step.block_end_terms``), once the
recomputed tensors are freed (measured per module with MemTracker, validation.peak_probe: the
head-dim matrix's qwen3 single full-AC case and the tuned DDP full-AC eager record, the MLP output
projection's gradient alone of the block's own at the peak inside its backward)."""


DORA_FORWARD = MomentSpec(
    name="dora.forward",
    phase="forward",
    label="DoRA's weight norm in the last block's forward",
    groups=("states", "grads.carried", "activations.blocks", "activations.pre", "dora.forward"),
)
"""peft's DoRA builds each adapted linear's full weight and its norm in every forward
(``finetune.dora_forward_saved``): in the last block's, beside every block's kept tensors (the
last one's counted whole) and what the embedding keeps (measured: the Phi-3 DoRA case's peak,
validation/records/peft_dora_cpu.md)."""

DORA_RECOMPUTE = MomentSpec(
    name="dora.recompute",
    phase="backward",
    label="DoRA's weight norm in the last block's recompute",
    groups=(
        "states",
        "grads.last_block",
        "activations.last_block",
        "logits.block",
        "gathered.last_block",
        "dora.recompute",
    ),
)
"""Under full AC the last block's backward first runs its forward again, DoRA's temporaries too:
beside what the recompute has rebuilt (the block's saved set, counted whole) and the gradient
arriving from the block's output, before the block's own gradient temporaries (measured: the
llama all-linear DoRA case under transformers' gradient checkpointing, its peak in down_proj's
get_weight_norm inside checkpoint's recompute_fn)."""


TIED_SUM = MomentSpec(
    name="tied_sum",
    phase="backward",
    label="backward of the tied input embedding (its two gradients summed)",
    groups=("states", "grads", "logits.block", "grads.tied_sum"),
)
"""A tied embedding used twice in one graph gets one AccumulateGrad: the head's gradient waits
in its input buffer for the embedding's, and the two are summed out of place (autograd
InputBuffer::add), so the head's, the embedding's and their sum are live at once beside every
other gradient (measured: the fine-tune matrix's qwen2 bf16 full case, three V·h tensors at its
peak; under FSDP ``ROOT_BACKWARD`` holds them)."""


class Step(Quantities):
    """One job's step: the groups of terms its moments are declared from, and its moments
    (``moment_specs``), the framework's inserted beside the ones they name."""

    # -- the groups of terms the moments are declared from ------------------------------
    def groups(self) -> dict[str, list[Term]]:
        states = self.param_terms() + self.optimizer_terms() + self.framework.persistent_buffers(self)
        gathered = {
            f"gathered.{i}": self.framework.gathered(self, i) for i in ("start", "forward", "loss", "head", "block")
        }
        if self.job.model.num_experts:
            gathered["gathered.block"] = moe.without_block_grads(gathered["gathered.block"])
        gathered["gathered.last_block"] = gathered["gathered.block"]
        gathered["gathered.first_block"] = self.framework.first_block_gathered(self, gathered["gathered.block"])
        if self.job.model.arch == "bert":
            # an encoder's FSDP2 peak is at the start of the last block's backward, before any of
            # its gradients (measured per module with MemTracker: roberta-h256-cls3 on 2 gloo
            # ranks, 0.26 MiB of gradients, every block's activations); the unsharded gradients
            # and the reduce-scatter input come as the block frees what it saved
            gathered["gathered.last_block"] = moe.without_block_grads(gathered["gathered.block"])
        groups = {
            "states": states,
            **self.grad_groups(),
            **self.activation_groups(),
            **gathered,
            "optimizer.step": self.step_transient(),
            "loss.head": self.head_backward_terms(),
            "loss.upcast": self.head_upcast_terms(),
        }
        if self.job.train.optimizer_in_backward:
            groups.update(self.in_backward_groups())
        groups.update(self.framework.moment_groups(self, groups))
        if self.ends_first_block():
            groups["activations.below_first"] = self.block_end_terms(0)
        if self.recompute_first_grads():
            groups["activations.first_block"] = groups["activations.first_block"] + self.first_compute_terms()
        if self.tied_sum():
            vh, gbytes = self.vocab_params(), self.train_policy.grad_bytes
            # a gradient already allocated (zero-filled) takes the embedding's own in place
            # (AccumulateGrad: variable_grad += new_grad outside grad mode): no sum
            own = 1 if self.zero_filled() else 2
            what = "own gradient (added in place)" if own == 1 else "own gradient, sum"
            groups["grads.tied_sum"] = [
                term(G, "grads.tied_sum", f"tied embedding: {what}", f"{own}·{gbytes}·V·h", own * gbytes * vh)
            ]
        return groups

    def block_end_terms(self, index: int) -> list[Term]:
        """What block ``index`` holds at the end of its backward, inside its input norm's backward
        (the last op), for Hugging Face's LlamaRMSNorm: what that norm saved (recomputed under AC,
        with the checkpoint's kept block input), the gradient arriving from the block's output, and
        the norm backward's own temporaries, measured alone with MemTracker (LlamaRMSNorm on a
        1×128×512 input, its backward's peak above its start: 18 bytes per element in bf16 and
        fp16, 16 in fp32; the mistral hf-trainer held-out peak holds all of it: 1.78 MiB)."""
        model = self.job.model
        if model.arch != "llama":
            return []
        x = shapes(model, self.job.train)
        t, checkpointed_block = x.tokens, self.kind(index)[0] and self.job.train.activation_checkpointing == "full"
        kept = self.kept(index) if checkpointed_block else []
        norm = [
            Saved("norm 1: fp32 input", "4·b·s·h", 4 * t * x.h),
            Saved("norm 1: normalised", "r·b·s·h", x.r * t * x.h),
            Saved("norm 1: rstd", "4·b·s", 4 * t),
        ]
        temporaries = 16 + (x.r if x.r < 4 else 0)
        return _terms(A, kept, "activations.block_end") + [
            *_terms(A, norm, "block.backward.end"),
            term(A, "block.backward.end", "gradient of the block's output", "r·b·s·h", x.r * t * x.h),
            term(
                A,
                "block.backward.end",
                "input norm's backward temporaries",
                f"{temporaries}·b·s·h",
                temporaries * t * x.h,
            ),
        ]

    def recompute_first_grads(self) -> bool:
        """Whether the first block's backward is ``FIRST_BLOCK_END``'s two instants: the first
        block checkpointed under full AC where ``ends_first_block``."""
        return self.ends_first_block() and self.job.train.activation_checkpointing == "full" and self.kind(0)[0]

    def ends_first_block(self) -> bool:
        """Whether the step has ``FIRST_BLOCK_END``: one GPU or DDP, a full fine-tune of a dense
        decoder, the gradients made in this backward only (no accumulation, none zero-filled, none
        stepped in backward), on the GPU. Without AC the instant exists too, below the first
        block's backward moment but for a block whose saved tensors are smaller than its input
        norm's backward (an MLP narrower than the hidden size): full AC never estimates above no
        AC by more than a checkpoint input (tests/test_invariants.py)."""
        model, train = self.job.model, self.job.train
        return (
            self.framework.has_first_block_end
            and self.P == "P"
            and not model.num_experts
            # GPT-NeoX's parallel attention and MLP peak later, in the attention's backward
            and model.arch in ("llama", "gpt2")
            and train.grad_accum == 1
            and not self.zero_filled()
            and not train.optimizer_in_backward
            and not self.grads_on_host
            and not self.framework.grads_held(self)
        )

    def first_compute_terms(self) -> list[Term]:
        """Beside the first block's recompute at its first weight gradient (``FIRST_BLOCK_END``):
        the gradient arriving from the block's output and the rotary cos/sin tables, the blocks'
        checkpoint inputs until the first block's backward ends (measured per module with
        MemTracker: the tuned DDP full-AC eager record's peak holds r·b·s·h + 2·4·s·d beyond the
        recompute and the MLP output projection's gradient, the head-dim qwen3 case's too)."""
        model, x = self.job.model, shapes(self.job.model, self.job.train)
        pre = model_saved(model, self.job.train, inputs_cast=self.casts_block_inputs)[0]
        rotary = [s for s in pre if s.name.startswith("rotary")]
        return [
            term(A, "block.backward", "gradient of the block's output", "r·b·s·h", x.r * x.tokens * x.h),
            *_terms(A, rotary, "activations.outside"),
        ]

    def tied_sum(self) -> bool:
        """Whether the step has ``TIED_SUM``: a trained tied embedding outside FSDP's root unit."""
        train = self.job.train
        return (
            self.job.model.tied_embeddings
            and self.P == "P"
            and not self.holds_root_grads()
            and not train.optimizer_in_backward
            and not self.grads_on_host
            and self.framework.sums_tied_grads
        )

    def holds_all_grads(self) -> bool:
        """Whether every gradient is live all through the step: accumulated over micro-batches,
        held by the framework, or zero-filled and kept from the step before."""
        return self.job.train.grad_accum > 1 or self.framework.grads_held(self) or self.zero_filled()

    def grad_groups(self) -> dict[str, list[Term]]:
        groups = self._grad_groups()
        if not self.framework.grads_at_step(self):
            groups["grads"] = []
        return groups

    def _grad_groups(self) -> dict[str, list[Term]]:
        model, grads = self.job.model, self.grad_terms()
        if self.holds_all_grads():
            # with accumulation, earlier micro-batches' gradients are live all through the step;
            # zero-filled ones, the previous step's (measured: the zero-grad cases of the matrices)
            # (every backward moment holds them all, the last checkpointed block's under ac-every too)
            held = ("grads.carried", "grads.last_block", "grads.first_block", "grads.last_checkpointed")
            return {"grads": grads, **dict.fromkeys(held, grads)}
        # the input embedding's gradient comes last, after the first block's backward (a tied
        # embedding already has it from the head)
        trained, full = self.trained, self.P == "P"
        pending = self.pending_params() if full else trained.embedding
        own = self.own_block_grads() if full else (trained.blocks[0] if self.framework.block_grads_after_reduce else 0)
        last = self.root_params if full else trained.root
        if model.num_experts and not own:  # a sparse block peaks in its expert loop, before any of
            # its own gradients, and the last one's before the input embedding's (measured, DDP);
            # a fine-tune's first block has only what it trains
            own, last = (self.block_params if full else trained.blocks[0]), last - pending
        if model.arch == "bert":  # an encoder's input embeddings get theirs only after the first
            # block (a tied MLM decoder's V·h has it from the head): the head's alone (measured)
            last -= pending
        what = "params (all but the input embedding" + (" and the first block)" if own else ")")
        before = (self.params if full else trained.trainable) - pending
        groups = {
            "grads": grads,
            "grads.carried": [],
            "grads.last_block": self.grad_share(last, "embedding/head params"),
            "grads.first_block": self.grad_share(before - own, what),
        }
        if self.recompute_first_grads():
            # inside the first block's backward its own gradients are the MLP output projection's
            # alone; at its end (FIRST_BLOCK_END) all of them
            first = self.first_weight_grad()
            groups["grads.first_block"] = self.grad_share(
                before - self.block_params + first,
                "params (all but the input embedding and the first block's, its MLP output projection's made)",
            )
        if self.ends_first_block():
            groups["grads.first_block_end"] = self.grad_share(before, "params (all but the input embedding)")
        j = self.last_checkpointed()
        if j is not None:
            after = model.num_layers - 1 - j
            groups["grads.last_checkpointed"] = self.grad_share(
                trained.root + sum(trained.blocks[j + 1 :]), f"embedding/head params and {after} blocks"
            )
        return groups

    def one_gradient(self, what: str) -> list[Term]:
        """The one gradient alive where each is freed (or moved) as soon as it is made: the largest
        parameter's, at whichever instant it is made."""
        nbytes = 4 if self.shard_master else self.train_policy.grad_bytes
        largest = self.local(self.largest_trained(), self.strategy.shards_grads)
        return [
            term(G, "grads", what, f"{nbytes}·largest tensor{self.div(self.strategy.shards_grads)}", nbytes * largest)
        ]

    def holds_root_grads(self) -> bool:
        """A root unit holds its gradients after the input embedding's backward (FSDP's ``ROOT_BACKWARD``)."""
        return self.framework.holds_root_grads(self)

    def in_backward_groups(self) -> dict[str, list[Term]]:
        """optimizer_in_backward (torchtune's optimizer_in_bwd): each parameter steps in its
        gradient's post-accumulate hook and frees it, so at most one gradient exists (measured on
        CPU: the peak gradients are one largest parameter's, tests/test_loop.py)."""
        if self.job.train.grad_accum > 1:
            raise MemplanError(
                f"optimizer-in-backward steps inside backward: grad-accum {self.job.train.grad_accum} "
                "is refused, as torchtune refuses it; use grad-accum 1"
            )
        pol, largest = self.train_policy, self.local(self.largest_trained(), self.strategy.shards_grads)
        one = self.one_gradient("gradient of the largest parameter (stepped in backward)")
        # one optimizer per parameter (torchtune's OptimizerInBackwardWrapper): a foreach step's
        # sqrt(v) temporary covers that parameter alone, a single-tensor step's two copies of it
        copies = {"foreach": 1, "single": 2}.get(self.job.train.optimizer_impl or "", 0)
        step = (
            [
                term(
                    B,
                    "optimizer.sqrt_temporaries",
                    "sqrt(v) temporaries of the largest parameter",
                    f"{copies}·{pol.state_bytes}·largest tensor",
                    copies * pol.state_bytes * largest,
                )
            ]
            if copies and self.job.train.optimizer in ("adamw", "adam")
            else []
        )
        return {
            "grads": one,
            "grads.carried": [],
            "grads.last_block": one,
            "grads.first_block": one,
            "grads.last_checkpointed": one,
            "optimizer.step": step,
        }

    def activation_groups(self) -> dict[str, list[Term]]:
        model, train, L = self.job.model, self.job.train, self.job.model.num_layers
        loop = train.loop
        if model.arch in ("vit", "bert") and loop.loss != "ce":
            raise MemplanError(
                f"loss {loop.loss} is modelled for decoders' logits and loss, not for {model.name} ({model.arch}, "
                "whose head computes its own cross-entropy); use loss ce"
            )
        pre, post = outside_saved(self, *model_saved(model, train, inputs_cast=self.casts_block_inputs))
        if loop.loss == "fused-linear-ce":
            post = [t for t in post if t.name not in FUSED_DROPS and t.key != "logits"]
        if loop.loss == "cce-compile" and self.policy.autocast:
            post = [t for t in post if t.name not in CCE_AUTOCAST_DROPS]
        outside = _terms(A, pre + post, "activations.outside")
        loss_fwd, loss_bwd = loss.loss_saved(model, train, loop)
        logits = [t for t in outside if t.key == "logits"]
        # the logits term where loss.logits_live holds them (freed: gone once backward starts)
        held = {i: logits if loss.logits_live(model, train, loop, instant=i) else [] for i in loss.INSTANTS}
        blocks = self.block_terms(range(L))
        last = L - 1
        groups = {
            "activations.blocks": blocks,
            "activations.last_block": blocks,
            "activations.first_block": self.block_terms(range(1), first=True),
            "activations.outside": [t for t in outside if t.key != "logits"],
            # WHOLE_HEAD_BACKWARD under autocast: the matmul's backward has freed the weight copy
            "activations.outside_head": [
                t for t in outside if t.key != "logits" and t.name != "autocast head weight copy"
            ],
            **{f"logits.{i}": held[i] for i in loss.INSTANTS},
            "outputs.held": _terms(A, loss.outputs_held(model, train, loop), "outputs.held"),
            "loss.forward": _terms(A, loss_fwd, "loss.forward"),
            "loss.backward": _terms(A, loss_bwd, "loss.backward"),
            "block.backward.last": self.transient_terms(last),
            "block.backward.first": self.transient_terms(0),
        }
        j = self.last_checkpointed()
        if j is not None:
            groups["activations.last_checkpointed"] = self.block_terms(range(j + 1))
            groups["block.backward.last_checkpointed"] = self.transient_terms(j)
        if loop.offload_activations:
            groups.update(self.offload_groups())
        if train.tuning.dora:
            groups["activations.pre"] = _terms(A, pre, "activations.outside")
            groups["dora.forward"] = _terms(A, dora_forward_saved(self), "dora.forward")
        if self.recomputes_dora():
            x = shapes(model, train)
            rebuilt = [t for t in self.transient_terms(last) if t.name != GRADIENT_TEMPORARIES]
            arriving = term(A, "block.backward", "gradient of the block's output", "r·b·s·h", x.r * x.tokens * x.h)
            groups["dora.recompute"] = [*rebuilt, arriving, *groups["dora.forward"]]
        return groups

    def recomputes_dora(self) -> bool:
        """Whether the step has ``DORA_RECOMPUTE``: DoRA, the last block checkpointed under full AC."""
        train, last = self.job.train, self.job.model.num_layers - 1
        return train.tuning.dora and train.activation_checkpointing == "full" and self.kind(last)[0]

    def offload_groups(self) -> dict[str, list[Term]]:
        """torchtune's activation offloading: at the end of forward and the start of backward
        only the stash's blocks are on the GPU, while a block runs its backward its own kept
        activations (torchtune 0.6.1 training/_activation_offloading.py; measured on CPU through
        calibrate.offload, a replica of its memory decisions: its class needs CUDA streams)."""
        kept = self.kept(0)
        stash = offload_stash_blocks(self.job.model, self.job.train.tokens_per_micro_batch)
        formula = " + ".join(s.formula for s in kept)
        on_gpu = [
            term(
                A,
                "activations.blocks.stash",
                f"kept activations of {stash} blocks (offload stash)",
                f"{stash} × ({formula})",
                stash * sum(s.bytes for s in kept),
            )
        ]
        one = [
            term(
                A,
                "activations.blocks.one",
                "kept activations of one block (brought back)",
                formula,
                sum(s.bytes for s in kept),
            )
        ]
        groups = {"activations.blocks": on_gpu, "activations.last_block": one}
        if self.last_checkpointed() is not None:
            # any block's backward, the last checkpointed one's too, brings back its own alone
            groups["activations.last_checkpointed"] = one
        return groups

    def offloaded_activation_terms(self) -> list[Term]:
        """Host RAM per GPU of the offloaded activations: the blocks' and those packed outside them."""
        if not self.job.train.offload_activations:
            return []
        L, moved = self.job.model.num_layers, offloaded(self.kept(0))[1]
        return [
            term(
                A,
                "activations.offloaded",
                f"offloaded activations of {L} blocks (host RAM)",
                f"{L} × ({' + '.join(s.formula for s in moved)})",
                L * sum(s.bytes for s in moved),
            ),
            *_terms(A, offloaded_outside(self.job.model, self.job.train), "activations.offloaded.outside"),
        ]

    def kind(self, index: int) -> tuple[bool, bool, str]:
        """What block ``index``'s activations depend on: whether it is checkpointed, sparse (an
        MoE model's dense layers are its dense view's blocks, ``moe.dense_view``), and its place
        in a fine-tune (``finetune.block_place``)."""
        model = self.job.model
        ac_every = self.job.train.loop.ac_every
        return checkpointed(index, ac_every), moe.is_moe_layer(model, index), block_place(self.trained, index)

    def kept(self, index: int) -> list[Saved]:
        """What block ``index`` keeps: it depends on the index only through its ``kind``."""
        kind = self.kind(index)
        if kind not in self._kept:
            model = self.job.model if kind[1] else moe.dense_view(self.job.model)
            train = self.job.train
            kept = block_kept_under(model, train, train.loop, index, inputs_cast=self.casts_block_inputs)
            kept = moe.ep_kept(kept, model, train, self.ep) if self.ep > 1 else kept
            self._kept[kind] = kept_in_place(kind[2], kept)
        return self._kept[kind]

    def block_terms(self, indices: range, *, first: bool = False) -> list[Term]:
        """The kept activations of these blocks: one term per policy and place they run under."""
        loop = self.job.train.loop
        uniform = loop.ac_every == 1 and moe.all_blocks_alike(self.job.model) and self.P == "P"
        by_policy: dict[tuple[bool, bool, str], list[int]] = {(True, True, ""): list(indices)} if uniform else {}
        for i in indices if not uniform else ():
            by_policy.setdefault(self.kind(i), []).append(i)
        if len(by_policy) == 1:
            kept = self.kept(indices[0])
            formula = " + ".join(s.formula for s in kept)
            n, key = len(indices), "activations.first_block" if first else "activations.blocks"
            name = "kept activations of the first block" if first else f"kept activations of {n} blocks"
            return [term(A, key, name, formula if first else f"{n} × ({formula})", n * sum(s.bytes for s in kept))]
        terms = []
        for (is_checkpointed, sparse, place), members in sorted(
            by_policy.items(), key=lambda kv: (not kv[0][0], not kv[0][1], kv[0][2])
        ):
            kept, n = self.kept(members[0]), len(members)
            policy = f"AC {loop.ac}, every {loop.ac_every}th" if is_checkpointed else "not checkpointed"
            key = f".{'checkpointed' if is_checkpointed else 'plain'}" if loop.ac_every > 1 else ""
            parts = (policy if key else "", "" if sparse else "dense", PLACES[place] if self.P != "P" else "")
            what = ", ".join(w for w in parts if w)
            terms.append(
                term(
                    A,
                    f"activations.blocks{key}{'' if sparse else '.dense'}{place and '.' + place}",
                    f"kept activations of {n} blocks" + (f" ({what})" if what else ""),
                    f"{n} × ({' + '.join(s.formula for s in kept)})",
                    n * sum(s.bytes for s in kept),
                )
            )
        return terms

    def share(self, saved: list[Saved]) -> list[Saved]:
        """This rank's share of saved tensors listed for the whole model: all of them."""
        return saved

    def transient_terms(self, index: int) -> list[Term]:
        """Block ``index``'s backward transient: like ``kept``, one per policy."""
        job, kind = self.job, self.kind(index)
        if kind not in self._transient:
            model = job.model if kind[1] else moe.dense_view(job.model)
            cast = self.casts_block_inputs
            transient = block_transient_under(
                model, job.train, job.train.loop, index, inputs_cast=cast, share=self.share
            )
            if self.ep > 1 and kind[1]:
                transient = moe.ep_kept(transient, model, job.train, self.ep)
                transient += moe.a2a_buffers(model, job.train, self.ep)
            self._transient[kind] = _terms(A, transient_in_place(self, kind[2], transient), "block.backward")
        return self._transient[kind]

    def last_checkpointed(self) -> int | None:
        """Block ⌊L/N⌋·N − 1 where ``ac_every`` N > 1 leaves the last block unchecked (else None)."""
        loop, L = self.job.train.loop, self.job.model.num_layers
        if loop.ac_every == 1 or checkpointed(L - 1, loop.ac_every) or not num_checkpointed(L, loop.ac_every):
            return None
        return num_checkpointed(L, loop.ac_every) * loop.ac_every - 1

    def chunked_head(self) -> bool:
        loop = self.job.train.loop
        return loop.loss == "chunked-ce" and loop.loss_chunks > 1

    def whole_head_backward(self) -> bool:
        """The framework's moment of an LM head applied once (FSDP's ``WHOLE_HEAD_BACKWARD``)."""
        return self.framework.applies_head_once(self)

    def head_backward_terms(self) -> list[Term]:
        """``HEAD_BACKWARD``: the logit gradients (compute dtype) and the head weight's gradient
        summed out of place (the unsharded parameter's dtype); ``WHOLE_HEAD_BACKWARD``: the one
        logit gradient and the head weight's unsharded gradient."""
        m, c = self.job.model, self.policy.compute_bytes
        tokens, vh = self.job.train.tokens_per_micro_batch, m.vocab_size * m.hidden
        wbytes = self.gather_bytes if self.framework.unsharded_head_grads else self.policy.grad_bytes
        if self.job.train.loop.loss == "cce-compile":
            # the b·(s−1) shifted rows' logit gradient in the logits' buffer; the head input's
            # gradient comes once the gathered head input is freed, in its place
            rows = tokens - self.job.train.micro_batch
            unsharded = " (unsharded)" if self.framework.unsharded_head_grads else ""
            if self.policy.autocast:  # the graph's cast: the weight gradient in c first, upcast after
                wbytes, unsharded = c, f"{unsharded} in the compute dtype"
            return [
                term(
                    A, "loss.head", "logit gradient (in the logits' buffer)", f"{c}·b·(s−1)·V", c * rows * m.vocab_size
                ),
                term(G, "loss.head", f"head weight gradient{unsharded}", f"{wbytes}·V·h", wbytes * vh),
            ]
        if self.whole_head_backward() and self.policy.autocast:
            r = shapes(m, self.job.train).r
            return [
                term(G, "loss.head", "head weight gradient in the compute dtype", f"{c}·V·h", c * vh),
                term(G, "loss.head", "head weight gradient cast (unsharded)", f"{wbytes}·V·h", wbytes * vh),
                term(A, "loss.head", "head input gradient", f"{r}·b·s·h", r * tokens * m.hidden),
            ]
        if self.whole_head_backward():
            return [
                term(A, "loss.head", "logit gradient (the head's input)", f"{c}·b·s·V", c * tokens * m.vocab_size),
                term(G, "loss.head", "head weight gradient (unsharded)", f"{wbytes}·V·h", wbytes * vh),
            ]
        if not self.chunked_head():
            return []
        return [
            term(
                A,
                "loss.head",
                "logit gradients of every chunk (wait for the head)",
                f"{c}·b·s·V",
                c * tokens * m.vocab_size,
            ),
            term(G, "loss.head", "head weight gradient: two chunks' and their sum", f"3·{wbytes}·V·h", 3 * wbytes * vh),
        ]

    def head_upcast_terms(self) -> list[Term]:
        """``COMPILED_HEAD_UPCAST``: cce-compile's fp32 gradients under autocast (the compute-dtype
        ones sit where the casts in ``activations.outside`` were)."""
        if self.job.train.loop.loss != "cce-compile" or not self.policy.autocast:
            return []
        m, rows = self.job.model, self.job.train.tokens_per_micro_batch - self.job.train.micro_batch
        return [
            term(A, "loss.upcast", "head input gradient (fp32)", "4·b·(s−1)·h", 4 * rows * m.hidden),
            term(G, "loss.upcast", "head weight gradient (fp32) and its copy", "2·4·V·h", 8 * m.vocab_size * m.hidden),
        ]

    def moment_specs(self) -> tuple[MomentSpec, ...]:
        """``MOMENTS``, with the moments only some steps have beside the ones they name; then
        the framework's own (``Framework.schedule``)."""
        specs: tuple[MomentSpec, ...] = MOMENTS
        if self.ends_first_block():
            specs = insert(specs, FIRST_BLOCK_END, after="block.first")
        if self.last_checkpointed() is not None:
            specs = insert(specs, LAST_CHECKPOINTED, after="block.last")
        if self.chunked_head():
            specs = insert(specs, HEAD_BACKWARD, after="backward.start")
        elif self.job.train.loop.loss == "cce-compile":
            upcast = (COMPILED_HEAD_UPCAST,) if self.policy.autocast else ()
            specs = insert(specs, COMPILED_HEAD_BACKWARD, *upcast, after="backward.start")
        if self.tied_sum():
            specs = insert(specs, TIED_SUM, before="optimizer")
        if self.job.train.tuning.dora:
            specs = insert(specs, DORA_FORWARD, before="forward.end")
        if self.recomputes_dora():
            specs = insert(specs, DORA_RECOMPUTE, before="block.last")
        return self.framework.schedule(self, specs)

    @cached_property
    def built_groups(self) -> dict[str, list[Term]]:
        """``groups()``, built once per step: its estimate and the allocator's trace read the same."""
        return self.groups()

    def moments(self) -> list[Moment]:
        groups = dict(self.built_groups)
        if self.job.train.zero_grad == "after-forward":
            # Lightning's closure clears the gradients between the forward and the backward:
            # the step before's live through the forward (measured: validation.lightning_loop)
            groups["grads.previous"] = groups["grads"]
        group = groups.__getitem__
        return [
            Moment(m.phase, m.label, tuple(chain.from_iterable(map(group, self._groups_of(m)))))
            for m in self.moment_specs()
        ]

    def _groups_of(self, moment: MomentSpec) -> tuple[str, ...]:
        groups = moment.groups
        if self.job.train.logits == "held" and moment.phase in ("forward", "optimizer"):
            # the caller's outputs live through the optimizer step and the next step's forward
            # (measured: validation.outputs_kept)
            groups = (*groups, "outputs.held")
        if moment.phase != "forward" or self.job.train.zero_grad != "after-forward":
            return groups
        return tuple("grads.previous" if g == "grads.carried" else g for g in groups)

    def host_terms(self) -> list[Term]:
        """Host RAM per GPU for what is offloaded."""
        if self.job.plan.offload == "none":
            return self.offloaded_activation_terms()
        on_gpu = Step(self.job.with_(offload="none"))
        terms = on_gpu.optimizer_terms() if self.states_on_host else []
        if self.params_on_host:
            terms += on_gpu.param_terms()
        if self.grads_on_host:
            terms += on_gpu.grad_terms()
        return terms + self.framework.host_buffers(self) + self.offloaded_activation_terms()
