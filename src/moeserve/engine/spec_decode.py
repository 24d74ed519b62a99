"""Speculative decoding on the last (only) stage: score a step's drafts with the target, accept
them (``spec_accept``), then let the MTP layer propose the next drafts.

One step of a decoding sequence with drafts ``d1 .. dk`` is a row of ``k + 1`` tokens (its last
accepted token and the drafts; attention's verify rows); the target's logits
at all ``k + 1`` positions decide how many are accepted. The MTP layer then runs over every
position of the step whose next token is now known (a prompt chunk's positions, and a decode
row's positions up to its last accepted one), writing its own KV cache at the target's slots, and
its output at a sampling row's last position gives the first draft of the next step; further
drafts chain the layer on itself, one token per row at a time, at the positions after (their KV
is written again, from the target's hidden states, when the target has scored them).

Reads its results back at once (no asynchronous scheduling): where every row verifies its full
k drafts, the MTP layer drafts on the device before anything is read, and the step reads back
once (``_verify_and_draft_on_device``); otherwise the acceptance is read before the drafting.
CUDA graphs: a step whose rows all verify k drafts replays a whole-step verify graph
(``DecodeGraphs(tokens_per_row=k + 1)``: the hidden state and the logits of every position);
other steps the piecewise graphs (``engine/piecewise_graph.py``, cut at attention; the
whole-step decode and prefill graphs keep only the sampled rows' logits, not the hidden states
of every position that the drafter reads); the MTP layer's passes replay piecewise graphs of
their own, over its own KV pool with a scratch page of its own (``MTPDrafter.graphs``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moeserve.cache.kv_pool import StageKVPool
from moeserve.device_copy import to_device
from moeserve.distributed.tp_collectives import TPGroup, tp_group
from moeserve.step_context import StepContext, step_context
from moeserve.engine.logit_adjust import adjusted_logits
from moeserve.engine.mtp_draft_graphs import MTPDraftGraphs, draft_after_verify, kept_drafts
from moeserve.engine.piecewise_graph import PiecewiseGraphs
from moeserve.engine.sampler import DeviceSample, SampleResult, prompt_logprobs_on_device
from moeserve.engine.spec_accept import accept_on_device, read_acceptance
from moeserve.engine.step_input import StepInput
from moeserve.loader import load_model_weights
from moeserve.models import build_defaults
from moeserve.models.deepseek_mtp import DeepseekMTP
from moeserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from moeserve.engine.config import SpeculativeConfig
    from moeserve.engine.eagle3_drafter import Eagle3Drafter
    from moeserve.engine.model_runner import ModelRunner

log = logging.getLogger("moeserve")

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)  # a row whose sampler state failed


class MTPDrafter:
    """The MTP layer of the checkpoint beside the target, with its own one-layer KV pool."""

    kv_layers = 1  # its layer in the paged KV cache

    def __init__(self, runner: ModelRunner, num_speculative_tokens: int):
        self.k = num_speculative_tokens
        # A last pipeline stage after the first has no embedding: it reads the MTP layer's own copy
        # of the embedding and lm_head (DeepSeek-V3 checkpoints hold them).
        with build_defaults(runner.device, runner.dtype):  # on the target's device, in its dtype
            self.model = DeepseekMTP(runner.model_config, runner.model if runner.is_first else None)
        self.model.eval()
        cfg = runner.config
        load_model_weights(self.model, cfg.model, cfg.load_format, cfg.seed, runner.device)
        self.pool: StageKVPool | None = None
        self.graphs: PiecewiseGraphs | None = None  # of the MTP layer (``capture_graphs``), or None: eager
        self.verify_graphs: MTPDraftGraphs | None = None  # its drafts after a replayed verify step
        log.info(
            "speculative decoding: the MTP layer drafts %d token(s) a step (async scheduling off; "
            "the target's steps and the MTP layer's passes through piecewise CUDA graphs where captured)",
            self.k,
        )

    def make_pool(self, runner: ModelRunner, num_pages: int) -> None:
        self.model.bind(None, runner.backend)
        self.pool = None
        self.pool = StageKVPool(runner.model_config, self.model.stage, num_pages, runner.page_size, runner.dtype, runner.device)
        self.model.bind(self.pool, runner.backend)

    def capture_graphs(self, runner: ModelRunner, sizes: list[int], mempool) -> None:
        """The MTP layer's passes (the first over the step's known positions, the chained), over its
        own KV pool, its scratch page at the same index as the target's."""
        self.graphs = PiecewiseGraphs(
            runner, sizes, scratch_page=runner.num_pages, mempool=mempool, emulate=runner.emulate_graphs, drafter=self
        )
        self.graphs.capture()
        if runner.verify_graphs is not None:  # the drafts of a verify step, over its graphs' buffers
            self.verify_graphs = MTPDraftGraphs(runner, runner.verify_graphs, emulate=runner.emulate_graphs)
            self.verify_graphs.capture()

    def propose(
        self, runner: ModelRunner, step: StepInput, ids: torch.Tensor, ctx: StepContext, hidden: torch.Tensor, result: SampleResult
    ) -> list[list[int]]:
        """``ids`` (the step's input ids) are the drafters' common interface: EAGLE-3 reads them,
        the MTP layer reads the next tokens (``step.next_token_ids``) instead."""
        # (steps that only prefill run it too: a middle chunk's positions need their MTP KV)
        return _propose(runner, step, ctx, hidden, result)


