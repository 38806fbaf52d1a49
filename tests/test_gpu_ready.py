"""Checks of the CUDA path that run without a GPU: which stream the stopwatch records on, the default dtype
by compute capability, and that DFlash 2's selector never reads a value back to the host."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, VOCAB, dflash2_config, random_drafter, target_config
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_cli.engine import device as device_mod
from dflash_cli.engine.dflash2 import CandidateSelector
from dflash_cli.engine.sampling import Sampler

# ---------------------------------------------------------------- Stopwatch: the target device's stream


class FakeEvent:
    """Stands in for torch.cuda.Event: remembers the stream each record() was given."""

    made: list[FakeEvent] = []

    def __init__(self, enable_timing: bool = False):
        self.enable_timing, self.streams = enable_timing, []
        FakeEvent.made.append(self)

    def record(self, stream=None):
        self.streams.append(stream)

    def synchronize(self):
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return 12.5  # ms


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeEvent.made = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", torch.device(device)))
    return FakeEvent


@pytest.mark.parametrize("name", ["cuda:1", "cuda:0", "cuda"])
def test_stopwatch_records_on_the_target_devices_stream(fake_cuda, name):
    """With --device cuda:1 the events must be recorded on cuda:1's stream, not the current device's
    (record() without a stream records on the current device, and the times then read zero)."""
    dev = torch.device(name)
    watch = device_mod.Stopwatch(dev).start()
    watch.stop()
    start, end = fake_cuda.made
    assert start.enable_timing and end.enable_timing
    assert start.streams == [("stream of", dev)] and end.streams == [("stream of", dev)]
    assert watch.seconds == pytest.approx(0.0125)


def test_stopwatch_on_cpu_uses_the_clock(fake_cuda):
    watch = device_mod.Stopwatch(torch.device("cpu")).start()
    watch.stop()
    assert fake_cuda.made == [] and watch.seconds >= 0.0


# ---------------------------------------------------------------- default dtype by compute capability


@pytest.fixture
def gpus(monkeypatch):
    """Pretends CUDA is available with GPUs of the given capabilities: gpus({0: (7, 5), 1: (8, 6)})."""
    asked: list[torch.device] = []

    def install(caps: dict[int, tuple[int, int]], current: int = 0):
        def capability(device=None):
            d = torch.device(device) if device is not None else torch.device("cuda")
            asked.append(d)
            return caps[current if d.index is None else d.index]

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
        return asked

    return install


@pytest.mark.parametrize("cap, expected", [((6, 1), torch.float16), ((7, 0), torch.float16),
                                           ((7, 5), torch.float16), ((8, 0), torch.bfloat16),
                                           ((8, 9), torch.bfloat16), ((9, 0), torch.bfloat16),
                                           ((12, 0), torch.bfloat16)])
def test_auto_dtype_on_cuda_follows_compute_capability(gpus, cap, expected):
    """bf16 needs Ampere (8.0) for native matmuls; before it, fp16 (bf16 is emulated and compiles slowly)."""
    gpus({0: cap})
    for name in (None, "auto"):
        assert device_mod.pick_dtype(name, torch.device("cuda")) == expected
        assert device_mod.pick_dtype(name, torch.device("cuda:0"), "nf4") == expected


def test_auto_dtype_asks_the_chosen_gpu(gpus):
    asked = gpus({0: (8, 0), 1: (7, 5)})
    assert device_mod.pick_dtype(None, torch.device("cuda:1")) == torch.float16
    assert asked and all(d == torch.device("cuda:1") for d in asked)
    assert device_mod.pick_dtype(None, torch.device("cuda:0")) == torch.bfloat16


@pytest.mark.parametrize("name, expected", [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
                                            ("float32", torch.float32), ("float16", torch.float16)])
def test_an_explicit_dtype_is_kept_on_old_gpus(gpus, name, expected):
    gpus({0: (7, 0)})
    assert device_mod.pick_dtype(name, torch.device("cuda")) == expected


def test_cpu_dtypes_do_not_ask_cuda(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a CPU dtype must not query CUDA")

    monkeypatch.setattr(torch.cuda, "get_device_capability", boom)
    cpu = torch.device("cpu")
    assert device_mod.pick_dtype(None, cpu, "q4") == torch.bfloat16
    assert device_mod.pick_dtype(None, cpu) in (torch.bfloat16, torch.float32)


# ---------------------------------------------------------------- DFlash 2 selector: no host syncs

# Ops that read a device value on the host (`.item()`, `int()`, `bool()`, `__index__` and indexing by a
# 0-d tensor all end in aten._local_scalar_dense, seen as aten.item under inference mode) or whose output
# size depends on values.
SYNCING_OPS = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select", "aten.is_nonzero",
               "aten.equal", "aten._unique", "aten.unique")


class HostReads(TorchDispatchMode):
    """Records every op that would make a GPU wait for the host to read a value, and copies to the CPU."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        if name.startswith(SYNCING_OPS):
            self.reads.append(str(func))
        out = func(*args, **kwargs)
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        if (isinstance(out, torch.Tensor) and out.device.type == "cpu"
                and any(a.device.type != "cpu" for a in inputs)):
            self.reads.append(f"{func} (a copy to the CPU)")
        return out


