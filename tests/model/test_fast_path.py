"""The whole fast path (Triton attention, fused MoE, fused norms; the Triton interpreter on CPU)
gives the reference path's greedy tokens and logprobs, with chunked prefill and decode mixed."""

import pytest
import torch

from moeserve import LLM, SamplingParams

pytest.importorskip("triton")

PROMPTS = [[5, 9, 3, 77, 12, 40, 41, 42, 2, 8, 8], [11, 12], [90, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]


def run(path, backend, prompts=PROMPTS):
    with LLM(str(path), device="cpu", dtype="float32", backend=backend, max_num_batched_tokens=8, page_size=4) as llm:
        if backend == "triton":
            runner = llm.engine.executor.runner
            assert runner.backend.name == "triton"
            assert runner.model.model.norm.use_kernel
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True)
        )
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.triton_on_cpu
@pytest.mark.parametrize("variant", ["v3_qlora_grouped_yarn", "v2_greedy_yarn"])
def test_fast_path_equals_reference(tmp_path, variant):
    from checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path / variant, variant)
    ref, fast = run(path, "reference"), run(path, "triton")
    for (rt, rl), (ft, fl) in zip(ref, fast):
        assert ft == rt
        for a, b in zip(rl, fl):
            assert a.keys() == b.keys()
            for t in a:
                assert b[t] == pytest.approx(a[t], abs=1e-4)


@pytest.mark.triton_on_cpu
def test_decode_graph_buffers_give_eager_tokens(tmp_path, monkeypatch):
    """The CUDA-graph path's static buffers (filled in place each step, padded to a captured
    size), emulated on CPU: nothing may be cached across forwards by tensor identity, or the
    graph replays stale values (rotary cos/sin once did)."""
    from checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path / "v3", "v3_qlora_grouped_yarn")
    eager = run(path, "triton")
    monkeypatch.setenv("MOESERVE_EMULATE_CUDA_GRAPHS", "1")
    with LLM(
        str(path), device="cpu", dtype="float32", backend="triton", max_num_batched_tokens=8, page_size=4, max_num_seqs=4, max_model_len=64
    ) as llm:
        graphs = llm.engine.executor.runner.graphs
        assert graphs is not None and graphs.emulate and graphs.sizes == [1, 2, 4]
        replays = []
        run_graph = graphs.run
        graphs.run = lambda ids, ctx: replays.append(ctx.num_seqs) or run_graph(ids, ctx)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True)
        )
    assert 3 in replays  # three sequences padded to the size-4 buffers
    for (et, el), o in zip(eager, outs):
        assert o.outputs[0].token_ids == et
        for a, b in zip(el, o.outputs[0].logprobs):
            for t in a:
                assert b[t] == pytest.approx(a[t], abs=1e-4)


@pytest.mark.triton_on_cpu
def test_prefill_graph_buffers_give_eager_tokens(tmp_path, monkeypatch):
    """One-sequence extend steps through the prefill graphs' static buffers (emulated on CPU):
    a fresh prompt padded to a captured size, the chunk after it over a cached prefix whose
    length is only on the device, and a prompt whose first pages come from the prefix cache;
    each gives the eager run's tokens and logprobs."""
    from checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path / "v3", "v3_qlora_grouped_yarn")
    shared = PROMPTS[2][:8]
    prompts = [PROMPTS[0], shared + [3, 1, 4, 1, 5], [7, 7, 7]]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)

    def one_at_a_time(emulate: bool):
        if emulate:
            monkeypatch.setenv("MOESERVE_EMULATE_CUDA_GRAPHS", "1")
        # Few, short decode graphs: their emulated capture runs the interpreter over every size.
        settings = dict(max_num_batched_tokens=8, page_size=4, max_num_seqs=2, max_model_len=64)
        with LLM(str(path), device="cpu", dtype="float32", backend="triton", **settings) as llm:
            keys = []
            graphs = llm.engine.executor.runner.prefill_graphs
            if emulate:
                assert graphs is not None and graphs.sizes == [8] and graphs.prefix_sizes == [8]
                run_graph = graphs.run
                graphs.run = lambda ids, ctx: keys.append(graphs._key(ctx)) or run_graph(ids, ctx)
            llm.generate([{"prompt_token_ids": shared}], params)  # leaves the shared pages cached
            outs = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0] for p in prompts]
        return [(o.token_ids, o.logprobs) for o in outs], keys

    eager, _ = one_at_a_time(False)
    graphed, keys = one_at_a_time(True)
    assert (8, False) in keys and (8, True) in keys
    for (et, el), (gt, gl) in zip(eager, graphed):
        assert gt == et
        for a, b in zip(el, gl):
            for t in a:
                assert b[t] == pytest.approx(a[t], abs=1e-4)