def make_drafter(runner: ModelRunner, spec: SpeculativeConfig) -> MTPDrafter | Eagle3Drafter:
    """The drafter of ``spec.method`` (both: ``kv_layers``, ``make_pool``, ``capture_graphs``, ``propose``)."""
    if spec.method == "eagle3":
        from moeserve.engine.eagle3_drafter import Eagle3Drafter

        return Eagle3Drafter(runner, spec)
    return MTPDrafter(runner, spec.num_speculative_tokens)


@torch.inference_mode()
def run_speculative_step(
    runner: ModelRunner,
    step: StepInput,
    prepared: tuple[torch.Tensor, StepContext] | None = None,
    hidden_in: torch.Tensor | None = None,
    residual_in: torch.Tensor | None = None,
) -> SampleResult:
    """The (last) stage's forward, acceptance of the drafts, and the next drafts: the step's
    result, ``counts[r]`` tokens for sampling row r (flat in ``token_ids``) and ``drafts[r]``.
    ``prepared``: ``runner.prepare(step)`` if done; ``hidden_in``/``residual_in``: the previous
    pipeline stage's activations."""
    ids, ctx = prepared if prepared is not None else runner.prepare(step)
    pieces = runner.piecewise_graphs  # None on pipeline stages and eager runners
    verify = runner.verify_graphs
    prompt = None
    graphed = hidden_in is None and ctx.prompt_logprobs is None
    every_position = step.logits_indices == list(range(len(step.input_ids)))  # each token's logits, in order
    replayed = graphed and verify is not None and every_position and verify.can_run(ctx)
    if replayed:
        # every row a token and its k drafts, every position's logits: one whole-step replay
        # (static outputs, read before any other replay of it: the drafter's are its own)
        hidden, logits = verify.run(ids, ctx)
    elif graphed and pieces is not None and pieces.can_run(ctx):
        # The graphs' static output: read (the logits' rows, the drafter's positions) before any
        # other replay; the drafter's own forwards replay none of the target's graphs.
        hidden = pieces.run_hidden(ids, ctx)
        with step_context(ctx):
            logits = runner.model.compute_logits(hidden[ctx.logits_indices]) if step.sample_seq_ids else None
    else:
        with step_context(ctx):
            hidden, _ = runner.model(ids, ctx.positions, hidden_in, residual_in)
            if ctx.prompt_logprobs is not None:
                prompt = prompt_logprobs_on_device(runner.model.compute_logits, hidden, ctx.prompt_logprobs, runner.model_config.vocab_size)
            logits = runner.model.compute_logits(hidden[ctx.logits_indices]) if step.sample_seq_ids else None
    if logits is not None and prompt is None and every_position and _drafts_on_device(runner, step, ctx):
        return _verify_and_draft_on_device(runner, step, ctx, hidden, logits, replayed)
    result = SampleResult([], [], [], counts=[], drafts=[])
    if logits is not None:
        tp = tp_group()
        if tp.rank == 0:
            result = _accept(runner, step, logits)
        if tp.size > 1:  # the MTP forward runs on every TP rank: each needs the accepted tokens
            result = _share_acceptance(result, len(step.sample_seq_ids), runner.device, tp)
    # (EAGLE-3's draft also reads the steps that only prefill)
    result.drafts = runner.drafter.propose(runner, step, ids, ctx, hidden, result)
    if prompt is not None:
        result.prompt_logprobs = prompt.result(prompt.packed.cpu())
    return result


