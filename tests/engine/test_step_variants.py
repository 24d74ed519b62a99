"""No kernel variant may first compile while serving (seconds on a GPU, paid by a request):
a step's index tensors start on 16-byte boundaries whatever the batch (Triton compiles a variant
per pointer alignment), and the variants that a step picks by its size are compiled up front."""

import pytest
import torch

from moeserve.demo.random_model import RANDOM_CONFIG
from moeserve.config import parse_model_config
from moeserve.engine.config import EngineConfig
from moeserve.engine.compile_ahead import compile_prefix_attention, compile_step_sized_variants
from moeserve.engine.model_runner import ModelRunner
from moeserve.engine.step_input import StepInput
from moeserve.sampling_params import SamplingParams


def _runner(backend: str = "reference") -> ModelRunner:
    config = EngineConfig(model=None, device="cpu", dtype="float32", load_format="dummy", backend=backend, page_size=4, max_num_seqs=5)
    return ModelRunner(parse_model_config(dict(RANDOM_CONFIG)), config)


def _step(query_lens: list[int], context_lens: list[int], page_size: int = 4) -> StepInput:
    ids, positions, slots, tables, next_page = [], [], [], [], 0
    for n, L in zip(query_lens, context_lens):
        pages = list(range(next_page, next_page + -(-L // page_size)))
        next_page += len(pages)
        ids += [3] * n
        positions += list(range(L - n, L))
        slots += [pages[p // page_size] * page_size + p % page_size for p in range(L - n, L)]
        tables.append(pages)
    B = len(query_lens)
    return StepInput(
        input_ids=ids,
        positions=positions,
        slot_mapping=slots,
        query_lens=query_lens,
        context_lens=context_lens,
        page_tables=tables,
        logits_indices=[sum(query_lens[: i + 1]) - 1 for i in range(B)],
        sample_seq_ids=list(range(B)),
        sample_params=[SamplingParams(temperature=0)] * B,
        sample_seed_offsets=[0] * B,
    )


@pytest.mark.parametrize("query_lens", [[1], [1, 1, 5], [7, 3], [1, 1, 1, 1, 9]])
def test_step_tensors_start_on_16_byte_boundaries(query_lens):
    runner = _runner()
    context_lens = [n + 3 * i for i, n in enumerate(query_lens)]
    step = _step(query_lens, context_lens)
    ids, ctx = runner.prepare(step)
    for name, t in [
        ("ids", ids),
        ("positions", ctx.positions),
        ("slots", ctx.slot_mapping),
        ("logits", ctx.logits_indices),
        ("cu_query_lens", ctx.cu_query_lens),
        ("context_lens", ctx.context_lens_tensor),
        ("page_tables", ctx.page_tables),
    ]:
        assert t.data_ptr() % 16 == 0, name
    assert ids.tolist() == step.input_ids and ctx.positions.tolist() == step.positions
    assert ctx.slot_mapping.tolist() == step.slot_mapping and ctx.logits_indices.tolist() == step.logits_indices
    assert ctx.context_lens_tensor.tolist() == context_lens
    assert ctx.cu_query_lens.tolist() == [0] + [sum(query_lens[: i + 1]) for i in range(len(query_lens))]
    for row, pages in zip(ctx.page_tables.tolist(), step.page_tables):
        assert row[: len(pages)] == pages


def test_sampling_variants_compiled_once_each(monkeypatch):
    triton = pytest.importorskip("triton")
    from moeserve.kernels import sampling

    rows_run = []
    monkeypatch.setattr(sampling, "argmax_logsumexp", lambda logits: rows_run.append(logits.shape[0]))
    V, device = 163_840, torch.device("cpu")
    sampling.compile_variants(256, V, device)
    variants = {}
    for rows in range(1, 257):
        _, block, chunks = sampling.launch_shape(rows, V, device)
        variants.setdefault((block, triton.next_power_of_2(chunks)), rows)
    assert rows_run == sorted(variants.values()) and rows_run[0] == 1 and len(rows_run) > 1


def test_step_sized_variants_run_on_scratch_inputs():
    pytest.importorskip("triton")
    runner = _runner("triton")
    before = runner.pool.layer(0).clone()
    compile_step_sized_variants(runner, 4096)  # past LONG_CONTEXT: the long-context decode tile too
    assert torch.equal(runner.pool.layer(0), before)  # reads the cache, writes nothing to it


def test_verify_row_variants_compile_ahead_with_speculation(monkeypatch):
    """With k drafts a step, the decode kernel of verify rows of 2 .. k + 1 tokens (a row whose
    drafts were cut is shorter) runs on scratch inputs before ready; none without speculation."""
    import types

    pytest.importorskip("triton")
    from moeserve.kernels import mla_decode as decode_module

    runner = _runner("triton")
    seen = []
    real = decode_module.mla_decode
    monkeypatch.setattr(decode_module, "mla_decode", lambda *a, **kw: seen.append(kw.get("tokens_per_row", 1)) or real(*a, **kw))
    compile_step_sized_variants(runner, 64)
    assert set(seen) == {1}
    seen.clear()
    runner.drafter = types.SimpleNamespace(k=3)
    before = runner.pool.layer(0).clone()
    compile_step_sized_variants(runner, 64)
    assert set(seen) == {1, 2, 3, 4}
    assert torch.equal(runner.pool.layer(0), before)


def test_both_prefix_attention_forms_compile_ahead_and_the_mode_is_kept():
    """A server without the prefix cache never attends to a cached prefix in its warm-up; a
    chunk of a long prompt later does, in either form, so both run on a scratch step first."""
    pytest.importorskip("triton")
    runner = _runner("triton")
    backend = runner.backend
    forms = []
    absorbed, expand = backend._merge_absorbed_prefix, backend._expand
    backend._merge_absorbed_prefix = lambda *a: forms.append("absorbed") or absorbed(*a)
    backend._expand = lambda cache, slots, *a: forms.append(slots.numel()) or expand(cache, slots, *a)
    before = runner.pool.layer(0).clone()
    compile_prefix_attention(runner)
    assert "absorbed" in forms
    assert 2 * runner.page_size in forms  # the chunked form expanded the two cached pages
    assert backend.prefix_mode == "auto"
    assert torch.equal(runner.pool.layer(0), before)
