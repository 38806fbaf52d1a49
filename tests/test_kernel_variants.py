"""The builds of the q4a8/q8a8 kernels (engine/cpu/native.py's VARIANTS: AVX-512 VNNI, AVX-VNNI, AVX2) give the
AVX2 build's bits, alone and through whole target and drafter layers, and the choice between them.

A variant runs natively where this CPU has its instructions. Elsewhere it is built against SIMDe's portable
headers (Debian's libsimde-dev, which .ci/run installs): that checks the source's logic (the layout, pairs of
column groups and a last one alone, row tiles, the float part per lane) on any CPU, not the instruction's
encoding or its speed; where neither is possible the test is skipped and says which instructions are missing."""

from __future__ import annotations

import sys

import pytest
import torch
from support.speculation import assert_speculative_equals_plain, random_prompts
from support.weightonly import pairs  # noqa: F401 (a fixture)

from dflash_cli.engine.cpu import native
from dflash_cli.engine.cpu.c_layers import fuse_drafter
from dflash_cli.engine.cpu.int8act import quantize_drafter
from dflash_cli.engine.cpu.layout import pack_q4, pack_q8, pack_scales
from dflash_cli.engine.load import load_pair

pytestmark = pytest.mark.skipif(native.available_without_building() is not None,
                                reason=f"no kernels here: {native.available_without_building()}")

FAST = [v.name for v in native.VARIANTS if v.define]  # the variants compared against AVX2's


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """name -> (library, "native" or "emulated") for every variant this machine can run one way or the other."""
    folder = tmp_path_factory.mktemp("variants")
    flags, emulate = native.cpu_flags(), native.can_emulate()
    out = {}
    for variant in native.VARIANTS:
        if set(variant.cpu_flags) <= flags:
            out[variant.name] = (native.build_variant(variant, folder), "native")
        elif emulate:
            out[variant.name] = (native.build_variant(variant, folder, emulate=True), "emulated")
    return out


def library(builds, name):
    if name not in builds:
        missing = sorted(set(native.variant_named(name).cpu_flags) - native.cpu_flags())
        pytest.skip(f"this CPU lacks {', '.join(missing)} and SIMDe's headers (libsimde-dev) are not installed")
    return builds[name][0]


def matmuls(lib, x, q4, q8):
    """(q4 with a bias, q8 without) outputs of `lib` for rows x."""
    (codes4, d, mins, bias), (codes8, d8) = q4, q8
    m, n = x.shape[0], bias.shape[0]
    out4, out8 = torch.empty(m, n), torch.empty(m, n)
    lib.dfq_q4_matmul(x.data_ptr(), m, x.shape[1], codes4.data_ptr(), d.data_ptr(), mins.data_ptr(), n,
                      bias.data_ptr(), out4.data_ptr())
    lib.dfq_q8_matmul(x.data_ptr(), m, x.shape[1], codes8.data_ptr(), d8.data_ptr(), n, None, out8.data_ptr())
    return out4, out8