def _drafts_on_device(runner: ModelRunner, step: StepInput, ctx: StepContext) -> bool:
    """Whether the step's drafting can follow its acceptance on the device, with one read-back
    at the end: one process, the MTP layer, every row a sampling sequence's token and its full
    k drafts (each row's MTP pass then covers all its positions, so its shape is known before
    the acceptance), and a scratch page for the positions a row has no page for."""
    drafter = runner.drafter
    return (
        isinstance(drafter, MTPDrafter)
        and runner.use_graphs
        and tp_group().size == 1
        and ctx.num_verify_rows == ctx.num_seqs
        and ctx.query_lens[0] == drafter.k + 1
        and len(step.sample_seq_ids) == ctx.num_seqs
    )


def _verify_and_draft_on_device(
    runner: ModelRunner, step: StepInput, ctx: StepContext, hidden: torch.Tensor, logits: torch.Tensor, replayed: bool
) -> SampleResult:
    """Acceptance, the MTP layer's pass over every position and its chained drafts
    (``mtp_draft_graphs.draft_after_verify``), all enqueued before anything is read back; then one
    read-back of the acceptance, the logprobs and the drafts. ``replayed``: the target's verify
    graphs ran this step, so the drafts replay the MTP layer's graphs over their buffers."""
    drafter: MTPDrafter = runner.drafter
    k, B = drafter.k, ctx.num_seqs
    scored = _score(runner, step, logits)
    accepted = scored.accept.view(B, k + 1)[:, :k].long().cumprod(1).sum(1)  # [B] drafts accepted, on the device
    page_counts = [len(t) for t in step.page_tables]
    if replayed and drafter.verify_graphs is not None:
        drafted = drafter.verify_graphs.run(scored.tokens, accepted, page_counts)
    else:
        pages = to_device(page_counts, runner.device)
        drafted = draft_after_verify(runner, ctx, scored.tokens, hidden, accepted, pages, drafter.graphs)
    rows = scored.host_rows()
    host = torch.cat([rows.flatten(), drafted.double().flatten()]).cpu()  # the step's one read-back
    result = scored.result(host[: rows.numel()].view(rows.shape))
    result.drafts = host[rows.numel() :].view(B, k).long().tolist()
    kept_drafts(result.drafts, result.counts, step.context_lens, page_counts, k, ctx.page_size)
    return result


def _share_acceptance(result: SampleResult, rows: int, device: torch.device, tp: TPGroup) -> SampleResult:
    """TP rank 0 (which accepted) sends each row's count and tokens to its peers, which keep only
    those (TP rank 0 alone reports the step's result)."""
    import torch.distributed as dist

    src = dist.get_global_rank(tp.group, 0)
    counts = torch.tensor(result.counts if tp.rank == 0 else [0] * rows, dtype=torch.long, device=device)
    dist.broadcast(counts, src=src, group=tp.group)
    count_list = counts.tolist()
    tokens = torch.tensor(result.token_ids if tp.rank == 0 else [0] * sum(count_list), dtype=torch.long, device=device)
    dist.broadcast(tokens, src=src, group=tp.group)
    if tp.rank == 0:
        return result
    return SampleResult(tokens.tolist(), [], [], counts=count_list, drafts=[])