@pytest.fixture
def host_reads(monkeypatch):
    """Counts host reads two ways: the dispatch mode above (what C++ does, e.g. t[0-d tensor]) and the
    Python-level conversions, patched (a tensor's .item(), .tolist(), int(), bool(), __index__)."""
    python_calls: list[str] = []
    for attr in ("item", "tolist", "__index__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, attr)

        def counted(self, *args, _attr=attr, _original=original, **kwargs):
            python_calls.append(_attr)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, attr, counted)

    def check(fn):
        mode = HostReads()
        with mode:
            out = fn()
        return out, mode.reads + python_calls

    return check


def selector(seed: int = 0, V: int = 96, H: int = 32, R: int = 8, k: int = 5) -> CandidateSelector:
    torch.manual_seed(seed)
    sel = CandidateSelector(H, V, R, k)
    with torch.no_grad():
        sel.predecessor_codebook.normal_()
        sel.successor_codebook.normal_()
    return sel.to(DEVICE)


@pytest.mark.parametrize("sampler", [None, Sampler(temperature=0.8, seed=3),
                                     Sampler(temperature=1.1, top_p=0.9, top_k=3, seed=4)],
                         ids=["greedy", "sampled", "sampled-top-p-k"])
def test_selector_walk_reads_nothing_back(host_reads, sampler):
    """The walk picks a candidate per slot from the one picked before it: with 0-d tensor indices each slot
    cost a device-to-host sync. Its result must stay on the device, computed without any host read."""
    sel = selector()
    P = 7
    logits, hidden = torch.randn(P, 96, device=DEVICE) * 2, torch.randn(P, 32, device=DEVICE)
    anchor = torch.tensor([11], device=DEVICE)
    expected = sel.walk(logits, hidden, anchor, 20, sampler)  # outside the counters
    out, reads = host_reads(lambda: sel.walk(logits, hidden, anchor, 20, sampler))
    assert reads == [], f"host reads inside the selector walk: {reads}"
    assert out.shape == (P,) and out.device == expected.device and torch.equal(out, expected)


def test_dflash2_draft_reads_nothing_back(host_reads):
    """The whole DFlash 2 draft of a round (drafter layers, then the walk) stays on the device."""
    target = target_config()
    drafter = random_drafter(dflash2_config(target)).to(DEVICE).eval()
    drafter.init_rotary(torch.device(DEVICE))
    cache = drafter.new_cache(64)
    torch.manual_seed(5)
    embed = torch.randn(VOCAB, target["hidden_size"], device=DEVICE)
    head = torch.nn.Linear(target["hidden_size"], VOCAB, bias=False, device=DEVICE)
    context = torch.randn(1, 5, drafter.fc.in_features, device=DEVICE)  # the tapped target states
    anchor = torch.tensor([7], device=DEVICE)
    out, reads = host_reads(lambda: drafter.draft(context, anchor, 5, 8, cache, embed, head))
    assert reads == [] and out.shape == (7,)
    out, reads = host_reads(lambda: drafter.draft(None, out[-1:], 5, 8, cache, embed, head,
                                                  sampler=Sampler(temperature=0.9, seed=1)))
    assert reads == [] and out.shape == (7,)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not DEVICE.startswith("cuda"),
                    reason="needs a CUDA GPU (DFLASH_TEST_DEVICE=cuda)")
def test_selector_walk_passes_cuda_sync_debug_mode():
    """On a GPU, torch itself says whether anything synchronised: sync debug mode "error" raises."""
    sel = selector()
    logits, hidden = torch.randn(7, 96, device=DEVICE), torch.randn(7, 32, device=DEVICE)
    anchor = torch.tensor([11], device=DEVICE)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sel.walk(logits, hidden, anchor, 20, None)
        sel.walk(logits, hidden, anchor, 20, Sampler(temperature=0.8, seed=3))
    finally:
        torch.cuda.set_sync_debug_mode("default")
