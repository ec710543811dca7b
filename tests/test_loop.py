"""The loop's conventions: validation, recipes, and the loss / checkpointing models
measured against the frameworks' own code on CPU (MemTracker, saved-tensor hooks)."""

import importlib.util
import pathlib

import pytest

from memplan.checkpointing import checkpointed, compiled_block_saved, num_checkpointed, op_sac_kept
from memplan.errors import MemplanError
from memplan.loop import _SETTINGS, RECIPES, Loop, recipe_rows, resolve
from memplan.loss import logits_live, loss_saved
from memplan.specs import ModelSpec, TrainSpec


@pytest.mark.parametrize(
    "field,value",
    [
        ("logits", "dropped"),
        ("loss", "liger"),
        ("ac", "layer"),
        ("recipe", "megatron"),
        ("loss_chunks", 0),
        ("ac_every", -1),
        ("compile", "yes"),
        ("offload_activations", 1),
    ],
)
def test_bad_loop_setting_is_one_line_error_naming_it(field, value):
    with pytest.raises(MemplanError) as err:
        Loop(**{field: value})
    message = str(err.value)
    assert "\n" not in message and field in message and repr(value) in message


def test_ac_every_needs_a_policy():
    with pytest.raises(MemplanError, match="ac-every 2 needs an AC policy"):
        Loop(ac_every=2)


def test_every_recipe_sets_every_setting_with_a_source():
    rows = recipe_rows()
    for recipe in RECIPES:
        assert all(rows[recipe][s][1] for s in _SETTINGS), recipe
        assert resolve(recipe).loop.recipe == recipe


def test_explicit_flags_win_and_say_so():
    resolved = resolve("torchtitan", ac="full", logits=None)
    assert (resolved.loop.ac, resolved.loop.logits) == ("full", "freed")
    origins = {c.setting: c.origin for c in resolved.conventions}
    assert origins["ac"] == "given" and origins["logits"] == "recipe torchtitan"
    assert resolved.describe().startswith("recipe torchtitan: logits freed, loss ce")
    assert resolved.describe().endswith("given: ac full")