@dataclass
class _Scored:
    """A step's acceptance and logprobs on the device, not yet read back."""

    drafts: list[list[int]]
    accept: torch.Tensor  # [N] bool: the draft after each flat position is accepted
    tokens: torch.Tensor  # [N] the token each flat position emits if reached
    packed: torch.Tensor  # [2 (+ 2 top_n), N] float64: tokens, their logprobs (and the top-N)
    want: list[int | None]
    top_n: int | None
    errors: dict[int, str]

    def host_rows(self) -> torch.Tensor:
        """What the host reads: the packed rows, then the acceptance flags as a last row."""
        return torch.cat([self.packed, self.accept.double()[None]])

    def result(self, host: torch.Tensor) -> SampleResult:
        """Each row's emitted tokens and logprobs from ``host_rows()`` read back."""
        flat = DeviceSample(self.tokens, self.packed, self.want, self.top_n).result(host[:-1])
        acc = read_acceptance(self.drafts, host[-1].bool().tolist(), host[0].tolist(), self.tokens)
        out = SampleResult([], [], [], errors=self.errors, counts=[], drafts=[])
        for toks, positions in zip(acc.tokens, acc.positions):
            out.token_ids.extend(toks)
            out.logprobs.extend(flat.logprobs[i] for i in positions)
            out.sampled_logprobs.extend(flat.sampled_logprobs[i] for i in positions)
            out.counts.append(len(toks))
        return out


def _accept(runner: ModelRunner, step: StepInput, logits: torch.Tensor) -> SampleResult:
    scored = _score(runner, step, logits)
    # one read-back for the acceptance and the logprobs
    return scored.result(scored.host_rows().cpu())


def _score(runner: ModelRunner, step: StepInput, logits: torch.Tensor) -> _Scored:
    drafts = step.draft_tokens or [[] for _ in step.sample_seq_ids]
    gens, errors = runner.sampling.row_generators(step)
    params = [_GREEDY if j in errors else p for j, p in enumerate(step.sample_params)]
    # Each position's penalties count the drafts before it as output (as the sampler would have,
    # had they been sampled one step at a time).
    flat_params: list[SamplingParams] = []
    flat_output: list[list[int] | None] = []
    output_ids = step.sample_output_ids or [None] * len(params)
    for p, known, d in zip(params, output_ids, drafts):
        for j in range(len(d) + 1):
            flat_params.append(p)
            flat_output.append(None if known is None else known + d[:j])
    adjusted = adjusted_logits(logits, flat_params, flat_output, [], None)
    accept, tokens = accept_on_device(logits if adjusted is None else adjusted, drafts, params, gens)
    # logprobs (of the raw distribution, as the sampler reports them) of every position's token
    want = [p.logprobs for p in flat_params]
    top_n = max((n for n in want if n is not None), default=None)
    if top_n is not None:
        top_n = min(top_n, logits.shape[-1])
    logp = torch.log_softmax(logits, dim=-1)
    cols = [tokens.double(), logp.gather(1, tokens[:, None]).squeeze(1).double()]
    if top_n:
        vals, top_ids = logp.topk(top_n, dim=-1)
        cols += [top_ids.double().T, vals.double().T]
    packed = torch.cat([c.reshape(-1, logits.shape[0]) for c in cols])
    return _Scored(drafts, accept, tokens, packed, want, top_n, errors)