def weights(n, k, generator):
    """Random packed q4 and q8 weights, with the extreme codes and scales in their first blocks."""
    codes4 = torch.randint(0, 16, (n, k), generator=generator)
    codes8 = torch.randint(-127, 128, (n, k), generator=generator).to(torch.int8)
    codes4[0, :32], codes8[0, :32], codes8[1, :32] = 15, 127, -127  # the largest integer sums a block has
    d = torch.rand(n, k // 32, generator=generator) * 0.05
    d[0, 0] = 60000.0  # near fp16's largest
    mins = torch.randn(n, k // 32, generator=generator) * 0.05
    bias = torch.randn(n, generator=generator)
    return (pack_q4(codes4), pack_scales(d), pack_scales(mins), bias), (pack_q8(codes8), pack_scales(d))


def activations(m, k, generator):
    x = torch.randn(m, k, generator=generator) * 3
    x[0, :4] = torch.tensor([1e4, -1e4, 1e-30, 0.0])  # one block's scale set by one huge value
    if m > 1:
        x[1, :32] = 0.0  # a block of zeros (scale 0)
    if m > 2:
        x[2, :32] = 127.0  # every code 127: the largest sums
    return x


@pytest.mark.parametrize("name", FAST)
def test_every_variant_gives_the_avx2_bits_on_random_and_extreme_inputs(builds, name):
    lib, reference = library(builds, name), library(builds, "avx2")
    generator = torch.Generator().manual_seed(1)
    # 8 and 24 columns: one group alone; 16 and 136: pairs (136 = 8 pairs and one alone); k = 4096 at 21 rows:
    # more blocks than the q8 kernels' per-block offsets keep on the stack (int8_matmul.c, q8_offsets)
    for n, k in ((8, 32), (16, 64), (24, 576), (136, 96), (40, 4096)):
        q4, q8 = weights(n, k, generator)
        for m in (1, 2, 3, 4, 5, 8, 16, 21):  # 21: a tile of 16 rows, then 5 on the VNNI kernel
            x = activations(m, k, generator)
            for got, want in zip(matmuls(lib, x, q4, q8), matmuls(reference, x, q4, q8)):
                assert torch.equal(got, want), f"{name} ({builds[name][1]}) differs at n={n} k={k} rows={m}"


@pytest.mark.parametrize("name", FAST)
def test_a_row_alone_equals_the_same_row_among_sixteen_on_every_variant(builds, name):
    lib = library(builds, name)
    generator = torch.Generator().manual_seed(2)
    q4, q8 = weights(40, 128, generator)
    x = activations(16, 128, generator)
    together = matmuls(lib, x, q4, q8)
    for r in range(16):
        for alone, among in zip(matmuls(lib, x[r:r + 1].clone(), q4, q8), together):
            assert torch.equal(alone[0], among[r])


def test_pairs_of_groups_from_any_row_count_give_the_avx2_bits(builds):
    """The AVX-512 build takes two groups of 8 columns per instruction from pair_min_rows rows (5 unless told),
    one group at a time below: both ways, at every row count, the AVX2 bits."""
    lib, reference = library(builds, "avx512-vnni"), library(builds, "avx2")
    default = lib.dfq_pair_min_rows()
    assert default == 5
    generator = torch.Generator().manual_seed(5)
    q4, q8 = weights(40, 96, generator)  # 2 pairs and one group alone
    try:
        for pairs_from in (1, 99):
            lib.dfq_set_pair_min_rows(pairs_from)
            assert lib.dfq_pair_min_rows() == pairs_from
            for m in (1, 2, 5, 6, 7, 8, 9, 15):  # pair tiles of 1-8 rows
                x = activations(m, 96, generator)
                for got, want in zip(matmuls(lib, x, q4, q8), matmuls(reference, x, q4, q8)):
                    assert torch.equal(got, want), f"pairs from {pairs_from} rows differ at rows={m}"
    finally:
        lib.dfq_set_pair_min_rows(default)


def test_tiles_give_the_avx2_bits_at_every_row_count(builds):
    """The AMX build with tiles from one row up (DFLASH_AMX_MIN_ROWS's setter): every tile height 1-16, and
    16-row tiles followed by the VNNI kernel's rows."""
    lib, reference = library(builds, "amx"), library(builds, "avx2")
    default = lib.dfq_amx_min_rows()
    assert default > 1, "tiles are not used by this build (the OS refused tile state?)"
    generator = torch.Generator().manual_seed(4)
    q4, q8 = weights(40, 96, generator)
    lib.dfq_amx_set_min_rows(1)
    try:
        assert lib.dfq_amx_min_rows() == 1
        for m in (*range(1, 18), 33, 40):
            x = activations(m, 96, generator)
            for got, want in zip(matmuls(lib, x, q4, q8), matmuls(reference, x, q4, q8)):
                assert torch.equal(got, want), f"amx ({builds['amx'][1]}) differs at rows={m}"
        lib.dfq_amx_set_min_rows(0)  # as where Linux lends no tile state: doctor says so
        assert "tiles unused" in native._tiles_note(native.Built(lib, native.source_dir(), 0.0,
                                                                 native.variant_named("amx")))
    finally:
        lib.dfq_amx_set_min_rows(default)
    built = native.Built(lib, native.source_dir(), 0.0, native.variant_named("amx"))
    assert native._tiles_note(built) == f"; tiles for calls of {default}+ rows"


def attend(lib, q, keys, values, counts, heads, half):
    """dfq_attend_rows (the C layers' attention of one key/value group) for the queries q (rows, heads * hd)."""
    import ctypes

    P, LONG = ctypes.c_void_p, ctypes.c_long
    lib.dfq_attend_rows.argtypes = [P, LONG, LONG, LONG, LONG, P, P, LONG, P, ctypes.c_float, P, LONG, ctypes.c_int]
    rows, hd = q.shape[0], keys.shape[1]
    out = torch.empty(rows, heads * hd)
    lib.dfq_attend_rows(q.data_ptr(), heads * hd, rows, heads, hd, keys.data_ptr(), values.data_ptr(), 0,
                        counts.data_ptr(), hd**-0.5, out.data_ptr(), heads * hd, half)
    return out


@pytest.mark.parametrize("name", FAST)
def test_attention_gives_the_avx2_bits_on_every_variant(builds, name):
    """The C attention (native/attention.c), built for each variant, gives AVX2's bits: one query and several
    (the blocked scores, the widened fp16 chunks), fp32 and fp16 caches, head dims with and without an 8-wide
    tail and past one 128-wide pass over the values (a 16-lane version must keep each lane's sums in order)."""
    lib, reference = library(builds, name), library(builds, "avx2")
    generator = torch.Generator().manual_seed(6)
    heads, rows = 3, 6
    for hd in (40, 64, 96, 128, 136):
        keys, values = torch.randn(2, 300, hd, generator=generator) * 2
        q = torch.randn(rows, heads * hd, generator=generator)
        counts = torch.arange(250, 250 + rows)
        for half in (0, 1):
            k, v = (keys.half(), values.half()) if half else (keys, values)
            for m in (1, rows):
                got, want = (attend(x, q[:m], k, v, counts, heads, half) for x in (lib, reference))
                assert torch.equal(got, want), f"{name} ({builds[name][1]}) differs at hd={hd} half={half} rows={m}"


def run_pair(pairs, lib, variant, monkeypatch):
    """A q4a8 pair loaded with `lib` as the process's kernels: the target's logits and taps of a prompt
    (every layer one C call, outputs accumulated onto the residual), and a draft."""
    monkeypatch.setitem(native._state, "result", native.Built(lib, native.source_dir(), 0.0, variant))
    pair = load_pair(*pairs["qwen3"], device="cpu", quant="q4a8")
    assert pair.target.enable_fast_path(400, pad_to=pair.drafter.block_size) is None
    assert quantize_drafter(pair.drafter) > 0 and fuse_drafter(pair.drafter)
    fast = pair.target.fast
    assert fast._module(True, False).fused is not None
    ids = torch.tensor([[5, 9, 11, 3, 7, 2, 8, 30, 31, 40, 17]])
    logits, taps = fast.forward(ids, fast.new_cache(), 0, taps=True, last_logit_only=False)
    block = torch.randn(1, pair.drafter.block_size, pair.drafter.config.hidden_size,
                        generator=torch.Generator().manual_seed(3))
    drafted = pair.drafter(taps, block, taps.shape[1], pair.drafter.new_cache(64))
    return pair, (logits, taps, drafted)


@pytest.mark.parametrize("name", FAST)
def test_target_and_drafter_layers_give_the_avx2_bits_and_stay_lossless_on_every_variant(builds, name, pairs,
                                                                                        monkeypatch):
    lib, reference = library(builds, name), library(builds, "avx2")
    _, want = run_pair(pairs, reference, native.variant_named("avx2"), monkeypatch)
    pair, got = run_pair(pairs, lib, native.variant_named(name), monkeypatch)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert_speculative_equals_plain(pair, random_prompts, (2, 8), max_new_tokens=20)


def test_the_fastest_variant_the_cpu_runs_is_chosen_and_dflash_kernels_forces_one(monkeypatch):
    avx2 = {"avx2", "fma", "f16c"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    monkeypatch.delenv(native.KERNELS_ENV, raising=False)
    assert native.chosen_variant(avx512 | {"amx_tile", "amx_int8", "amx_bf16"})[0].name == "amx"
    assert native.chosen_variant(avx512 | {"amx_tile", "amx_bf16"})[0].name == "avx512-vnni"  # tiles, no int8
    assert native.chosen_variant(avx2) == (native.variant_named("avx2"), "no VNNI on this CPU")
    assert native.chosen_variant(avx2 | {"avx_vnni"})[0].name == "avx-vnni"
    assert native.chosen_variant(avx512 | {"avx_vnni"})[0].name == "avx512-vnni"
    assert native.chosen_variant(avx512 - {"avx512vl"})[0].name == "avx2"  # VNNI without VL: no 256-bit form
    monkeypatch.setenv(native.KERNELS_ENV, "avx2")
    assert native.chosen_variant(avx512) == (native.variant_named("avx2"), "forced by DFLASH_KERNELS")
    monkeypatch.setenv(native.KERNELS_ENV, "avx512-vnni")
    with pytest.raises(ValueError, match="this CPU lacks avx512_vnni, avx512bw, avx512f, avx512vl"):
        native.chosen_variant(avx2)
    monkeypatch.setenv(native.KERNELS_ENV, "sse2")
    with pytest.raises(ValueError, match="one of amx, avx512-vnni, avx-vnni, avx2"):
        native.chosen_variant(avx2)


def test_a_forced_variant_this_cpu_cannot_run_is_one_line_and_exit_2(tiny_target_dir, monkeypatch):
    from click.testing import CliRunner

    from dflash_cli.ui.cli import cli

    lacking = next((v for v in native.VARIANTS if not set(v.cpu_flags) <= native.cpu_flags()), None)
    if lacking is None:
        pytest.skip("this CPU runs every variant")
    monkeypatch.setenv(native.KERNELS_ENV, lacking.name)
    native.reset_for_tests()
    try:
        result = CliRunner().invoke(cli, ["generate", "-m", str(tiny_target_dir), "--no-draft", "--quant", "q4a8",
                                           "-n", "2", "hi"])
    finally:
        native.reset_for_tests()
    assert result.exit_code == 2, result.output
    assert f"{native.KERNELS_ENV}={lacking.name}: this CPU lacks" in result.stderr
    assert f"unset {native.KERNELS_ENV}" in result.stderr and "Traceback" not in result.stderr


def test_a_build_that_fails_its_check_is_never_used(builds, tmp_path, monkeypatch):
    """kernels_agree refuses wrong sums (a build whose second group of a pair reads the first group's codes), in
    the child process a new build's first check runs in; a variant whose build dies on that check (a CPU that
    claims AVX-VNNI and lacks it: SIGILL) gives way to AVX2, says why, and the process lives on; the next start
    remembers it (no build, no child)."""
    if not native.can_emulate():
        pytest.skip("SIMDe's headers (libsimde-dev) are not installed: no broken AVX-512 build to make here")
    if "avx_vnni" in native.cpu_flags():
        pytest.skip("this CPU has AVX-VNNI: its build would not crash")
    assert all(native.kernels_agree(lib) for lib, _ in builds.values())
    broken_sources = tmp_path / "native"
    broken_sources.mkdir()
    for path in native.source_files():
        text = path.read_text()
        if path.name == "int8_avx512.h":
            text = text.replace("cb + nb * 128 + 32 * t", "cb + 32 * t")
        (broken_sources / path.name).write_text(text)
    monkeypatch.setattr(native, "source_dir", lambda: broken_sources)
    variant = native.variant_named("avx512-vnni")
    broken = native.build_variant(variant, tmp_path, emulate=True)
    assert not native.kernels_agree(broken)
    path = tmp_path / f"libdflash_int8-{variant.name}-emulated.so"
    assert native._check_apart(native.Built(broken, path, 0.0, variant), variant) == \
        "the avx512-vnni build gave wrong sums on its check"
    # a child that cannot run the check at all (no such package where it looks): this process checks instead
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    assert native._check_apart(native.Built(broken, path, 0.0, variant), variant) == \
        "the avx512-vnni build gave wrong sums on its check"
    good, _ = builds["avx512-vnni"]
    assert native._check_apart(native.Built(good, tmp_path / "good.so", 0.0, variant), variant) is None
    assert not (tmp_path / "check-passed").exists()  # not remembered: the child never ran it

    monkeypatch.undo()
    flags = {f for f in native.cpu_flags() if not f.startswith(("avx512", "amx"))} | {"avx_vnni"}
    monkeypatch.setattr(native, "cpu_flags", lambda: flags)
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(native.KERNELS_ENV, raising=False)
    heard: list[str] = []
    native.reset_for_tests()
    try:
        assert "avx-vnni (this CPU has avx_vnni; built at first use)" in kernels_line()
        built = native.library()
        shown = kernels_line()  # doctor names the build that runs, and why
        native.reset_for_tests()
        again = native.library(heard.append)
    finally:
        native.reset_for_tests()
    assert built is not None and built.variant.name == "avx2"
    assert built.why == "the avx-vnni build crashed on its check (SIGILL): kept AVX2"
    assert shown.startswith("avx2 (the avx-vnni build crashed on its check")
    assert again is not None and again.variant.name == "avx2" and again.why == built.why and heard == []


def kernels_line() -> str:
    """doctor's `cpu kernels` line alone (its `cpu format` line may build the kernels to calibrate first)"""
    from dflash_cli.ui.doctor import check_kernels

    return check_kernels().value


def test_a_compiler_that_cannot_build_a_variant_leaves_the_avx2_build(tmp_path, monkeypatch):
    """A CPU with AVX-VNNI and a compiler without -mavxvnni (gcc before 11): the kernels still come, as AVX2."""
    gcc = native.compiler()
    old_gcc = tmp_path / "old-gcc"
    old_gcc.write_text(f"""#!/bin/sh
case "$*" in *-mavxvnni*) echo "{gcc}: error: unrecognized command-line option '-mavxvnni'" >&2; exit 1;; esac
exec {gcc} "$@"
""")
    old_gcc.chmod(0o755)
    # an AVX2 CPU with AVX-VNNI (Alder Lake), whatever this one has beyond AVX2: no AVX-512 build to fall to
    flags = {f for f in native.cpu_flags() if not f.startswith(("avx512", "amx"))} | {"avx_vnni"}
    monkeypatch.setattr(native, "cpu_flags", lambda: flags)
    monkeypatch.setenv("CC", str(old_gcc))
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(native.KERNELS_ENV, raising=False)
    heard: list[str] = []
    native.reset_for_tests()
    try:
        built = native.library()
        native.reset_for_tests()
        again = native.library(heard.append)  # the next start: neither build tried again
    finally:
        native.reset_for_tests()
    assert built is not None and built.variant.name == "avx2", native.unavailable()
    assert built.why.startswith(f"{old_gcc} could not build avx-vnni") and "-mavxvnni" in built.why
    assert built.why.endswith(": kept AVX2")
    assert again is not None and again.variant.name == "avx2" and again.why == built.why and heard == []
