"""Seeded synthetic traces in Mooncake's format, shaped like two workloads the shared trace does not show:
multi-turn chat behind a few long system prompts (:func:`gen_chat`) and tool-calling agents that re-send
a growing context (:func:`gen_agent`).  ``benchmarks/traces/README.md`` describes the committed ones.

    python -m tiered_kv.tools.tracegen chat|agent OUT [--requests 20000] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Optional, Sequence

from .tracetools import BLOCK_TOKENS, Request, TraceError, trace_stats, write_trace

__all__ = ["gen_chat", "gen_agent", "GENERATORS", "main"]


class _Ids:
    """Fresh block ids in order of first appearance (as Mooncake's remapped ids are)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


class _Context:
    """A growing prompt: the ids of its full blocks (stable while it grows) and its length in tokens.
    Each request re-sends the whole context; new full blocks and the partial last block get fresh ids
    (the partial one's content changes as the context grows, so its prefix hash does)."""

    __slots__ = ("stable", "tokens")

    def __init__(self, stable: list[int], tokens: int) -> None:
        self.stable = stable
        self.tokens = tokens

    def request(self, ids: _Ids, ts: int, output: int) -> Request:
        full, part = divmod(self.tokens, BLOCK_TOKENS)
        have = len(self.stable)
        if full > have:
            self.stable = self.stable + ids.take(full - have)
        out = self.stable[:full] + (ids.take(1) if part else [])
        return Request(ts, self.tokens, output, tuple(out))


def _check_gen(n_requests: int, seed: int) -> None:
    if type(n_requests) is not int or n_requests < 1:
        raise ValueError(f"n_requests must be a positive int, got {n_requests!r}")
    if type(seed) is not int:
        raise ValueError(f"seed must be an int, got {seed!r}")


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(rng.lognormvariate(math.log(median), sigma))))


def _shared_prefixes(rng: random.Random, n: int, lo_blocks: int, hi_blocks: int) -> list[tuple[int, list[int]]]:
    """``n`` shared prompts: (tokens, ids of their full blocks, given at first use)."""
    return [(rng.randint(lo_blocks * BLOCK_TOKENS, hi_blocks * BLOCK_TOKENS), []) for _ in range(n)]


def _prefix_start(ids: _Ids, prefix: tuple[int, list[int]]) -> _Context:
    tokens, stable = prefix
    full = tokens // BLOCK_TOKENS
    if not stable:
        stable.extend(ids.take(full))
    return _Context(list(stable), tokens)


def gen_chat(n_requests: int, seed: int) -> list[Request]:
    """A seeded multi-turn chat trace (Mooncake format, 512-token blocks).

    8 system prompts of 4-16 blocks (Zipf popularity: weight 1/rank); 256 sessions in flight,
    interleaved at random (each request advances a uniformly chosen one); each turn re-sends the
    conversation so far plus a user message (median 150 tokens; 8% pastes of 1.5k-8k), and its answer
    (median 250 tokens, at most 2k) joins the context for the next turn.  A session ends after each
    turn with probability 1/8, or when its context passes 24k tokens; a new one takes its place.  Poisson arrivals, mean 250 ms,
    integer ms timestamps strictly increasing."""
    _check_gen(n_requests, seed)
    rng = random.Random(f"chat/{seed}")
    ids = _Ids()
    prompts = _shared_prefixes(rng, 8, 4, 16)
    weights = [1.0 / (i + 1) for i in range(len(prompts))]

    def user() -> int:
        if rng.random() < 0.08:
            return rng.randint(1500, 8000)
        return _lognormal(rng, 150, 1.0, 5, 4000)

    def new_session() -> _Context:
        return _prefix_start(ids, rng.choices(prompts, weights)[0])

    sessions = [new_session() for _ in range(256)]
    out: list[Request] = []
    ts = 0
    for _ in range(n_requests):
        i = rng.randrange(len(sessions))
        s = sessions[i]
        s.tokens += user()
        answer = _lognormal(rng, 250, 0.8, 1, 2048)
        out.append(s.request(ids, ts, answer))
        s.tokens += answer
        if rng.random() < 1 / 8 or s.tokens > 24_000:
            sessions[i] = new_session()
        ts += max(1, round(rng.expovariate(1 / 250)))
    return out


def gen_agent(n_requests: int, seed: int) -> list[Request]:
    """A seeded agent (tool-calling loop) trace (Mooncake format, 512-token blocks).

    128 agents in flight, interleaved at random.  An agent's context starts with one of 4 long shared
    tool-description prefixes of 8-24 blocks (60% of agents, Zipf popularity) or a private system
    prompt of 1-4 blocks, then a task (200-3k tokens).  Each step re-sends the full context; the
    step's output (a tool call, median 120 tokens) and the tool's result (median 400 tokens; 10% file
    reads of 2k-8k) join the context.  An agent stops after each step with probability 1/25 or once
    its context passes 48k tokens; 5% of steps also fork a sub-agent that starts from the parent's
    context (sharing it as a prefix) with its own sub-task.  Poisson arrivals, mean 50 ms."""
    _check_gen(n_requests, seed)
    rng = random.Random(f"agent/{seed}")
    ids = _Ids()
    tools = _shared_prefixes(rng, 4, 8, 24)
    weights = [1.0 / (i + 1) for i in range(len(tools))]

    def new_agent() -> _Context:
        if rng.random() < 0.6:
            c = _prefix_start(ids, rng.choices(tools, weights)[0])
        else:
            c = _Context([], rng.randint(BLOCK_TOKENS, 4 * BLOCK_TOKENS))
        c.tokens += rng.randint(200, 3000)
        return c

    agents = [new_agent() for _ in range(128)]
    out: list[Request] = []
    ts = 0
    for _ in range(n_requests):
        i = rng.randrange(len(agents))
        a = agents[i]
        call = _lognormal(rng, 120, 0.7, 5, 1500)
        out.append(a.request(ids, ts, call))
        a.tokens += call
        a.tokens += rng.randint(2000, 8000) if rng.random() < 0.1 else _lognormal(rng, 400, 1.0, 10, 6000)
        if rng.random() < 0.05:   # a sub-agent from here: the parent's blocks so far are its prefix
            j = rng.randrange(len(agents))
            full = a.tokens // BLOCK_TOKENS
            if full > len(a.stable):
                a.stable = a.stable + ids.take(full - len(a.stable))
            if j != i:
                agents[j] = _Context(a.stable[:full], full * BLOCK_TOKENS + rng.randint(100, 1500))
        if rng.random() < 1 / 25 or a.tokens > 48_000:
            agents[i] = new_agent()
        ts += max(1, round(rng.expovariate(1 / 50)))
    return out


GENERATORS = {"chat": gen_chat, "agent": gen_agent}




def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiered_kv.tools.tracegen", description="write a seeded synthetic trace")
    p.add_argument("kind", choices=sorted(GENERATORS))
    p.add_argument("out", type=Path)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        reqs = GENERATORS[args.kind](args.requests, args.seed)
        write_trace(args.out, reqs)
    except (TraceError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(args.out), **trace_stats(reqs)}, indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
