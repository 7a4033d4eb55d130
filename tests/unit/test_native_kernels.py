"""The native CPU kernels (``worker/native_kernels.py``). Decode attention (``native/paged_decode.c``)
against torch's path on the same paged cache: random pools, block tables in random order, grouped
heads, every head size the kernel specialises and one it does not, contexts of one token and of whole
blocks, the batch split across threads. SiLU(gate) * up (``native/silu_mul.c``) against torch's. The
draw (``native/inverse_cdf.c``) against the float64 inverse of each row's cumulative sum, at its edges,
and never on a cut token. Their build: cached, keyed (the shared header too), refused clearly."""

from __future__ import annotations

import math
import stat
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trioserve.worker import native_kernels as native_kernels_module
from trioserve.worker.native_kernels import HEADERS, BuildFailed, NativeKernels, build, native_kernels
from trioserve.worker.paged_attention import gather


@pytest.fixture(scope="module")
def kernel() -> NativeKernels:
    return NativeKernels(build())


def paged_case(
    seed: int, batch: int, heads: int, kv_heads: int, dim: int, block_size: int, lens: list[int] | None = None
) -> tuple[torch.Tensor, ...]:
    """A pool of random keys and values, ``batch`` contexts on distinct blocks in random order (tables
    padded with block 0, as the runner pads them), and one query per context."""
    g = torch.Generator().manual_seed(seed)
    if lens is None:
        lens = torch.randint(1, 5 * block_size, (batch,), generator=g).tolist()
    width = max(-(-n // block_size) for n in lens)
    num_blocks = batch * width + 3
    keys = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    values = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(batch, width, dtype=torch.long)
    for b, n in enumerate(lens):
        used = -(-n // block_size)
        tables[b, :used] = order[b * width : b * width + used]
    q = torch.randn(batch, heads, dim, generator=g)
    return q, keys, values, tables, torch.tensor(lens, dtype=torch.long)


def torch_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """What ``paged_attention`` computes without the kernel: gather, mask, SDPA."""
    batch, heads, dim = q.shape
    kv_heads = keys.shape[2]
    positions = tables.shape[1] * keys.shape[1]
    mask = (torch.arange(positions).unsqueeze(0) < lens.view(-1, 1)).view(batch, 1, 1, positions)
    qd = q.view(batch, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(
        qd, gather(keys, tables), gather(values, tables), attn_mask=mask, scale=scale
    )
    return out.reshape(batch, heads, dim)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    [(4, 4, 32, 16), (9, 3, 64, 16), (4, 2, 16, 4), (8, 1, 128, 8), (6, 2, 24, 5), (2, 2, 1, 3)],
)
def test_equals_the_gathered_sdpa(
    kernel: NativeKernels, heads: int, kv_heads: int, dim: int, block_size: int
) -> None:
    for seed in range(4):
        q, keys, values, tables, lens = paged_case(seed, 7, heads, kv_heads, dim, block_size)
        scale = dim**-0.5
        got = kernel.decode(q, keys, values, tables, lens, scale)
        torch.testing.assert_close(
            got, torch_reference(q, keys, values, tables, lens, scale), rtol=1e-5, atol=1e-5
        )


def test_context_edges_one_token_and_whole_blocks(kernel: NativeKernels) -> None:
    bs = 4
    q, keys, values, tables, lens = paged_case(
        9, 6, 4, 2, 16, bs, lens=[1, bs, bs + 1, 2 * bs, 3 * bs - 1, 1]
    )
    got = kernel.decode(q, keys, values, tables, lens, 0.3)
    torch.testing.assert_close(got, torch_reference(q, keys, values, tables, lens, 0.3), rtol=1e-5, atol=1e-5)
    # One position: the output is that position's value row, whatever the query.
    first = tables[0, 0]
    torch.testing.assert_close(got[0].view(2, 2, 16), values[first, 0].unsqueeze(1).expand(2, 2, 16))


def test_reads_nothing_past_a_context(kernel: NativeKernels) -> None:
    """Positions past ``lens`` and the padding blocks change nothing: poisoned with NaN, still exact."""
    q, keys, values, tables, lens = paged_case(3, 5, 4, 4, 32, 8, lens=[3, 17, 8, 1, 12])
    clean = kernel.decode(q, keys, values, tables, lens, 0.2)
    for b, n in enumerate(lens.tolist()):
        for p in range(n, tables.shape[1] * 8):
            block = tables[b, p // 8]
            if p // 8 >= -(-n // 8):
                continue  # a padding entry: block 0 may be another context's block
            keys[block, p % 8] = float("nan")
            values[block, p % 8] = float("nan")
    assert torch.equal(kernel.decode(q, keys, values, tables, lens, 0.2), clean)


def test_a_split_batch_is_bit_identical_to_one_thread(kernel: NativeKernels) -> None:
    """Each request is computed by one thread from its own data, so the split changes no bit: what the
    thread learner's bit-exact shadow passes rely on."""
    q, keys, values, tables, lens = paged_case(5, 37, 9, 3, 64, 16)
    one = kernel.decode(q, keys, values, tables, lens, 0.125)
    for threads in (2, 3, 8):
        assert torch.equal(kernel.decode(q, keys, values, tables, lens, 0.125, threads=threads), one)


def test_refuses_what_it_cannot_read(kernel: NativeKernels) -> None:
    q, keys, values, tables, lens = paged_case(1, 3, 4, 2, 16, 4)
    with pytest.raises(ValueError, match="unsupported"):
        kernel.decode(q.double(), keys, values, tables, lens, 1.0)
    with pytest.raises(ValueError, match="unsupported"):
        kernel.decode(q, keys.transpose(1, 2), values.transpose(1, 2), tables, lens, 1.0)
    with pytest.raises(ValueError, match="unsupported"):
        kernel.decode(q, keys, values, tables.int(), lens, 1.0)
    with pytest.raises(ValueError, match="unsupported"):
        kernel.decode(q[:, :3], keys, values, tables, lens, 1.0)  # 3 heads over 2 kv heads


def float64_inverse(logits: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's cumulative probabilities in float64 and the target ``u`` falls on."""
    cdf = torch.softmax(logits.double(), dim=-1).cumsum(dim=-1)
    return cdf, u.double().unsqueeze(1) * cdf[:, -1:]


@pytest.mark.parametrize("vocab", [49152, 1000, 257, 256, 7, 1])
def test_the_draw_inverts_the_cumulative_sum(kernel: NativeKernels, vocab: int) -> None:
    """The token's interval of the float64 cumulative sum holds the target, to float32 rounding."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=g) * 4
    u = torch.rand(64, generator=g)
    tokens = kernel.draw(logits, u)
    cdf, target = float64_inverse(logits, u)
    for r, j in enumerate(tokens.tolist()):
        below = float(cdf[r, j - 1]) if j else 0.0
        assert below - 1e-5 <= float(target[r]) < float(cdf[r, j]) + 1e-5, (r, j)


def test_the_draw_at_its_edges(kernel: NativeKernels) -> None:
    """u = 0 takes the first token of positive weight, u just under 1 the last; a row with no weight
    at all takes token 0."""
    logits = torch.full((4, 1000), float("-inf"))
    logits[:, [3, 500, 998]] = torch.tensor([0.0, 1.0, -1.0])
    logits[3] = float("-inf")
    u = torch.tensor([0.0, torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item(), 0.5, 0.5])
    assert kernel.draw(logits, u).tolist() == [3, 998, 500, 0]


def test_the_draw_follows_the_distribution_and_never_takes_a_cut_token(kernel: NativeKernels) -> None:
    vocab, n = 3000, 20000
    g = torch.Generator().manual_seed(7)
    row = torch.full((vocab,), -30.0)
    kept = torch.tensor([5, 700, vocab - 1])
    row[kept] = torch.tensor([2.0, 1.0, 0.0])
    cut = torch.randperm(vocab, generator=g)[:1000]
    cut = cut[~torch.isin(cut, kept)]
    row[cut] = float("-inf")
    tokens = kernel.draw(row.repeat(n, 1), torch.rand(n, generator=g))
    counts = torch.bincount(tokens, minlength=vocab)
    assert int(counts[cut].sum()) == 0
    probs = torch.softmax(row.double(), dim=-1)
    for token in kept.tolist():
        expected = n * float(probs[token])
        assert abs(int(counts[token]) - expected) < 5 * math.sqrt(expected), (token, int(counts[token]))


def test_the_draw_refuses_what_it_cannot_read(kernel: NativeKernels) -> None:
    with pytest.raises(ValueError, match="unsupported"):
        kernel.draw(torch.zeros(2, 5, dtype=torch.float64), torch.zeros(2))
    with pytest.raises(ValueError, match="unsupported"):
        kernel.draw(torch.zeros(2, 5), torch.zeros(3))


def test_silu_mul_is_torchs_to_a_few_ulp(kernel: NativeKernels) -> None:
    """Against ``F.silu(g) * u`` in float64, over ordinary values, both signs' tails (where the
    logistic is 0 or 1 exactly), zeros and the largest finite floats' neighbourhood of the exp's cut."""
    g = torch.cat(
        [torch.randn(10_000) * 6, torch.tensor([0.0, -0.0, 87.5, -87.5, 88.0, -88.0, 200.0, -200.0])]
    )
    u = torch.randn(g.numel())
    want = (F.silu(g.double()) * u.double()).float()
    got = kernel.silu_mul(g.clone(), u)
    torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-30)
    assert torch.all(torch.isfinite(got))


def test_silu_mul_writes_over_a_contiguous_gate_only(kernel: NativeKernels) -> None:
    g, u = torch.randn(6, 10), torch.randn(6, 10)
    want = F.silu(g) * u
    inplace = g.clone()
    assert kernel.silu_mul(inplace, u).data_ptr() == inplace.data_ptr()
    torch.testing.assert_close(inplace, want)
    strided = g.t().contiguous().t()  # same values, not contiguous: a new tensor, the gate kept
    assert not strided.is_contiguous()
    kept = strided.clone()
    out = kernel.silu_mul(strided, u)
    torch.testing.assert_close(out, want)
    assert torch.equal(strided, kept)
    for bad in ((g.double(), u.double()), (g, u[:, :5])):
        with pytest.raises(ValueError, match="unsupported"):
            kernel.silu_mul(*bad)


def test_built_once_then_taken_from_the_cache(tmp_path: Path) -> None:
    first = build(root=tmp_path)
    made = first.stat().st_mtime_ns
    assert build(root=tmp_path) == first
    assert first.stat().st_mtime_ns == made
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging file left behind


def fake_compiler(folder: Path, version: str, exit_code: int = 0) -> str:
    """A ``cc`` that prints ``version`` and, asked to compile, exits ``exit_code`` (with a message)."""
    script = folder / f"cc-{version}"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --version ]; then echo {version}; exit 0; fi\n'
        f"echo 'fake compiler: no' >&2; exit {exit_code}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_a_failed_build_says_why_and_leaves_nothing(tmp_path: Path) -> None:
    cc = fake_compiler(tmp_path, "v1", exit_code=3)
    cache = tmp_path / "cache"
    with pytest.raises(BuildFailed, match="exited 3: fake compiler: no"):
        build(compiler=cc, root=cache)
    assert list(cache.iterdir()) == []
    with pytest.raises(BuildFailed, match="no C compiler"):
        build(compiler="no-such-compiler-here", root=cache)


def test_the_compiler_is_part_of_the_key(tmp_path: Path) -> None:
    """Another compiler version never reuses an object built by the first."""
    cache = tmp_path / "cache"
    real = build(root=cache)
    with pytest.raises(BuildFailed):
        build(compiler=fake_compiler(tmp_path, "v2", exit_code=1), root=cache)
    assert [p.name for p in cache.iterdir()] == [real.name]


def test_the_shared_header_is_part_of_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed ``exp_neg.h`` rebuilds: the object's name is keyed on the header's bytes too."""
    cache = tmp_path / "cache"
    first = build(root=cache)
    header = tmp_path / "exp_neg.h"
    header.write_bytes(HEADERS[0].read_bytes() + b"\n/* changed */\n")
    monkeypatch.setattr(native_kernels_module, "HEADERS", (header,))
    assert build(root=cache).name != first.name


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert native_kernels("torch", cpu, torch.float32) is None
    assert native_kernels("auto", cuda, torch.bfloat16) is None
    assert native_kernels("auto", cpu, torch.bfloat16) is None
    assert isinstance(native_kernels("auto", cpu, torch.float32), NativeKernels)
    with pytest.raises(ValueError, match="CPU in float32"):
        native_kernels("native", cuda, torch.float32)
    with pytest.raises(ValueError, match="auto, native or torch"):
        native_kernels("fast", cpu, torch.float32)
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert native_kernels("auto", cpu, torch.float32) is None  # logged, torch's path kept
    with pytest.raises(ValueError, match="did not build: no C compiler"):
        native_kernels("native", cpu, torch.float32)