def _propose(runner: ModelRunner, step: StepInput, ctx: StepContext, hidden: torch.Tensor, result: SampleResult) -> list[list[int]]:
    """The MTP layer over the step's positions whose next token is known, then chained: up to
    ``k`` drafts per sampling row."""
    drafter: MTPDrafter = runner.drafter
    dev = runner.device
    drafts = step.draft_tokens or [[] for _ in step.sample_seq_ids]
    input_ids = step.input_ids
    keep: list[int] = []  # flat target positions the MTP layer runs at
    next_ids: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    last_rows: list[int] = []  # its flat index of each sampling row's last kept position
    at, r, emitted = 0, 0, 0
    for i, n in enumerate(step.query_lens):
        if step.next_token_ids[i] >= 0:  # a chunk whose next token is a known prompt token
            valid, tail = n, step.next_token_ids[i]
        else:
            count = result.counts[r]
            valid = n - len(drafts[r]) + count - 1  # its drafts' positions after the accepted ones are dropped
            tail = result.token_ids[emitted + count - 1]
            emitted += count
            r += 1
        keep.extend(range(at, at + valid))
        next_ids.extend(input_ids[at + 1 : at + valid])
        next_ids.append(tail)
        query_lens.append(valid)
        context_lens.append(step.context_lens[i] - (n - valid))
        if step.next_token_ids[i] < 0:
            last_rows.append(len(keep) - 1)
        at += n
    keep_t = to_device(keep, dev)
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    mtp_ctx = StepContext(
        positions=ctx.positions[keep_t],
        slot_mapping=ctx.slot_mapping[keep_t],
        query_lens=query_lens,
        context_lens=context_lens,
        page_tables=ctx.page_tables,
        cu_query_lens=to_device(cu, dev, torch.int32),
        logits_indices=to_device(last_rows, dev, torch.int64),  # (empty in a step that only prefills)
        page_size=ctx.page_size,
        context_lens_tensor=to_device(context_lens, dev, torch.int32),
    )
    mtp_ctx.attn_metadata = runner.backend.prepare(mtp_ctx)
    model = drafter.model
    pieces = drafter.graphs  # (its output is a static buffer: rows are gathered from it before the next replay)
    with step_context(mtp_ctx):
        if pieces is not None and keep and pieces.can_run(mtp_ctx):
            out = pieces.run_hidden(to_device(next_ids, dev), mtp_ctx, hidden[keep_t])
        else:
            out = model(to_device(next_ids, dev), mtp_ctx.positions, hidden[keep_t])
        last_hidden = out[mtp_ctx.logits_indices]
        tokens = model.compute_logits(last_hidden).argmax(dim=-1)
    # The drafts stay on the device until the chain ends: one read-back for all k of them (the
    # chain's inputs are the device tokens; which rows go on depends on their pages alone).
    drafted = [tokens]
    # Chain: one token per sampling row at the position after its newest one, while its pages last.
    sample_rows = [i for i, nxt in enumerate(step.next_token_ids) if nxt < 0]  # batch row of sampling row r
    active = list(range(len(sample_rows)))
    chained: list[list[int]] = []  # the sampling rows of each chained draft
    pos = [context_lens[i] for i in sample_rows]  # where each sampling row's next draft goes
    ps = runner.page_size
    for _ in range(drafter.k - 1):
        live = [j for j, r in enumerate(active) if pos[r] // ps < len(step.page_tables[sample_rows[r]])]
        if not live:
            break
        live_t = to_device(live, dev)
        tokens, last_hidden = tokens[live_t], last_hidden[live_t]
        active = [active[j] for j in live]
        rows = [sample_rows[r] for r in active]
        at_pos = [pos[r] for r in active]
        slots = [step.page_tables[i][p // ps] * ps + p % ps for i, p in zip(rows, at_pos)]
        lens = [p + 1 for p in at_pos]
        chain_ctx = StepContext(
            positions=to_device(at_pos, dev),
            slot_mapping=to_device(slots, dev),
            query_lens=[1] * len(rows),
            context_lens=lens,
            page_tables=ctx.page_tables[to_device(rows, dev)],
            cu_query_lens=to_device(list(range(len(rows) + 1)), dev, torch.int32),
            logits_indices=to_device(list(range(len(rows))), dev),
            page_size=ps,
            context_lens_tensor=to_device(lens, dev, torch.int32),
        )
        chain_ctx.attn_metadata = runner.backend.prepare(chain_ctx)
        with step_context(chain_ctx):
            if pieces is not None and pieces.can_run(chain_ctx):
                last_hidden = pieces.run_hidden(tokens, chain_ctx, last_hidden)
            else:
                last_hidden = model(tokens, chain_ctx.positions, last_hidden)
            tokens = model.compute_logits(last_hidden).argmax(dim=-1)
        drafted.append(tokens)
        chained.append(active)
        for r in active:
            pos[r] += 1
    values = torch.cat(drafted).tolist()
    proposals = [[t] for t in values[: len(sample_rows)]]
    at = len(sample_rows)
    for rows_of_step in chained:
        for r, t in zip(rows_of_step, values[at : at + len(rows_of_step)]):
            proposals[r].append(t)
        at += len(rows_of_step)
    return proposals


__all__ = ["MTPDrafter", "make_drafter", "run_speculative_step"]