def test_a_searched_setting_is_labelled_searched_not_explicit():
    from click.testing import CliRunner

    from memplan.cli import main

    args = ["recommend", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-sxm", "--seq-len", "8192"]
    searched = CliRunner().invoke(main, [*args, "--recipe", "torchtitan"]).output.splitlines()[2]
    given = CliRunner().invoke(main, [*args, "--recipe", "torchtitan", "--ac", "full"]).output.splitlines()[2]
    assert searched.endswith("searched: ac full") and given.endswith("given: ac full")


def test_recipe_defaults_as_the_frameworks_define_them():
    assert (resolve("torchtitan").loop.ac, resolve("torchtune").loop.loss) == ("op", "chunked-ce")
    assert [r for r in RECIPES if resolve(r).loop.logits == "kept"] == ["plain", "accelerate"]


def test_unknown_setting_or_recipe_is_refused():
    with pytest.raises(MemplanError, match="loop setting 'checkpoint'"):
        resolve("plain", checkpoint="full")
    with pytest.raises(MemplanError, match="recipe 'nemo'"):
        resolve("nemo")


def test_layer_sac_checkpoints_every_nth_block_counting_from_one():
    assert [i for i in range(7) if checkpointed(i, 3)] == [2, 5]
    assert num_checkpointed(7, 3) == 2 and num_checkpointed(4, 1) == 4


# -- measured against the real implementations ---------------------------------------------
torch = pytest.importorskip("torch")


def _model(arch="llama", kv=8, vocab=512):
    return ModelSpec(
        arch=arch,
        num_layers=1,
        hidden=128,
        num_heads=8,
        num_kv_heads=kv,
        ffn_hidden=344,
        vocab_size=vocab,
        linear_bias=arch != "llama",
    )


def _dtype(precision):
    return torch.bfloat16 if precision == "bf16" else torch.float32


class _Live:
    """MemTracker's live CPU bytes beyond what existed on entry (the tracked externals),
    and their peak since ``mark``."""

    def __init__(self, *external):
        from torch.distributed._tools.mem_tracker import MemTracker

        self.tracker, self.cpu = MemTracker(), torch.device("cpu")
        self.tracker.track_external(*external)

    def __enter__(self):
        self.tracker.__enter__()
        self.base = self.current()
        self.mark()
        return self

    def __exit__(self, *exc):
        self.tracker.__exit__(*exc)

    def current(self) -> int:
        return self.tracker.get_tracker_snapshot("current")[self.cpu]["Total"]

    def mark(self):
        self.tracker._peak_mem = {self.cpu: self.current()}

    def peak(self) -> int:
        return self.tracker._peak_mem[self.cpu] - self.base


def _torchtune_chunked_loss():
    """torchtune's own CEWithChunkedOutputLoss, loaded from its file: the package's
    __init__ needs a torchao that has nf4tensor, which this environment's lacks."""
    spec = importlib.util.find_spec("torchtune")
    if spec is None:
        pytest.skip("torchtune is not installed")
    path = pathlib.Path(spec.origin).parent / "modules" / "loss" / "ce_chunked_output_loss.py"
    module_spec = importlib.util.spec_from_file_location("_torchtune_ce_chunked", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.CEWithChunkedOutputLoss


def _logits(model, train, loop):
    """The head's output as torchtune's model returns it: one tensor, or one per chunk."""
    dtype = _dtype(train.precision)
    hidden = torch.randn(train.micro_batch, train.seq_len, model.hidden, dtype=dtype, requires_grad=True)
    head = torch.nn.Linear(model.hidden, model.vocab_size, bias=False).to(dtype).requires_grad_(False)
    parts = hidden.chunk(loop.loss_chunks, dim=1) if loop.loss == "chunked-ce" else [hidden]
    return hidden, head, [head(p) for p in parts]


def _loss(model, loop, logits, labels):
    if loop.loss == "chunked-ce":
        return _torchtune_chunked_loss()(num_output_chunks=loop.loss_chunks)(logits, labels)
    # transformers' ForCausalLMLoss: cross-entropy on the logits upcast to fp32
    return torch.nn.functional.cross_entropy(logits[0].float().view(-1, model.vocab_size), labels.view(-1))


LOSS_CASES = [
    (loss, chunks, precision, b)
    for loss, chunks in (("ce", 1), ("chunked-ce", 8), ("chunked-ce", 3), ("chunked-ce", 5))
    for precision in ("fp32", "bf16")
    for b in (1, 2)
]
# the loss's scalars (one per chunk, the token count, the gradient seed) are not modelled
SCALAR_SLACK_BYTES = 64


@pytest.mark.parametrize("loss,chunks,precision,b", LOSS_CASES)
def test_loss_bytes_match_memtracker(loss, chunks, precision, b):
    model, loop = _model(), Loop(loss=loss, loss_chunks=chunks)
    train = TrainSpec(seq_len=64, micro_batch=b, precision=precision, device="cpu")
    forward, backward = loss_saved(model, train, loop)
    torch.manual_seed(0)
    hidden, head, logits = _logits(model, train, loop)
    labels = torch.randint(0, model.vocab_size, (b, train.seq_len))
    with _Live(hidden, head, labels, *logits) as live:
        out = _loss(model, loop, logits, labels)
        measured_forward = live.peak()
        live.mark()
        out.backward()
        measured_backward = live.peak()
    assert 0 <= measured_forward - sum(s.bytes for s in forward) <= SCALAR_SLACK_BYTES
    assert 0 <= measured_backward - sum(s.bytes for s in backward) <= SCALAR_SLACK_BYTES


@pytest.mark.parametrize("loss", ["ce", "chunked-ce"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_freed_logits_are_gone_when_the_caller_drops_them(loss, precision):
    """What `del logits` (torchtitan, torchtune) frees before backward: the whole logits
    tensor, because nothing autograd saved refers to it."""
    model, train = _model(), TrainSpec(seq_len=64, micro_batch=2, precision=precision, device="cpu")
    kept, freed = (Loop(loss=loss, logits=held) for held in ("kept", "freed"))
    expected = sum(s.bytes for s in logits_live(model, train, kept, instant="loss")) - sum(
        s.bytes for s in logits_live(model, train, freed, instant="loss")
    )
    labels = torch.randint(0, model.vocab_size, (2, train.seq_len))
    hidden, head, _ = _logits(model, train, kept)
    with _Live(hidden, head, labels) as live:
        parts = hidden.chunk(kept.loss_chunks, dim=1) if loss == "chunked-ce" else [hidden]
        logits = [torch.nn.functional.linear(p, head.weight) for p in parts]  # the head, untracked as a module
        out = _loss(model, kept, logits, labels)
        before = live.current()
        del logits
        assert before - live.current() == expected
        out.backward()


@pytest.mark.parametrize("logits", ["kept", "freed"])
def test_torchtune_model_upcasts_its_logits_before_the_loss(logits):
    """torchtune's TransformerDecoder returns ``self.output(h).float()`` (modules/transformer.py
    l.659) and its single-device recipe applies torch.nn.CrossEntropyLoss to it, then ``del
    logits`` (freed): the caller's logits are fp32, the loss upcasts nothing, and the
    compute-dtype logits are gone once cast. The end of forward and the start of backward as
    ``by_moment`` counts them for the torchtune recipe, against MemTracker on that step."""
    from memplan.loss import by_moment

    model = _model()
    train = TrainSpec(
        seq_len=64, micro_batch=2, precision="bf16", device="cpu", recipe="torchtune", loss="ce", logits=logits
    )
    moments = by_moment(model, train, train.loop)
    torch.manual_seed(0)
    hidden, head, _ = _logits(model, train, Loop())
    labels = torch.randint(0, model.vocab_size, (train.micro_batch * train.seq_len,))
    with _Live(hidden, head, labels) as live:
        out = torch.nn.functional.linear(hidden, head.weight).float()  # TransformerDecoder.forward
        loss = torch.nn.CrossEntropyLoss()(out.reshape(-1, model.vocab_size), labels)
        measured_forward = live.peak()
        if logits == "freed":
            del out
        live.mark()
        loss.backward()
        measured_backward = live.peak()
    assert 0 <= measured_forward - sum(s.bytes for s in moments["forward"]) <= SCALAR_SLACK_BYTES
    assert 0 <= measured_backward - sum(s.bytes for s in moments["loss"]) <= SCALAR_SLACK_BYTES


def test_fused_linear_ce_has_no_logits_tensor():
    model, train = _model(vocab=32000), TrainSpec(seq_len=512, micro_batch=2, precision="bf16", device="cpu")
    fused, ce = Loop(loss="fused-linear-ce"), Loop()
    assert logits_live(model, train, fused, instant="forward") == []
    t_v = train.micro_batch * train.seq_len * model.vocab_size
    assert all(s.bytes < t_v for part in loss_saved(model, train, fused) for s in part)
    at_backward = [sum(s.bytes for s in loss_saved(model, train, loop)[1]) for loop in (fused, ce)]
    assert at_backward[0] < at_backward[1]


def test_cce_compile_keeps_its_logits_and_its_row_statistics():
    """cut-cross-entropy's torch_compile graph over the b·(s−1) shifted rows: the logits (the
    model's logits term, compute dtype) at the end of forward and the start of backward, gone by
    the blocks' backward; fp32 max and log-sum-exp and int64 targets and indices per row."""
    model, train = _model(vocab=32000), TrainSpec(seq_len=512, micro_batch=2, precision="bf16", device="cpu")
    loop, rows = Loop(loss="cce-compile"), 2 * 511
    assert [bool(logits_live(model, train, loop, instant=i)) for i in ("forward", "loss", "block")] == [
        True,
        True,
        False,
    ]
    forward, backward = loss_saved(model, train, loop)
    assert sum(s.bytes for s in forward) == sum(s.bytes for s in backward) == (2 * 4 + 2 * 8) * rows


@pytest.mark.parametrize("precision,strategy", [("fp32", "single"), ("bf16", "ddp"), ("fp32", "fsdp-full-shard")])
def test_cce_compile_backward_writes_the_logit_gradient_in_place(precision, strategy):
    """The compiled head-and-loss backward: the logit gradient (c·b·(s−1)·V) where the logits
    were, and the head weight's gradient (its grad dtype; FSDP: the unsharded one)."""
    from memplan.memory import estimate
    from memplan.precision import POLICIES
    from memplan.specs import ClusterSpec, Job, Plan

    model = _model(vocab=32000)
    train = TrainSpec(seq_len=256, micro_batch=2, precision=precision, device="cpu", loss="cce-compile")
    gpus = 1 if strategy == "single" else 4
    job = Job(model=model, train=train, cluster=ClusterSpec(gpus=gpus), plan=Plan(strategy=strategy))
    moment = next(m for m in estimate(job).moments if m.label == "backward of the compiled head and loss")
    head = [t for t in moment.terms if t.key == "loss.head"]
    c = POLICIES[precision].compute_bytes
    wbytes = 4 if strategy == "fsdp-full-shard" else POLICIES[precision].grad_bytes  # fp32 params gathered
    assert [t.bytes for t in head] == [c * 2 * 255 * 32000, wbytes * 32000 * 128]
    assert not any(t.key == "logits" for t in moment.terms)


def test_cce_compile_under_autocast_upcasts_its_gradients_after_freeing_the_logits():
    """Under autocast the graph's fp32 gradients come once the logits' buffer and the head
    weight's cast are freed: the head input's (4·b·(s−1)·h) and two fp32 V·h, with no logits;
    its first backward moment holds the weight's gradient in the compute dtype."""
    from memplan.memory import estimate
    from memplan.specs import ClusterSpec, Job, Plan

    model = _model(vocab=32000)
    train = TrainSpec(seq_len=256, micro_batch=2, precision="amp-bf16", device="cpu", loss="cce-compile")
    job = Job(model=model, train=train, cluster=ClusterSpec(gpus=4), plan=Plan(strategy="ddp"))
    moments = {m.label: m for m in estimate(job).moments}
    first = moments["backward of the compiled head and loss"]
    upcast = moments["backward of the compiled head and loss: fp32 gradients (autocast)"]
    assert [t.bytes for t in first.terms if t.key == "loss.head"] == [2 * 2 * 255 * 32000, 2 * 32000 * 128]
    assert [t.bytes for t in upcast.terms if t.key == "loss.upcast"] == [4 * 2 * 255 * 128, 8 * 32000 * 128]
    assert not any(t.key in ("logits", "loss.head") for t in upcast.terms)


@pytest.mark.slow
def test_cce_torch_compile_holds_what_the_model_says():
    """cut-cross-entropy's own linear_cross_entropy(impl="torch_compile"), fp32 on CPU, measured
    with the CPU allocator (compiled code): its forward keeps the gathered head input, the logits
    and the row statistics; its backward adds the head weight's and the head input's gradients."""
    pytest.importorskip("triton", reason="cut-cross-entropy imports triton when it loads; not in CI")
    cce = pytest.importorskip("cut_cross_entropy", reason="cut-cross-entropy is not installed (not in CI)")
    from torch.profiler import ProfilerActivity, profile, record_function

    model = _model(vocab=32000)
    train = TrainSpec(seq_len=256, micro_batch=2, precision="fp32", device="cpu")
    loop, rows, h, V = Loop(loss="cce-compile"), 2 * 255, model.hidden, model.vocab_size
    e = torch.randn(2, 256, h, requires_grad=True)
    c = torch.randn(V, h, requires_grad=True)
    targets = torch.randint(0, V, (2, 256))

    def step():
        with record_function("forward"):
            loss = cce.linear_cross_entropy(e, c, targets, shift=True, impl="torch_compile")
        with record_function("backward"):
            loss.backward()
        e.grad = c.grad = None

    step()  # compiles
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda ev: ev.start_ns())
    spans = {
        ev.name(): (ev.start_ns(), ev.start_ns() + ev.duration_ns())
        for ev in events
        if ev.name() in ("forward", "backward")
    }
    live, peak, start = 0, dict.fromkeys(spans, 0), dict.fromkeys(spans, None)
    for ev in events:
        if ev.name() != "[memory]":
            continue
        for name, (a, _z) in spans.items():
            if start[name] is None and ev.start_ns() >= a:
                start[name] = live
        live += ev.nbytes()
        for name, (a, z) in spans.items():
            if a <= ev.start_ns() <= z:
                peak[name] = max(peak[name], live - start[name])
    forward = sum(s.bytes for s in loss_saved(model, train, loop)[0])
    logits, gathered = 4 * rows * V, 4 * rows * h  # logits_live's term; model_saved's head input
    assert 0 <= peak["forward"] - (logits + gathered + forward) <= SCALAR_SLACK_BYTES
    # backward over the forward's start: what forward kept less the int64 targets and indices
    # (freed first), the weight's gradient (V·h) and the head input rows' gradient beside them
    kept = logits + gathered + forward - 16 * rows
    measured = peak["backward"] + start["backward"] - start["forward"]
    assert 0 <= measured - (kept + 4 * V * h + 4 * rows * h) <= SCALAR_SLACK_BYTES


def _titan_selective_ac():
    ac = pytest.importorskip("torchtitan.distributed.activation_checkpoint")
    return ac.SelectiveAC(ac.SelectiveAC.Config())


OP_CASES = [
    (arch, precision, attention, kv)
    for arch in ("llama", "gpt2", "neox")
    for precision in ("fp32", "bf16")
    for attention in ("sdpa", "eager")
    for kv in ((8, 2) if arch == "llama" else (8,))
]


@pytest.mark.parametrize("arch,precision,attention,kv", OP_CASES)
def test_op_sac_matches_torchtitans_policy(arch, precision, attention, kv):
    """torchtitan's own SelectiveAC wraps the reference block; what stays live after its
    forward (the SAC cache) is the model's list, less the checkpoint input (the caller's)."""
    from calibrate.workloads import Block, rotary_tables

    model = _model(arch, kv)
    train = TrainSpec(seq_len=64, micro_batch=2, precision=precision, attention=attention, device="cpu")
    block = Block(model, attention=attention, selective_ac=False).to(_dtype(precision))
    block = _titan_selective_ac()._wrap_block(block)
    x = torch.randn(2, 64, model.hidden, dtype=_dtype(precision), requires_grad=True)
    rotary = rotary_tables(64, model.head_size, "cpu") if arch != "gpt2" else (None, None)
    with _Live(block, x, *(t for t in rotary if t is not None)) as live:
        y = block(x, *rotary)
        measured = live.current() - live.base - y.untyped_storage().nbytes()
    kept = op_sac_kept(model, train)
    assert kept[0].name == "checkpointed block input"
    assert measured == sum(s.bytes for s in kept[1:])


def test_layer_sac_keeps_full_ac_inputs_and_plain_blocks():
    """Four bf16 llama blocks, every second checkpointed (torchtitan's layer SAC rule):
    two keep their whole saved list, two only their input."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from calibrate.workloads import Block, rotary_tables
    from memplan.checkpointing import block_kept_under

    model, layers, loop = _model(), 4, Loop(ac="full", ac_every=2)
    train = TrainSpec(seq_len=64, micro_batch=2, precision="bf16", device="cpu")
    blocks = [Block(model, attention="sdpa", selective_ac=False).to(torch.bfloat16) for _ in range(layers)]
    blocks = [checkpoint_wrapper(b) if checkpointed(i, loop.ac_every) else b for i, b in enumerate(blocks)]
    x = torch.randn(2, 64, model.hidden, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rotary_tables(64, model.head_size, "cpu")
    with _Live(*blocks, x, cos, sin) as live:
        y = x
        for b in blocks:
            y = b(y, cos, sin)
        measured = live.current() - live.base - y.untyped_storage().nbytes()
    assert num_checkpointed(layers, loop.ac_every) == 2
    assert measured == sum(s.bytes for i in range(layers) for s in block_kept_under(model, train, loop, i))


@pytest.mark.slow
@pytest.mark.parametrize("precision,b,kv", [("fp32", 2, 2), ("bf16", 1, 8)])
def test_compiled_block_saves_what_the_partitioner_keeps(precision, b, kv):
    """A torch.compile'd reference llama block (CPU inductor): the distinct storages its
    compiled autograd function saves, seen by saved-tensor hooks (MemTracker does not see
    inside a compiled region). About a minute per case on two cores."""
    from calibrate.workloads import Block, rotary_tables
    from validation.saved import saved_bytes

    model = _model("llama", kv)
    train = TrainSpec(seq_len=64, micro_batch=b, precision=precision, device="cpu")
    block = Block(model, attention="sdpa", selective_ac=False).to(_dtype(precision))
    x = torch.randn(b, 64, model.hidden, dtype=_dtype(precision), requires_grad=True)
    cos, sin = rotary_tables(64, model.head_size, "cpu")
    compiled = torch.compile(block)
    compiled(x, cos, sin)  # compile outside the hooks
    measured = saved_bytes(lambda: compiled(x, cos, sin), skip=(*block.parameters(), cos, sin))
    assert measured == sum(s.bytes for s in compiled_block_saved(model, train))


def test_by_moment_reproduces_todays_plain_loop():
    """The plain loop (logits kept, ce) is what memory.py's moments count today."""
    from memplan.activations import loss_saved as ce_saved
    from memplan.activations import model_saved
    from memplan.loss import by_moment

    model, train = _model(), TrainSpec(seq_len=64, micro_batch=2, precision="bf16", device="cpu")
    logits = [s for s in model_saved(model, train)[1] if s.name.startswith("logits")]
    forward, backward = ce_saved(model, train)
    moments = by_moment(model, train, Loop())

    def bytes_of(saved):
        return sum(s.bytes for s in saved)

    assert bytes_of(moments["forward"]) == bytes_of(logits + forward)
    assert bytes_of(moments["loss"]) == bytes_of(logits + backward)
    assert bytes_of(moments["block"]) == bytes_of(logits)
    assert by_moment(model, train, Loop(logits="freed"))["block"] == []


def test_optimizer_in_backward_holds_one_gradient_at_a_time():
    """torchtune's register_optim_in_bwd_hooks (training/memory.py, replicated: its package
    does not import here): each parameter steps and drops its gradient in its
    post-accumulate-grad hook, so the largest parameter's gradient is the most that
    exists, never the full set."""
    from calibrate.workloads import CausalLM

    spec = ModelSpec(num_layers=2, hidden=128, num_heads=8, num_kv_heads=2, ffn_hidden=344, vocab_size=512)
    model = CausalLM(spec)
    optimizers = {p: torch.optim.AdamW([p], foreach=False) for p in model.parameters()}
    peak = [0]

    def step(p):
        peak[0] = max(peak[0], sum(q.grad.nbytes for q in model.parameters() if q.grad is not None))
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    ids = torch.randint(0, spec.vocab_size, (2, 64))
    loss, _ = model(ids, ids)
    loss.backward()
    assert peak[0] == 4 * max(p.numel() for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_chunked_loss_saves_the_logits_and_row_statistics(precision):
    """torchtune's compile_loss (training/_compile.py) compiles compute_cross_entropy of its
    chunked loss: inductor saves the logit chunks themselves (so `del logits` frees nothing
    until the loss's backward), two fp32 numbers per token, and the labels. About a
    minute on two cores."""
    from validation.saved import saved_storages

    model, train = _model(), TrainSpec(seq_len=64, micro_batch=2, precision=precision, device="cpu")
    loop = Loop(loss="chunked-ce", loss_chunks=4, compile=True, logits="freed")
    loss_fn = _torchtune_chunked_loss()(num_output_chunks=loop.loss_chunks)
    loss_fn.compute_cross_entropy = torch.compile(loss_fn.compute_cross_entropy)
    labels = torch.randint(0, model.vocab_size, (2, 64))
    loss_fn(_logits(model, train, loop)[2], labels).backward()  # compile outside the hooks
    logits = _logits(model, train, loop)[2]
    logit_storages = {t.untyped_storage().data_ptr() for t in logits}
    seen = saved_storages(lambda: loss_fn(logits, labels))
    held = sum(n for ptr, n in seen.items() if ptr in logit_storages)
    rest = sum(n for ptr, n in seen.items() if ptr not in logit_storages)
    assert held == sum(s.bytes for s in logits_live(model, train, loop, instant="loss"))
    assert 0 <= rest - sum(s.bytes for s in loss_saved(model, train, loop)[0]) <= SCALAR_SLACK_BYTES


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_op_sac_block_backward_peaks_where_full_ac_does(precision, attention):
    """One block's backward under torchtitan's SelectiveAC and under a full checkpoint:
    the same measured peak, and the model's kept + transient agree."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from calibrate.workloads import Block, rotary_tables
    from memplan.checkpointing import block_kept_under, block_transient_under

    model = _model("llama", 2)
    train = TrainSpec(seq_len=64, micro_batch=2, precision=precision, attention=attention, device="cpu")

    def backward_peak(wrap):
        torch.manual_seed(0)
        block = wrap(Block(model, attention=attention, selective_ac=False).to(_dtype(precision)))
        x = torch.randn(2, 64, model.hidden, dtype=_dtype(precision), requires_grad=True)
        rotary = rotary_tables(64, model.head_size, "cpu")
        with _Live(block, x, *rotary) as live:
            y = block(x, *rotary)
            seed = torch.ones_like(y)
            live.mark()
            y.backward(seed)
            return live.peak()

    def modelled(ac):
        loop = Loop(ac=ac)
        return sum(
            s.bytes for s in block_kept_under(model, train, loop, 0) + block_transient_under(model, train, loop, 0)
        )

    assert backward_peak(lambda b: _titan_selective_ac()._wrap_block(b)) == backward_peak(checkpoint_wrapper)
    assert modelled("op") == modelled("full")


def test_float8_training_keeps_what_bf16_keeps():
    """torchao's Float8Linear (float8_linear.py matmul_with_hp_or_float8_args) saves its
    high-precision input and weight and casts them again in backward, so a block's saved
    bytes do not change (measured: torchao 0.18 runs its float8 matmuls on CPU)."""
    float8 = pytest.importorskip("torchao.float8")
    from calibrate.workloads import Block, rotary_tables
    from memplan.activations import block_saved
    from validation.saved import saved_bytes

    model = ModelSpec(num_layers=1, hidden=128, num_heads=8, num_kv_heads=2, ffn_hidden=384, vocab_size=512)
    train = TrainSpec(seq_len=64, micro_batch=2, precision="bf16", device="cpu")
    block = float8.convert_to_float8_training(Block(model, attention="sdpa", selective_ac=False).to(torch.bfloat16))
    x = torch.randn(2, 64, model.hidden, dtype=torch.bfloat16, requires_grad=True)
    rotary = rotary_tables(64, model.head_size, "cpu")
    measured = saved_bytes(lambda: block(x, *rotary), skip=(*block.parameters(), *rotary))
    assert type(block.attn.q_proj).__name__ == "Float8Linear"
    assert measured == sum(s.bytes for s in block_saved(model, train))


def test_op_sac_and_compile_refuse_what_they_do_not_model():
    gpt2 = ModelSpec(
        arch="gpt2",
        num_layers=1,
        hidden=128,
        num_heads=8,
        ffn_hidden=512,
        vocab_size=512,
        linear_bias=True,
        dropout=0.1,
    )
    with pytest.raises(MemplanError, match="math path"):
        op_sac_kept(gpt2, TrainSpec(seq_len=64, micro_batch=2, precision="fp32", device="cpu"))
    with pytest.raises(MemplanError, match="not gpt2"):
        compiled_block_saved(gpt2, TrainSpec(seq_len=64, micro_batch=2, precision="fp32"))


ALLOCATOR_SLACK_BYTES = 4096


def test_allocator_peak_agrees_with_memtracker_on_an_eager_step():
    """calibrate.loops' allocator meter (torch.profiler's CPU memory events) measures the compiled
    cases, whose inductor buffers MemTracker does not see; on an eager step the two agree within
    a few small tensors (measured 1,024 B here and 2,048 B of 507,607,276 on a held-out case)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.profiler import record_function

    from calibrate.loops import _AllocatorPeak
    from calibrate.workloads import CausalLM

    spec = ModelSpec(num_layers=2, hidden=128, num_heads=8, num_kv_heads=2, ffn_hidden=344, vocab_size=512)
    ids = torch.randint(0, spec.vocab_size, (2, 64))
    cpu = torch.device("cpu")
    with _AllocatorPeak() as allocator, MemTracker() as tracker:
        model = CausalLM(spec)
        tracker.track_external(model)
        with record_function("step"):
            loss, _ = model(ids, ids)
            loss.backward()
        tracked = tracker.get_tracker_snapshot("peak")[cpu]["Total"]
    counted = allocator.peaks(("step",))["step"]
    assert tracked > 0 and abs(counted - tracked) <= ALLOCATOR_SLACK_BYTES


def test_zero_grad_is_a_loop_flag_with_a_one_line_error_and_json_input():
    import json

    from click.testing import CliRunner

    from memplan.cli import main

    args = ["estimate", "--params", "1e9", "--gpus", "1", "--strategy", "single"]
    bad = CliRunner().invoke(main, [*args, "--zero-grad", "sometimes"])
    assert bad.exit_code == 2 and "--zero-grad" in bad.output and "'none', 'zeros'" in bad.output
    assert len(bad.output.strip().splitlines()) == 1
    out = json.loads(CliRunner().invoke(main, [*args, "--zero-grad", "zeros", "--format", "json"]).output)
    assert out["inputs"]["train"]["zero_grad"] == "zeros"
    with pytest.raises(MemplanError, match="zero-grad 'some' is not one of: none, zeros"):
        Loop(zero_grad="some")


def test_zero_filled_gradients_are_live_from_the_start_of_the_step():
    """--zero-grad zeros: the previous step's gradients (zero-filled) are live in forward, so the
    forward moment holds every gradient more than with them freed (4·P bytes for fp32 ones)."""
    from memplan.memory import estimate
    from memplan.specs import Job

    model = ModelSpec(num_layers=2, hidden=256, num_heads=4, ffn_hidden=688, vocab_size=2048)
    job = Job(model=model, train=TrainSpec(precision="fp32", seq_len=128)).with_(strategy="single")
    freed, kept = (
        next(m for m in estimate(job.with_(zero_grad=z)).moments if m.label == "end of forward (cross-entropy)")
        for z in ("none", "zeros")
    )
    assert kept.allocated_bytes - freed.allocated_bytes == 4 * model.num_params
