"""The host-orchestrated PARSE of earlier versions, kept as the reference the fused device programs
(parse_jax/modes/) are tested against: numpy segmentation and packing (parse_jax/verify/host_segment.py,
tests/verify/layout_reference.py), one jitted program per phase (draft, verification pass, continuation) with host
steps between them. Greedy outputs must agree token for
token. It reads an engine's models and settings (`ReferenceParse(engine)`)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from parse_jax.distributed.sharded import ShardedModel
from parse_jax.errors import InputError
from parse_jax.runtime.decode import continue_program, generate
from parse_jax.runtime.programs import bucket, length_bucket, take_rows, to_host
from parse_jax.runtime.requests import GenerateResult, SamplingParams, encode_prompts, resolve_eos
from parse_jax.speculation.eagle3 import EagleContext, EagleLoop
from parse_jax.speculation.eagle3 import continue_program as eagle3_continue_program
from parse_jax.utils.validation import check_boundaries
from parse_jax.verify.scoring import accept
from parse_jax.verify.scoring import passes as clears_threshold
from tests.verify.layout_reference import pack, verify_pass


class _FlatConfig:
    """The engine's typed settings under the flat names this reference reads."""

    def __init__(self, cfg) -> None:
        self.__dict__.update(cfg.flat())


class ReferenceParse:
    """The reference path over an engine's models and settings."""

    def __init__(self, eng) -> None:
        self.config = _FlatConfig(eng.config.resolved())  # concrete rounds (the engine runs "auto" as multi)
        self.target, self.draft, self.eagle3 = eng.target, eng.draft, eng.eagle3
        self._verify = verify_pass
        self.suffix_ids, self.yes_id, self.no_id = eng.suffix_ids, eng.yes_id, eng.no_id
        self.eng = eng

    def boundaries(self, draft_ids):
        return self.eng.boundaries(draft_ids)

    def prefix_scores(self, context_ids: Sequence[int], draft_ids: Sequence[int],
                      boundaries: Sequence[int]) -> np.ndarray:
        """Judge score of each prefix draft[:b_k] after the context, from ONE target pass."""
        context, draft = [int(x) for x in context_ids], [int(x) for x in draft_ids]
        bounds = check_boundaries(boundaries, len(draft))
        self._check_ids(context + draft)
        c = len(context)
        block = pack(0, context + draft, [c + b for b in bounds], self.suffix_ids)
        length = bucket(block.length)
        cache = self.target.init_cache(1, length)
        out = self._verify(self.target, cache, [block], self.yes_id, self.no_id, length, bucket(len(bounds), 1))
        return out.scores[0, : len(bounds)].astype(np.float64)

    def _check_ids(self, ids: Sequence[int]) -> None:
        v = self.target.config.vocab_size
        bad = [t for t in ids if not 0 <= t < v]
        if bad:
            raise InputError(f"token ids outside [0, {v}): {bad[:5]}")

    # --- generation ---------------------------------------------------------------------------------------

    def generate(self, prompts, mode: str = "parse", max_new_tokens: int = 256, temperature: float = 0.0,
                 seed: int = 0, top_k: int = 0, top_p: float = 1.0) -> GenerateResult:
        sampling = SamplingParams(float(temperature), int(top_k), float(top_p), int(seed))
        ids = encode_prompts(self.target, prompts)
        if mode == "parse" and self.config.rounds == "multi":
            return self._parse_multi(ids, int(max_new_tokens), sampling)
        return self._verify_then_continue(ids, int(max_new_tokens), sampling, sequential=mode == "sequential",
                                          eagle=mode == "parse+eagle3")

    def _draft(self, contexts: list[list[int]], budget: int, sampling: SamplingParams) -> tuple[list[list[int]], float]:
        t0 = time.perf_counter()
        res = generate(self.draft, contexts, max_new_tokens=max(1, min(self.config.max_draft_tokens, budget)),
                       temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                       seed=sampling.seed, eos_ids=list(resolve_eos(self.target)))
        return res.tokens, time.perf_counter() - t0

    def _verify_then_continue(self, ids: list[list[int]], max_new: int, sampling: SamplingParams,
                              sequential: bool, eagle: bool = False) -> GenerateResult:
        """Single round: draft everything, verify (one pass, or one per segment), accept, continue (token by token,
        or with EAGLE-3 from the features of that same verification pass)."""
        drafts, t_draft = self._draft(ids, max_new, sampling)
        eos = resolve_eos(self.target)
        # a draft's closing EOS is not content to verify (the judge was never shown one): the target decides to stop,
        # from its next-token distribution at the accepted boundary
        drafts = [d[:-1] if len(d) > 1 and d[-1] in eos else d for d in drafts]
        bounds = [self.boundaries(d) for d in drafts]
        t0 = time.perf_counter()
        if sequential:
            accepted_b, cache, first_logits, passes, vtokens = self._verify_sequential(ids, drafts, bounds, max_new)
        else:
            accepted_b, cache, first_logits, passes, vtokens, out = self._verify_parallel(ids, drafts, bounds,
                                                                                          max_new, eagle)
        t_verify = time.perf_counter() - t0
        done_in_draft = [b > 0 and drafts[i][b - 1] in eos for i, b in enumerate(accepted_b)]
        remaining = np.array([0 if done_in_draft[i] else max(0, max_new - accepted_b[i]) for i in range(len(ids))]
                             + [0] * (cache.batch - len(ids)), np.int32)
        t0 = time.perf_counter()
        num_new = bucket(max_new, 16)
        cont, cont_n = np.zeros((cache.batch, num_new), np.int32), np.zeros(cache.batch, np.int32)
        cont_passes, extra = 0, {}
        if sampling.greedy:  # rows whose next token (from the verification pass) is EOS are finished: no decoding
            first = to_host(first_logits).argmax(-1)
            stop = np.isin(first, eos) & (remaining > 0)
            cont[stop, 0], cont_n[stop], remaining = first[stop], 1, np.where(stop, 0, remaining)
        rows, rem = self._continued_rows(remaining)
        if rows is not None:
            # only the rows that still have tokens to write are decoded, in the smallest batch bucket that holds them
            ctx = (cache, first_logits, out.tokens, out.features) if eagle else (cache, first_logits)
            if len(rows) < cache.batch:
                ctx = take_rows(ctx, rows)  # otherwise rows is every row, in order
            if eagle:
                head = self.eagle3
                loop = EagleLoop(config=head.config, gamma=self.config.eagle3_gamma, num_new=num_new,
                                 tree=self.config.eagle3_tree)
                program = eagle3_continue_program(self.target.config, self.target.attention_impl, loop,
                                                  sampling.sampler)
                c_cache, c_logits, c_tokens, c_feats = ctx
                start = EagleContext(tokens=c_tokens, features=c_feats, length=c_cache.lengths, first_logits=c_logits)
                toks, n_new, rounds, acc, prop = program(self.target.params, head.params, c_cache, start, rem, eos,
                                                         sampling.args(len(rem)))  # compared greedy: keys unread
                toks, n_new, cont_passes = to_host(toks), to_host(n_new), int(rounds)
                extra = {"eagle3_accepted_tokens": int(to_host(acc)[rem > 0].sum()),
                         "eagle3_draft_tokens": int(to_host(prop)[rem > 0].sum())}
            else:
                program = continue_program(self.target.config, self.target.attention_impl, num_new, sampling.sampler)
                state = program(self.target.params, *ctx, rem, eos, sampling.args(len(rem)))
                toks, n_new = to_host(state.tokens), to_host(state.num_new)
                cont_passes = int(state.step) - 1  # the first continuation token comes from verification
            live = rem > 0
            cont[rows[live]] = toks[live, :num_new]
            cont_n[rows[live]] = n_new[live]
        extra["continued_requests"] = int((remaining > 0).sum())
        extra["continue_batch"] = 0 if rows is None else len(rows)
        t_cont = time.perf_counter() - t0
        tokens = [drafts[i][: accepted_b[i]] + cont[i, : cont_n[i]].tolist() for i in range(len(ids))]
        stats = {**extra,
            "target_passes": passes + cont_passes,
            # passes summed over requests: each request sits through every verification pass, and through the
            # continuation's passes only when it was continued
            "request_passes": passes * len(ids) + cont_passes * extra["continued_requests"],
            "verify_passes": passes,
            "new_tokens": sum(len(t) for t in tokens),
            "draft_tokens": sum(len(d) for d in drafts),
            "accepted_tokens": int(sum(accepted_b)),
            "accepted_per_request": list(accepted_b),
            "prefixes_per_request": [len(b) for b in bounds],
            "verify_tokens": vtokens,
            "seconds_draft": t_draft, "seconds_verify": t_verify, "seconds_continue": t_cont,
            "seconds": t_draft + t_verify + t_cont,
        }
        stats["tokens_per_s"] = stats["new_tokens"] / stats["seconds"] if stats["seconds"] > 0 else float("inf")
        stats["accepted_per_pass"] = stats["accepted_tokens"] / max(passes, 1)
        texts = [self.target.tokenizer.decode(t) for t in tokens]
        return GenerateResult(texts=texts, tokens=tokens, stats=stats)

    def _continued_rows(self, remaining: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """(rows, their token budgets): the verified rows to continue, padded to a batch bucket with repeats of a
        live row whose budget is 0; rows is None when no row has tokens left. A sharded target keeps its whole batch
        (its rows are laid out over the `data` axis)."""
        live = np.flatnonzero(remaining > 0)
        if live.size == 0:
            return None, remaining[:0]
        if isinstance(self.target, ShardedModel) or bucket(live.size, 1) >= remaining.shape[0]:
            return np.arange(remaining.shape[0]), remaining
        pad = bucket(live.size, 1) - live.size
        rows = np.concatenate([live, np.full(pad, live[0])]).astype(np.int32)
        return rows, np.concatenate([remaining[live], np.zeros(pad, remaining.dtype)])

    def _verify_parallel(self, ids, drafts, bounds, max_new, taps: bool = False):
        """Prompt + draft + K suffix copies in ONE pass over an empty cache; commit prompt + accepted prefix."""
        blocks = [pack(0, p + d, [len(p) + x for x in b], self.suffix_ids) for p, d, b in zip(ids, drafts, bounds)]
        length = length_bucket(max(blk.length for blk in blocks))
        k_max = bucket(self.config.max_prefixes, 1)
        batch = bucket(len(ids), 1)
        # an EAGLE-3 continuation writes a chain (+ tree leaves) past the last token it may emit
        margin = 1 + (self.config.eagle3_gamma + self.config.eagle3_tree if taps else 0)
        cache_len = length_bucket(max(length, max(len(p) for p in ids) + max_new + margin))
        cache = self.target.init_cache(batch, cache_len)
        blocks = blocks + [pack(0, [0], [1], self.suffix_ids)] * (batch - len(ids))
        before = [len(p) - 1 for p in ids] + [0] * (batch - len(ids))
        out = self._verify(self.target, cache, blocks, self.yes_id, self.no_id, length, k_max, before,
                          taps=self.eagle3.config.taps if taps else ())
        valid = ~np.isnan(out.scores)
        idx = accept(np.nan_to_num(out.scores), valid, self.config.threshold, self.config.policy)
        accepted_b = [bounds[i][idx[i]] if idx[i] >= 0 else 0 for i in range(len(ids))]
        take = np.where(idx >= 0, idx, k_max)  # k_max: the context's own last token
        first_logits = out.boundary_logits[np.arange(batch), take]
        lengths = np.array([len(p) + b for p, b in zip(ids, accepted_b)] + [1] * (batch - len(ids)), np.int32)
        vtokens = int(sum(b.length for b in blocks[: len(ids)]))
        return accepted_b, out.cache.set_lengths(lengths), first_logits, 1, vtokens, out

    def _verify_sequential(self, ids, drafts, bounds, max_new):
        """SpecReason-style: prefill the prompt, then one target pass per segment (segment + suffix)."""
        batch = bucket(len(ids), 1)
        seg_max = max(max(np.diff([0] + b)) for b in bounds)
        length = length_bucket(seg_max + len(self.suffix_ids))
        p_max = length_bucket(max(len(p) for p in ids))
        cache_len = length_bucket(max(p_max + max(len(d) for d in drafts) + length, p_max + max_new + 1))
        cache = self.target.init_cache(batch, cache_len)
        rows = list(ids) + [[0]] * (batch - len(ids))
        prompt_blocks = [pack(0, p, [len(p)], self.suffix_ids) for p in rows]
        # the prefill pass also scores the empty prefix, which nothing reads; it gives the context's logits
        plen = length_bucket(max(b.length for b in prompt_blocks))
        out = self._verify(self.target, cache, prompt_blocks, self.yes_id, self.no_id, plen, 1,
                          [len(p) - 1 for p in rows])
        cache = out.cache.commit(np.array([len(p) for p in rows], np.int32))
        first_logits = out.boundary_logits[:, 1]
        passes, vtokens = 1, sum(b.length for b in prompt_blocks[: len(ids)])
        accepted_b = [0] * len(ids)
        stopped = [False] * len(ids)
        policy_longest = self.config.policy == "longest_valid"
        for k in range(max(len(b) for b in bounds)):
            active = [i for i in range(len(ids)) if not stopped[i] and k < len(bounds[i])]
            if not active:
                break
            blocks, seg_lens = [], []
            lengths = to_host(cache.lengths)
            for i in range(batch):
                if i in active:
                    start = bounds[i][k - 1] if k else 0
                    seg = drafts[i][start: bounds[i][k]]
                    blocks.append(pack(int(lengths[i]), seg, [len(seg)], self.suffix_ids))
                    seg_lens.append(len(seg))
                else:
                    blocks.append(pack(int(lengths[i]), [0], [1], self.suffix_ids))
                    seg_lens.append(0)
            out = self._verify(self.target, cache, blocks, self.yes_id, self.no_id, length, 1)
            passes += 1
            vtokens += sum(blocks[i].length for i in active)
            ok = clears_threshold(out.scores[:, 0], self.config.threshold)
            commit = np.array([seg_lens[i] if i in active else 0 for i in range(batch)], np.int32)
            cache = out.cache.commit(commit)
            for i in active:
                if ok[i]:
                    accepted_b[i] = bounds[i][k]
                    first_logits = first_logits.at[i].set(out.boundary_logits[i, 0])
                elif not policy_longest:
                    stopped[i] = True
        # roll back whatever was committed past the accepted prefix (a failed segment, or longest_valid's tail)
        lengths = np.array([len(p) + b for p, b in zip(ids, accepted_b)] + [1] * (batch - len(ids)), np.int32)
        return accepted_b, cache.set_lengths(lengths), first_logits, passes, vtokens

    def _parse_multi(self, ids: list[list[int]], max_new: int, sampling: SamplingParams) -> GenerateResult:
        """Multi round: draft, verify over the target's cache, accept, the target writes one segment, repeat.

        The target's cache carries over between rounds. The last token the target emitted is not in its
        cache yet, so each verification block starts with it (boundaries shift by one)."""
        n, batch = len(ids), bucket(len(ids), 1)
        cfg, eos = self.config, resolve_eos(self.target)
        seg_stop = np.array(sorted(set(eos.tolist()) | set(self.eng.step_end_ids.tolist())), np.int32)
        k_max = bucket(cfg.max_prefixes, 1)
        block_max = bucket(1 + cfg.max_draft_tokens + k_max * len(self.suffix_ids))
        p_max = max(len(p) for p in ids)
        cache = self.target.init_cache(batch, bucket(p_max + max_new + block_max + 1))
        # prefill all but each prompt's last token; that one opens the first verification block
        rows = list(ids) + [[0]] * (batch - n)
        width = bucket(max(len(p) for p in rows))
        prefill = [pack(0, p[:-1] or [0], [max(len(p) - 1, 1)], self.suffix_ids) for p in rows]
        out = self._verify(self.target, cache, prefill, self.yes_id, self.no_id, bucket(width + len(self.suffix_ids)),
                          1)
        cache = out.cache.commit(np.array([len(p) - 1 for p in rows], np.int32))
        last = [p[-1] for p in rows]
        outs: list[list[int]] = [[] for _ in range(n)]
        done = [False] * n
        stats = {"target_passes": 1, "verify_passes": 0, "draft_tokens": 0, "accepted_tokens": 0, "rounds": 0,
                 "verify_tokens": 0, "seconds_draft": 0.0, "seconds_verify": 0.0, "seconds_continue": 0.0}
        seg_budget = bucket(cfg.max_segment, 16)
        program = continue_program(self.target.config, self.target.attention_impl, seg_budget, sampling.sampler)
        while not all(done):
            stats["rounds"] += 1
            active = [i for i in range(n) if not done[i]]
            budget = max(1, min(cfg.max_draft_tokens, max(max_new - len(outs[i]) for i in active)))
            drafts_active, t = self._draft([ids[i] + outs[i] for i in active], budget, sampling)
            stats["seconds_draft"] += t
            drafts = {i: d[: max(1, max_new - len(outs[i]))] for i, d in zip(active, drafts_active)}
            # a closing EOS is not verified: the target's next token decides to stop
            drafts = {i: d[:-1] if len(d) > 1 and d[-1] in eos else d for i, d in drafts.items()}
            lengths = to_host(cache.lengths)
            blocks, bounds = [], {}
            for i in range(batch):
                if i in drafts:
                    bounds[i] = self.boundaries(drafts[i])
                    blocks.append(pack(int(lengths[i]), [last[i]] + drafts[i], [1 + b for b in bounds[i]],
                                       self.suffix_ids))
                else:
                    blocks.append(pack(int(lengths[i]), [last[i]], [1], self.suffix_ids))
            t0 = time.perf_counter()
            res = self._verify(self.target, cache, blocks, self.yes_id, self.no_id, block_max, k_max, [0] * batch)
            stats["seconds_verify"] += time.perf_counter() - t0
            stats["target_passes"] += 1
            stats["verify_passes"] += 1
            stats["verify_tokens"] += sum(blocks[i].length for i in drafts)
            stats["draft_tokens"] += sum(len(d) for d in drafts.values())
            valid = ~np.isnan(res.scores)
            idx = accept(np.nan_to_num(res.scores), valid, cfg.threshold, cfg.policy)
            commit = np.zeros(batch, np.int32)
            remaining = np.zeros(batch, np.int32)
            for i in active:
                b = bounds[i][idx[i]] if idx[i] >= 0 else 0
                outs[i] += drafts[i][:b]
                stats["accepted_tokens"] += b
                commit[i] = 1 + b
                if (b and drafts[i][b - 1] in eos) or len(outs[i]) >= max_new:
                    done[i] = True
                else:
                    remaining[i] = min(cfg.max_segment, max_new - len(outs[i]))
            take = np.where(idx >= 0, idx, k_max)
            first_logits = res.boundary_logits[np.arange(batch), take]
            cache = res.cache.commit(commit)
            if not remaining.any():
                break
            t0 = time.perf_counter()
            state = program(self.target.params, cache, first_logits, remaining, seg_stop,
                            sampling.args(batch))  # the reference is compared greedy: keys unread
            cont, cont_n = to_host(state.tokens), to_host(state.num_new)
            stats["seconds_continue"] += time.perf_counter() - t0
            stats["target_passes"] += int(state.step) - 1
            cache = state.cache
            for i in active:
                if remaining[i] == 0:
                    continue
                seg = cont[i, : cont_n[i]].tolist()
                outs[i] += seg
                last[i] = seg[-1]
                if seg[-1] in eos or len(outs[i]) >= max_new:
                    done[i] = True
        stats["new_tokens"] = sum(len(o) for o in outs)
        stats["seconds"] = stats["seconds_draft"] + stats["seconds_verify"] + stats["seconds_continue"]
        stats["tokens_per_s"] = stats["new_tokens"] / stats["seconds"] if stats["seconds"] > 0 else float("inf")
        stats["accepted_per_pass"] = stats["accepted_tokens"] / max(stats["verify_passes"], 1)
        return GenerateResult(texts=[self.target.tokenizer.decode(o) for o in outs], tokens=outs, stats=stats)