def test_piecewise_sizes_take_a_wave_of_suffixes_with_little_padding():
    """A wave of 128-token suffixes over a cached prompt (~3,500 tokens) is a graphed mixed step,
    padded by at most 512 tokens; the step budget caps the sizes."""
    from moeserve.engine.piecewise_graph import PIECEWISE_MAX_TOKENS, piecewise_capture_sizes

    sizes = piecewise_capture_sizes(8192)
    assert sizes[-1] == PIECEWISE_MAX_TOKENS == 4096
    assert all(b - a <= 512 for a, b in zip(sizes, sizes[1:]) if a >= 2048)
    assert piecewise_capture_sizes(3000)[-1] == 3000 and max(piecewise_capture_sizes(2048)) == 2048


@pytest.mark.triton_on_cpu
def test_piecewise_graph_buffers_give_eager_tokens(tmp_path, monkeypatch):
    """The steps no whole-step graph takes (several prompts' chunks in one step, decode rows
    beside a prompt's chunk) through the piecewise graphs' static buffers, emulated on CPU: the
    queries copied out of each layer, the attention core on the step's real tokens, padding up
    to a captured size; each gives the eager run's tokens and logprobs."""
    from checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path / "v3", "v3_qlora_grouped_yarn")
    prompts = PROMPTS[:2] + [PROMPTS[2][:-1]]  # its last chunk beside two decode rows: 7 tokens
    eager = run(path, "triton", prompts)
    monkeypatch.setenv("MOESERVE_EMULATE_CUDA_GRAPHS", "1")
    with LLM(
        str(path), device="cpu", dtype="float32", backend="triton", max_num_batched_tokens=8, page_size=4, max_num_seqs=4, max_model_len=64
    ) as llm:
        pieces = llm.engine.executor.runner.piecewise_graphs
        assert pieces is not None and pieces.emulate and pieces.sizes == [4, 8]
        steps = []
        run_pieces = pieces.run
        pieces.run = lambda ids, ctx: steps.append((ctx.num_decode_rows, ctx.num_seqs, ctx.slot_mapping.numel())) or run_pieces(ids, ctx)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True)
        )
    assert any(decodes == 0 and rows > 1 for decodes, rows, _ in steps)  # several prompts' chunks
    assert any(0 < decodes < rows for decodes, rows, _ in steps)  # decode rows beside a chunk
    assert any(tokens not in pieces.sizes for _, _, tokens in steps)  # padded to a captured size
    for (et, el), o in zip(eager, outs):
        assert o.outputs[0].token_ids == et
        for a, b in zip(el, o.outputs[0].logprobs):
            for t in a:
                assert b[t] == pytest.approx(a[t], abs=1e-4)


def staggered(llm, prompts, params, gap: int = 2):
    """Each prompt added ``gap`` steps after the one before, so that its prefill shares a step
    with the earlier prompts' decode rows; the outputs in the order added."""
    eng = llm.engine
    ids, done = [], {}
    for p in prompts:
        ids.append(eng.add_request({"prompt_token_ids": p}, params))
        for _ in range(gap):
            done.update((o.request_id, o) for o in eng.step(finished_only=True))
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step(finished_only=True))
    return [(done[i].outputs[0].token_ids, done[i].outputs[0].logprobs) for i in ids]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_captured_piecewise_graphs_give_eager_tokens_on_cuda(tmp_path):
    """Real piecewise graphs on a GPU (captured, replayed around the eager attention cores), in
    float32: prompts added two steps apart, so their prefills run beside decode rows, give the
    tokens and logprobs of the same steps run eagerly."""
    from checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path / "v3", "v3_qlora_grouped_yarn")
    prompts = [PROMPTS[0] * 3, PROMPTS[1], PROMPTS[2] * 2, [7, 8, 9] * 11]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    settings = dict(device="cuda", dtype="float32", backend="triton", page_size=16, max_num_seqs=8, enable_prefix_caching=False)
    with LLM(str(path), **settings) as llm:
        runner = llm.engine.executor.runner
        pieces = runner.piecewise_graphs
        assert pieces is not None and not pieces.emulate
        mixed = []
        replay = pieces.run
        pieces.run = lambda ids, ctx: mixed.append(ctx.num_decode_rows) or replay(ids, ctx)
        graphed = staggered(llm, prompts, params)
        assert any(mixed), "no decode rows beside a prefill went through the piecewise graphs"
        captured = runner.graphs, runner.prefill_graphs, runner.piecewise_graphs
        runner.graphs = runner.prefill_graphs = runner.piecewise_graphs = None
        eager = staggered(llm, prompts, params)
        runner.graphs, runner.prefill_graphs, runner.piecewise_graphs = captured
    for (gt, gl), (et, el) in zip(graphed, eager):
        assert gt == et
        for a, b in zip(el, gl):
            for t in a:
                assert b[t] == pytest.approx(a[t], abs=1e-4)
