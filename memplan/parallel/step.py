"""One rank of the device mesh as ``step.Step`` sees a job: the data-parallel step of the
rank's share of the model (its pipeline stage's layers, its TP slice of each), with the
micro-batches its pipeline schedule keeps in flight and the pipeline's receive buffers."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import lru_cache

from ..activations import model_saved
from ..breakdown import Component, Estimate, Term, term
from ..checkpointing import checkpointed
from ..layout import MULTI_STAGE
from ..moments import MomentSpec, insert
from ..notes import loop_notes
from ..overheads import overhead_terms
from ..shapes import shapes
from ..specs import Job
from ..step import Step
from . import context, pipeline, tensor
from .pipeline import Stage

A, B = Component.ACTIVATIONS, Component.BUFFERS
RING_BACKWARD = MomentSpec(
    name="cp.ring",
    phase="backward",
    label="ring attention's backward in the last block",
    groups=("states", "grads.ring", "activations.ring", "logits.block", "gathered.ring", "cp.ring"),
)
"""Context parallel: the last block's attention core runs the ring's backward after the block's
MLP and output projection (context.ring_buffers; measured: cp4-fsdp peaks there)."""
_OUTSIDE = ("activations.outside", "loss.forward", "loss.backward", "logits.forward", "logits.loss", "logits.block")


def stage_job(job: Job, stage: Stage) -> Job:
    """The data-parallel job one rank runs: its stage's largest chunk of layers (the unit one
    micro-batch goes through at a time) on the dp GPUs its strategy shards over."""
    layout, cluster = job.layout, job.cluster
    # the CP ranks hold the same parameters: the strategy shards over dp × cp (torchtitan's dp_shard_cp mesh)
    ranks = job.dp * layout.cp
    per_node = max(1, cluster.gpus_per_node // layout.tp)
    dp_cluster = replace(cluster, gpus=ranks, gpus_per_node=math.gcd(ranks, per_node))
    model = replace(job.model, num_layers=max(stage.chunk_layers))
    # context parallel: each rank runs the step on its 1/cp of the sequence (context.py)
    train = replace(job.train, seq_len=job.train.seq_len // layout.cp) if layout.cp > 1 else job.train
    return Job(model=model, train=train, cluster=dp_cluster, plan=job.plan)


class RankStep(Step):
    """``Step`` on one rank: parameters counted per TP slice and stage, saved tensors sharded
    (``tensor.shard_saved``), the stage's earlier micro-batches in flight, its receive buffers."""

    def __init__(self, job: Job, stage: Stage):
        super().__init__(stage_job(job, stage))
        self.layout, self.stage, self.whole = job.layout, stage, job
        self._sharded: dict[bool, list] = {}
        model, tp, vocab_tp = job.model, job.layout.tp, job.layout.vocab_tp
        self.block_params = tensor.block_params(model, tp)
        self.root_params = (tensor.embedding_params(model, vocab_tp) if stage.first else 0) + (
            tensor.head_params(model, vocab_tp) if stage.last else 0
        )
        self.params = stage.layers * self.block_params + self.root_params

    def whole_head_backward(self) -> bool:
        """The whole-head moment is measured under data parallelism only; a TP rank's head is
        vocabulary-parallel (its own moments, not measured with that moment)."""
        return False

    def pending_params(self) -> int:
        return tensor.embedding_params(self.whole.model, self.layout.vocab_tp) if self.stage.first else 0

    def vocab_params(self) -> int:
        """A TP rank's local shard of the vocabulary-parallel embedding or head: FSDP2 over the dp
        mesh gathers, reduces and holds the DTensor's local tensor (V/tp rows; torchtitan's
        apply_tp: RowwiseParallel embedding, ColwiseParallel head, both Shard(0) of the weight);
        the whole V·h under the blocks plan, which leaves them plain modules (``Layout.vocab_tp``)."""
        m = self.whole.model
        return m.vocab_size * m.hidden // self.layout.vocab_tp

    def embedding_unit_params(self) -> int:
        """The first stage's input embedding unit (a tied embedding joins the head's unit only
        on a stage holding the head too)."""
        if not self.stage.first or (self.whole.model.tied_embeddings and self.stage.last):
            return 0
        return self.vocab_params()

    def head_unit_params(self) -> int:
        """The last stage's [final norm, lm head] unit (none on another stage)."""
        if not self.stage.last:
            return 0
        m = self.whole.model
        tied = m.tied_embeddings and self.stage.first
        return tensor.head_params(m, self.layout.vocab_tp) + (self.vocab_params() if tied else 0)

    def head_weight_params(self) -> int:
        return super().head_weight_params() if self.stage.last else 0

    def own_block_grads(self) -> int:
        # a stage of few blocks peaks inside its first micro-batch's backward, when the block's own
        # gradients are mostly still to come (measured: pp4-1f1b-m4, one block per stage, holds
        # only the down projection's gradient at its peak)
        return self.block_params

    def largest_param(self) -> int:
        m, tp = self.whole.model, self.layout.tp
        vocab = m.vocab_size * m.hidden // self.layout.vocab_tp if self.stage.first or self.stage.last else 0
        return max(vocab, m.hidden * m.ffn_hidden // tp, m.hidden * m.hidden // tp)

    def kept(self, index: int):
        policy = checkpointed(index, self.job.train.loop.ac_every)
        if policy not in self._sharded:
            kept = super().kept(index)
            kept = kept + context.merged_output(kept, self.job.model, self.job.train, self.layout)
            if policy and self.job.train.loop.ac == "op":
                kept = kept + tensor.op_sac_reduce_scatters(self.job.model, self.job.train, self.layout)
            self._sharded[policy] = tensor.shard_saved(kept, self.layout)
        return self._sharded[policy]

    def share(self, saved):
        return tensor.shard_saved(saved, self.layout)

    def transient_terms(self, index: int) -> list[Term]:
        terms = tensor.shard_saved(super().transient_terms(index), self.layout)
        if self.sends():
            # a stage's backward starts from the received output gradient (its buffer) and makes
            # the gradient of its last block's input beside it (measured: one more b·s·h at the peak)
            terms = terms + [
                term(A, "pipeline.grad_in", "gradient through the stage's blocks", "r·b·s·h", self.stream_bytes())
            ]
        return terms

    def sends(self) -> bool:
        """Whether some chunk of this rank sends its output on (all but the last stage)."""
        return not self.stage.last or self.layout.pp_virtual > 1

    def stream_bytes(self) -> int:
        """One micro-batch's residual stream on this rank: what a stage sends and receives."""
        x = shapes(self.job.model, self.job.train)
        return x.r * x.tokens * x.h // (self.layout.tp if self.layout.sp else 1)

    def block_terms(self, indices: range, *, first: bool = False) -> list[Term]:
        terms = super().block_terms(indices, first=first)
        stage, one = self.stage, self.job.model.num_layers
        others = stage.in_flight_layers - one
        if others > 0:
            per_block = sum(s.bytes for s in self.kept(0))
            terms.append(
                term(
                    A,
                    "pipeline.in_flight",
                    f"kept activations of {others} blocks of earlier micro-batches in flight",
                    f"{others} × (kept per block)",
                    others * per_block,
                )
            )
        tables = self.rotary_tables(stage.in_flight - stage.first)
        terms += [tables] if tables.bytes else []
        sends = stage.in_flight - (stage.losses_in_flight if stage.last else 0)
        if sends > 0:
            # the stage's output stays in fwd_cache until its backward (stage.py forward_one_chunk)
            terms.append(
                term(
                    A,
                    "pipeline.outputs",
                    f"stage outputs of {sends} micro-batches (kept for backward)",
                    f"{sends}·r·b·s·h",
                    sends * self.stream_bytes(),
                )
            )
        return terms + self.unwaited_sends()

    def unwaited_sends(self) -> list[Term]:
        """The multi-stage runtime (``_PipelineScheduleRuntime._step_microbatches``) waits for its
        sends only at the end of the step, so every output and input gradient sent so far stays
        alive: at the last steady-state step, the outputs of all forwards but those in flight and
        the input gradients of the backwards done by the rank's non-first chunks."""
        layout, stage = self.layout, self.stage
        if layout.pp_schedule not in MULTI_STAGE:
            return []
        m, v = layout.microbatches, layout.pp_virtual
        outputs = max(0, m * (v - stage.last) - stage.in_flight)
        grads = (m * v - stage.in_flight) * (v - stage.first) // v
        count = outputs + grads
        return [
            term(
                A,
                "pipeline.unwaited_sends",
                f"{count} sent tensors not yet waited for",
                f"{count}·r·b·s·h",
                count * self.stream_bytes(),
            )
        ]

    def rotary_tables(self, chunks: int) -> Term:
        """The reference model builds its rotary tables in every stage's forward, and each
        micro-batch in flight keeps them (the first stage's first are ``model_saved``'s)."""
        pre = model_saved(self.job.model, self.job.train)[0]
        one = sum(s.bytes for s in pre if s.name.startswith("rotary"))
        return term(
            A, "pipeline.rotary", f"rotary tables of {chunks} chunks in flight", f"{chunks}·2·4·s·d", chunks * one
        )

    def other_losses(self) -> list[Term]:
        """GPipe's last stage: the logits and loss of the micro-batches whose backward has not begun."""
        others = self.stage.losses_in_flight - 1
        if not self.stage.last or others < 1:
            return []
        x = shapes(self.job.model, self.job.train)
        # the logits in fwd_cache and the loss's log_softmax output, per micro-batch, 1/tp with loss parallel
        per = (x.c + 4) * x.tokens * x.V // self.layout.logits_tp
        return [
            term(
                A,
                "pipeline.losses",
                f"logits and log_softmax of {others} micro-batches",
                f"{others}·(c + 4)·b·s·V",
                others * per,
            )
        ]

    def grad_groups(self) -> dict[str, list[Term]]:
        groups = super().grad_groups()
        grads = self.grad_terms() + self.whole_embedding_grad()
        if not self.stage.carries_grads and not self.holds_all_grads():
            # in the last block's backward only the head's gradients exist: none on a stage without it
            # (zero-filled ones, the step before's, are all there: measured, the 405B FSDP 64 × TP 8
            # trace, validation/records/trace_fullsize.md, −6.8 % without them)
            head = self.grad_share(self.root_params - self.pending_params(), "head params")
            return {**groups, "grads": grads, "grads.last_block": head}
        return {key: grads if key.startswith("grads") else value for key, value in groups.items()}

    def whole_embedding_grad(self) -> list[Term]:
        """The vocabulary-parallel embedding's gradient is made whole on every TP rank (measured on
        the TP × PP cases of the matrix: one V·h gradient on the first stage where 1/tp of it was
        expected); without data parallel to reduce-scatter it, it stays so until the step. Not
        under FSDP2 without a pipeline: torchtitan wraps the TP model over a dp mesh of one too
        (llama3/parallelize.py l.69), whose reduce-scatter leaves the 1/tp shard (measured: TP 8
        alone on an H100, validation/records/gpu_trace_check_h100.md, +15.7 % with the whole one)."""
        m, tp = self.whole.model, self.layout.tp
        if self.layout.vocab_tp == 1 or not self.stage.first or self.whole.dp > 1:
            return []
        if self.framework.id == "fsdp" and self.layout.pp == 1:
            return []
        extra = m.vocab_size * m.hidden * (tp - 1) // tp
        nbytes = self.policy.grad_bytes
        return [
            term(
                Component.GRADIENTS,
                "grads",
                "embedding gradient, whole on each TP rank",
                f"{nbytes}·V·h·(tp−1)/tp",
                nbytes * extra,
            )
        ]

    def activation_groups(self) -> dict[str, list[Term]]:
        groups = super().activation_groups()
        pre, _post = model_saved(self.job.model, self.job.train)
        before = {s.name for s in pre}
        # held outputs: the logits on the last stage; the KV cache of the stage's own blocks (its
        # job's layers), each rank's local heads and 1/cp of the sequence (modelled as the blocks'
        # saved k and v are; measured on data-parallel jobs only: validation.outputs_kept)
        cache = [t for t in groups["outputs.held"] if t.name.startswith("KV cache")]
        logits = [t for t in groups["outputs.held"] if t not in cache] if self.stage.last else []
        groups["outputs.held"] = tensor.shard_saved(logits + cache, self.layout)
        for key in groups:
            if key in _OUTSIDE or key.startswith("logits."):
                kept = [t for t in groups[key] if (self.stage.first if t.name in before else self.stage.last)]
                groups[key] = tensor.shard_saved(kept, self.layout)
        groups["loss.backward"] = tensor.loss_parallel_backward(groups["loss.backward"], self.layout)
        for key in ("activations.blocks", "activations.last_block"):
            groups[key] = groups[key] + self.other_losses()
        return groups

    def groups(self) -> dict[str, list[Term]]:
        groups = super().groups()
        groups["states"] = groups["states"] + self.receive_buffers()
        # Under a layout the loss is computed outside the model (loss parallel on the vocabulary
        # shards, the pipeline schedule's loss_fn, CP's sharded labels: torchtitan's loop), so
        # FSDP2's root runs its pre-backward hook on the logits' gradient, after the loss's
        # backward, and no last block is prefetched at the loss (frameworks/fsdp.py; measured:
        # dp2-tp2-fsdp holds none at its peak, the start of backward; so does cp2-fsdp's rank 1, byte
        # for byte the FSDP job on its 1/cp sequence without CP)
        groups["gathered.loss"] = [t for t in groups["gathered.loss"] if t.key != "fsdp.prefetched_block"]
        if self.pipelined_fsdp():
            groups.update(self.pipelined_fsdp_groups(groups))
        if self.layout.cp > 1:
            groups["cp.ring"] = context.ring_buffers(self.job.model, self.job.train, self.layout)
            groups["activations.ring"] = self.ring_activations()
            groups["grads.ring"] = self.ring_grads()
            groups["gathered.ring"] = [self._ring_grads(t) for t in groups["gathered.block"]]
        return groups

    def pipelined_fsdp(self) -> bool:
        """FSDP2 sharding over data parallel under a pipeline schedule."""
        return self.layout.pp > 1 and self.framework.id == "fsdp" and self.gather_group > 1

    def pipelined_fsdp_groups(self, groups: dict[str, list[Term]]) -> dict[str, list[Term]]:
        """What FSDP2 holds under pipelining (torch 2.13 stage.py ``backward_maybe_with_nosync``):
        every micro-batch's backward runs with ``set_requires_gradient_sync(False)`` and
        ``set_reshard_after_backward(False)``, so each unit's gradients accumulate unsharded on
        its unsharded parameter (_fsdp_param_group.py ``post_backward``: no reduce-scatter, no
        reduce-scatter input) and a unit stays gathered after its backward until the next forward
        reshards it (``post_forward``); only ``perform_reduce_grad``, after the last backward,
        reduce-scatters them. After a stage's first backward its whole unsharded gradients are
        live through every later forward and backward (measured per pipeline action with
        validation.pipeline_probe, FSDP's own state, validation/records/parallel_fsdp_pp_probe.md: on
        dp2-pp2-fsdp-m4 both stages hold 4·P of unsharded gradients and no sharded ones after
        every backward, every unit gathered after a backward and only the root after a forward;
        rank 0's second backward peaks 7.4 MiB above its first)."""
        g, r, bp, stage = self.gather_bytes, self.reduce_bytes, self.block_params, self.stage
        pending = self.pending_params()

        def unsharded(count: int, what: str) -> Term:
            # accumulated in the reduce dtype when it is not the parameters' (_fsdp_param.py
            # to_accumulated_grad_if_needed), else on the unsharded parameter's own .grad
            return term(
                Component.GRADIENTS,
                "fsdp.pipeline_grads",
                f"unsharded gradients of {what}",
                f"{r}·{count:,}",
                r * count,
            )

        whole = unsharded(self.params, "the stage (reduced after its last backward)")

        def made(count: int, what: str) -> list[Term]:
            # in the stage's first backward only those made so far; after it, all of them
            return [whole] if stage.carries_grads else [unsharded(count, what)]

        out = {
            "grads.carried": [whole] if stage.carries_grads else [],
            "grads.last_block": made(self.root_params - pending, "the head"),
            "grads.first_block": made(self.params - pending - bp, "all but the input embedding and the first block"),
            # the end of a backward, at the input embedding: every block's (the root unit's apart)
            "grads.blocks": [unsharded(self.params - self.root_params, "the blocks")],
        }
        # the block's own gradients as autograd makes them: apart from the accumulated ones in
        # the first backward, or when those are accumulated in another dtype (added into them)
        own = (
            [term(B, "fsdp.block_grads", "unsharded block gradients (no reduce-scatter)", f"{g}·block params", g * bp)]
            if not stage.carries_grads or r != g
            else []
        )
        # units stay gathered after their backward (no reshard after backward) until their next
        # forward: every block of the stage at the first block's backward and at the input embedding's
        every = term(
            B,
            "fsdp.block",
            f"unsharded {stage.layers} blocks (no reshard after backward)",
            f"{g}·{stage.layers}·block params",
            g * stage.layers * bp,
        )
        for key in ("gathered.block", "gathered.last_block", "gathered.first_block", "gathered.root"):
            if key not in groups:
                continue
            kept = [t for t in groups[key] if t.key not in ("fsdp.block_grads", "fsdp.retained_reduce_input")]
            if key == "gathered.first_block":
                kept = [every if t.key == "fsdp.block" else t for t in kept]
            if key == "gathered.root":
                kept = [*kept, every]
            out[key] = kept + (own if key != "gathered.root" else [])
        if stage.carries_grads:
            # a forward after a backward starts with the stage's blocks still gathered
            out["gathered.start"] = [*groups["gathered.start"], every]
        if "grads.root_unsharded" in groups:
            out["grads.root_unsharded"] = [
                t for t in groups["grads.root_unsharded"] if t.key != "fsdp.retained_reduce_input"
            ]
        return out

    def ring_grads(self) -> list[Term]:
        """The gradients held while the last block's ring runs: under FSDP2 with the root unit
        kept (embeddings and head in the root), the head's whole, unsharded gradient, reduced only
        at the root's post-backward (frameworks.fsdp.root_grad_groups; measured: cp4-fsdp holds the V·h
        head gradient at the ring's peak); otherwise the last block's share."""
        if not (self.holds_root_grads() and self.fsdp_units == "root-kept" and self.stage.last and self.P == "P"):
            return self.grad_groups()["grads.last_block"]
        n = tensor.head_params(self.whole.model, self.layout.vocab_tp)
        what = "unsharded head gradient (reduced at the root's post-backward)"
        return [term(Component.GRADIENTS, "fsdp.root_grads", what, f"{self.gather_bytes}·{n:,}", self.gather_bytes * n)]

    def ring_activations(self) -> list[Term]:
        """While the last block's attention core runs the ring's backward: every other block's kept
        tensors, the last block's still held (``context.kept_before_core``), and the gradient of
        the residual stream waiting at the block's input."""
        last = self.job.model.num_layers - 1
        terms = self.block_terms(range(last)) if last else []
        held = context.kept_before_core(self.kept(last))
        x = shapes(self.job.model, self.job.train)
        stream = x.c * x.tokens * x.h // (self.layout.tp if self.layout.sp else 1)
        return terms + [
            term(
                A,
                "activations.last_block",
                "kept activations of the last block before its attention core",
                " + ".join(s.formula for s in held),
                sum(s.bytes for s in held),
            ),
            term(A, "cp.stream_grad", "gradient of the residual stream at the last block", "c·b·(s/cp)·h", stream),
        ]

    def _ring_grads(self, t: Term) -> Term:
        """FSDP's unsharded block gradients while the attention core runs its backward: those of
        the parameters after it (``context.grads_after_core``), no reduce-scatter input yet."""
        if t.key != "fsdp.block_grads":
            return t
        n = context.grads_after_core(self.job.model, self.layout.tp)
        name = "unsharded gradients of the block's output projection, norm and MLP"
        return replace(t, name=name, formula=f"{self.gather_bytes}·{n:,} params", bytes=self.gather_bytes * n)

    def moment_specs(self):
        specs = super().moment_specs()
        return insert(specs, RING_BACKWARD, after="optimizer") if self.layout.cp > 1 else specs

    def receive_buffers(self) -> list[Term]:
        """stage.py allocates, per micro-batch, an activation buffer for every stage but the
        first and a gradient buffer for every stage but the last, for the whole step."""
        if self.layout.pp == 1:
            return []
        v, m = self.layout.pp_virtual, self.layout.microbatches
        buffers = 2 * v - self.stage.first - self.stage.last
        return [
            term(
                B,
                "pipeline.receive_buffers",
                f"receive buffers of {buffers} stage ends × {m} micro-batches",
                f"{buffers}·{m}·r·b·s·h",
                buffers * m * self.stream_bytes(),
            )
        ]


@dataclass(frozen=True)
class LayoutEstimate(Estimate):
    """The estimate of the worst pipeline rank, with every rank's beside it."""

    stages: tuple[Estimate, ...] = ()
    worst_stage: int = 0


def layout_notes(layout) -> tuple[str, ...]:
    """What the layout's estimate models without a measurement behind it."""
    notes: tuple[str, ...] = (context.NOTE,) if layout.cp > 1 else ()
    notes += (tensor.ASYNC_TP_NOTE,) if layout.async_tp else ()
    if layout.pp > 1 and layout.pp_schedule == "zero-bubble":
        notes += (
            "the zero-bubble schedule's micro-batches in flight are modelled from torch's schedule, not measured",
        )
    return notes


@lru_cache(maxsize=4096)
def rank_step(job: Job, stage: Stage) -> RankStep:
    """One pipeline rank's step, built once: its estimate and the allocator's trace of it
    (``alloctrace``) read the same groups of terms."""
    return RankStep(job, stage)


@lru_cache(maxsize=4096)
def _rank_estimate(job: Job, stage: Stage) -> Estimate:
    """One pipeline rank's estimate; cached: the layout search weighs the worst ranks
    (``worst_estimate``), then the bound and the replay read every rank (``estimate_layout``)."""
    step = rank_step(job, stage)
    moments = step.moments()
    peak = max(moments, key=lambda m: m.allocated_bytes)
    return Estimate(
        job=job,
        peak=peak,
        moments=tuple(moments),
        overhead=tuple(overhead_terms(job, peak)),
        host_bytes=sum(t.bytes for t in step.host_terms()),
        notes=loop_notes(job) + layout_notes(job.layout),
    )


def estimate_layout(job: Job) -> LayoutEstimate:
    """Every pipeline rank's estimate; the result is the worst (the peak across the mesh)."""
    ranks = tuple(_rank_estimate(job, s) for s in pipeline.stages(job.layout, job.model.num_layers))
    return _worst_of(job, ranks)


def worst_candidates(job: Job) -> Iterator[Estimate]:
    """The ranks one of which is the worst, estimated as they are read (the layout search stops
    at the first that does not fit): among ranks 1 … pp−2 (no embedding, no head) rank 1 holds
    the most, as it has the most micro-batches in flight under every schedule and the earliest
    stages take the layers left over (``pipeline.split_layers``); so the worst is rank 0, rank 1
    or the last (tests/test_parallel.py checks it against ``estimate_layout``)."""
    stages = pipeline.stages(job.layout, job.model.num_layers)
    for i in sorted({0, min(1, len(stages) - 1), len(stages) - 1}):
        yield _rank_estimate(job, stages[i])


def _worst_of(job: Job, ranks: tuple[Estimate, ...]) -> LayoutEstimate:
    worst = max(range(len(ranks)), key=lambda i: ranks[i].allocated_bytes)
    w = ranks[worst]
    return LayoutEstimate(
        job=job,
        peak=w.peak,
        moments=w.moments,
        overhead=w.overhead,
        host_bytes=w.host_bytes,
        notes=w.notes,
        stages=ranks,
        worst_stage=worst,
    )
