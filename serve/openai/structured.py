"""Structured output for the HTTP server: grammars (llguidance) that mask each step's tokens before sampling.

Why llguidance (compared, all three on PyPI): xgrammar installs torch, transformers and triton (its pip
requirements), which the JAX- and torch-free serving process may not import; outlines-core needs a vocabulary of
decoded token strings (byte-level BPE tokens mapped back to bytes by the caller) and compiles a regex to a
DFA over the vocabulary up front, with no context-free grammars for a tool call's wrapper; llguidance reads the
artifact's tokenizer.json as it is, has no dependencies, takes JSON schemas, regexes, choices and Lark grammars
(with JSON schemas inside them), parses lazily (an Earley parser, no DFA blow-up on nested schemas), fills a
packed bitmask (the same 32-bit words the body's TOKEN_MASK takes), releases the GIL while it works, and bounds
its own work (LLParserLimits: the items of a parser row, the lexer's fuel per step, the grammar's size).

Admission (`Grammars.constraints`, on the grammar thread, never on the event loop): a request's grammar is
compiled once and its matcher copied for each of the request's sequences. Before any page is taken it is checked
as far as llguidance can tell, and refused (GrammarError, a 400 naming the limit or the cause) when it does not
compile, passes one of the limits (or compiles for longer than the budget), admits no text at all, fails on one
of its first tokens, or cannot give min_tokens tokens before a stop id.

Running: after each token a sequence's matcher advances and computes its next mask on StepWork's thread
(serve/loop.py) while the engine steps the others; a slow grammar delays its own sequence. A matcher that fails
there (a limit reached deep into the text, or more CPU time for one token than the budget allows) ends its own
sequence with that error (Constraint.failure).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import time
from dataclasses import dataclass

import numpy as np

from tlaloc_jax.artifact import mask_words

from ..engine import Constraint
from ..loop import StepWork

# A choice is a regex alternation of literals (llguidance's lexer, not a parser row per option: a row holds at
# most max_items_in_row items). These characters are escaped (the Rust regex crate's meta characters).
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
# llguidance's words for a language with no text in it (a grammar whose rules never end).
_NO_TEXT = ("NoExtension", "NoExtensionBias")


@dataclass(frozen=True)
class GrammarBudget:
    """What one request's grammar may cost. compile_seconds: compiling and checking it at admission;
    token_seconds: the CPU time of advancing one sequence past one token (its next mask); max_grammar_size and
    max_items_in_row: llguidance's limits (symbols in the grammar's productions; items of a parser row, a bound on
    a step's work); probe_tokens: first tokens each tried on a copy of the matcher; probe_nodes and probe_seconds:
    the search for min_tokens tokens before a stop id. llguidance's other limits (the lexer's fuel, items per step)
    keep their defaults."""

    compile_seconds: float = 10.0
    token_seconds: float = 0.25
    max_grammar_size: int = 500_000
    max_items_in_row: int = 2000
    probe_tokens: int = 32
    probe_nodes: int = 512
    probe_seconds: float = 1.0


class GrammarError(ValueError):
    """A grammar, schema or regex refused at admission; the message names why. code: the API's error code;
    param: the field at fault when it is not the one that asked for the grammar (min_tokens)."""

    def __init__(self, message: str, code: str = "invalid_grammar", param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _why(matcher) -> str:
    """llguidance's error, without its non-verbose marker."""
    return matcher.get_error().replace("<non-verbose/>", "").strip() or str(matcher.stop_reason())


class Grammars:
    """Compiles requests' structured-output specs into matchers over one tokenizer, on its own thread."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_token_ids, steps: StepWork,
                 budget: GrammarBudget = GrammarBudget(), workers: int = 2):
        import llguidance
        self._llg = llguidance
        self.eos = tuple(sorted(int(t) for t in eos_token_ids if 0 <= int(t) < vocab))
        self.vocab = vocab
        self.steps = steps
        self.budget = budget
        try:
            self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=list(self.eos) or None)
        except ValueError:
            # llguidance checks an eos id against the tokenizer's count of tokens, not its largest id (a vocabulary
            # with gaps fails): its own eos stands for ours, translated in `words`.
            self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab)
        self.grammar_eos = self.tokenizer.eos_token
        # Errors without the grammar's text in them (verbose errors echo the whole grammar).
        self.limits = llguidance.LLParserLimits(max_grammar_size=budget.max_grammar_size,
                                                max_items_in_row=budget.max_items_in_row, verbose_errors=False)
        in_vocab = np.zeros(mask_words(vocab) * 32, bool)
        in_vocab[:vocab] = True
        self._in_vocab = np.packbits(in_vocab, bitorder="little").view(np.uint32)
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="tlaloc-grammar")

    def grammar(self, kind: str, spec) -> str:
        """An llguidance grammar for kind "json" (a JSON schema: dict, or True for any JSON object), "regex",
        "choice" (a list of strings) or "lark"; GrammarError for a schema llguidance cannot read."""
        M = self._llg.LLMatcher
        try:
            if kind == "json":
                schema = {"type": "object"} if spec is True else spec
                return M.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
            if kind == "regex":
                return M.grammar_from_regex(spec)
            if kind == "choice":
                return M.grammar_from_regex("|".join(f"({_regex_literal(c)})" for c in spec))
            if kind == "lark":
                return M.grammar_from_lark(spec)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"the grammar does not compile: {e}") from None
        raise GrammarError(f"unknown grammar kind {kind!r}")

    async def constraints(self, kind: str, spec, count: int, stop_ids=(), min_tokens: int = 0
                          ) -> list["GrammarConstraint"]:
        """`prepare`, on the grammar thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.prepare, kind, spec, count,
                                                                frozenset(stop_ids), min_tokens)

    def prepare(self, kind: str, spec, count: int, stop_ids=frozenset(), min_tokens: int = 0
                ) -> list["GrammarConstraint"]:
        """Compile and check a grammar (see the module's doc), then one matcher for each of `count` sequences
        (copies of the one compiled); GrammarError naming the cause if it is refused."""
        t0 = time.perf_counter()
        matcher = self._llg.LLMatcher(self.tokenizer, self.grammar(kind, spec), log_level=0, limits=self.limits)
        if matcher.is_error():
            why = _why(matcher)
            if "limit" in why or "too large" in why or "max is" in why:
                raise GrammarError(f"the grammar is past a limit of the grammar library: {why}", "grammar_too_complex")
            raise GrammarError(f"the grammar does not compile: {why}")
        raw = self.raw_mask(matcher)
        if matcher.is_error():
            why = _why(matcher)
            if any(w in why for w in _NO_TEXT):
                raise GrammarError(f"no text satisfies the grammar: its rules never end ({why})", "empty_grammar")
            raise GrammarError(f"the grammar is past a limit of the grammar library at its first token: {why}",
                               "grammar_too_complex")
        words = self.words(raw)
        if not words.any():
            raise GrammarError("no text satisfies the grammar: no token can start one", "empty_grammar")
        self._try_first_tokens(matcher, raw, t0)
        stops = frozenset(t for t in stop_ids if 0 <= t < self.vocab)
        if min_tokens and all(e in stops for e in self.eos) \
                and self._min_tokens_reachable(matcher, raw, stops, min_tokens) is False:
            raise GrammarError(f"min_tokens {min_tokens} cannot be met: every text of the grammar ends, or reaches a "
                               "stop id, before that many tokens", "invalid_value", param="min_tokens")
        took = time.perf_counter() - t0
        if took > self.budget.compile_seconds:
            raise GrammarError(f"compiling and checking the grammar took {took:.1f} s, past the limit of "
                               f"{self.budget.compile_seconds:g} s a request", "grammar_too_complex")
        return [GrammarConstraint(matcher.deep_copy(), words.copy(), self) for _ in range(count)]

    def _allowed_ids(self, raw: np.ndarray) -> np.ndarray:
        """The token ids a raw llguidance mask allows, the grammar's end (its eos) left out."""
        ids = np.flatnonzero(np.unpackbits(raw.view(np.uint8), bitorder="little")[:self.vocab])
        return ids[ids != self.grammar_eos]

    def _try_first_tokens(self, matcher, raw: np.ndarray, t0: float) -> None:
        """Each of up to probe_tokens of the first step's allowed tokens, consumed on a copy of the matcher and the
        next mask computed: one that fails there is a grammar past a limit on a path the model may take."""
        ids = self._allowed_ids(raw)
        if len(ids) > self.budget.probe_tokens:
            ids = ids[np.linspace(0, len(ids) - 1, self.budget.probe_tokens).astype(int)]
        for t in ids:
            trial = matcher.deep_copy()
            if trial.consume_token(int(t)) and not trial.is_error():
                self.raw_mask(trial)
            if trial.is_error():
                raise GrammarError(f"the grammar is past a limit of the grammar library after its first token "
                                   f"{self.tokenizer.dbg_tokens([int(t)])}: {_why(trial)}", "grammar_too_complex")
            if time.perf_counter() - t0 > self.budget.compile_seconds:
                return          # the budget's check after `prepare` answers

    def _min_tokens_reachable(self, matcher, raw: np.ndarray, stops: frozenset, min_tokens: int) -> bool | None:
        """Whether some text of the grammar has min_tokens tokens none of which is a stop id (a depth-first search
        over the masks): True, False when every path was followed to its end, None when the budget ran out first."""
        deadline = time.perf_counter() + self.budget.probe_seconds
        nodes = 0

        def steps(r):
            return iter([int(t) for t in self._allowed_ids(r) if int(t) not in stops])

        stack = [(matcher, steps(raw), 0)]
        while stack:
            parent, todo, depth = stack[-1]
            t = next(todo, None)
            if t is None:
                stack.pop()
                continue
            nodes += 1
            if nodes > self.budget.probe_nodes or time.perf_counter() > deadline:
                return None
            child = parent.deep_copy()
            if not child.consume_token(t) or child.is_error():
                continue
            if depth + 1 >= min_tokens:
                return True
            r = self.raw_mask(child)
            if not child.is_error():
                stack.append((child, steps(r), depth + 1))
        return False

    def raw_mask(self, matcher) -> np.ndarray:
        """llguidance's mask of the matcher's next token ([1, ceil(V / 32)] int32; its eos bit: the grammar may end)."""
        from llguidance.numpy import fill_next_token_bitmask
        raw = np.zeros((1, mask_words(self.vocab)), np.int32)
        fill_next_token_bitmask(matcher, raw)
        return raw

    def words(self, raw: np.ndarray) -> np.ndarray:
        """A raw mask as the engine's packed words: where the grammar may end, the model's end-of-sequence ids
        are allowed (llguidance's own eos id translated to them); no bit past the vocabulary."""
        bits = raw[0].view(np.uint32).copy()
        ge = self.grammar_eos
        ends = bool((bits[ge // 32] >> np.uint32(ge % 32)) & 1)
        bits[ge // 32] &= ~np.uint32(1 << (ge % 32))
        for t in self.eos:
            if ends:
                bits[t // 32] |= np.uint32(1 << (t % 32))
            else:
                bits[t // 32] &= ~np.uint32(1 << (t % 32))
        return (bits & self._in_vocab).view(np.int32)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarConstraint(Constraint):
    """One sequence's matcher: the allowed tokens of each step as the body's packed mask words. After a token it
    advances and computes the next mask on StepWork's thread; until then it is not ready."""

    def __init__(self, matcher, words: np.ndarray, grammars: Grammars):
        self.matcher = matcher
        self._words = words
        self._grammars = grammars
        self._job: cf.Future | None = None
        self.tokens = 0                  # tokens the matcher consumed

    def ready(self) -> bool:
        job = self._job
        return job is None or job.done()

    def failure(self) -> str | None:
        job = self._job
        if job is not None and job.done() and job.exception() is not None:
            return str(job.exception())
        return None

    def fill(self, words: np.ndarray) -> None:
        if self._job is not None:
            self._job.result()          # done (the engine asks only when ready); raises its failure
        words &= self._words

    def accept(self, token: int) -> bool:
        return self.accept_tokens([token])    # the grammar's end (an eos id) is allowed, and nothing follows it

    def drafts_allowed(self, tokens) -> int:
        """Constraint.drafts_allowed: the drafts the matcher takes from here, cut before the first it refuses or
        the first end-of-sequence id (nothing is drafted past the grammar's end)."""
        ends = [i for i, t in enumerate(tokens) if t in self._grammars.eos]
        tokens = list(tokens[:ends[0]] if ends else tokens)
        if not tokens or not self.allows(tokens[0]):
            return 0
        return self.matcher.validate_tokens(tokens)

    def draft_masks(self, tokens, words: np.ndarray) -> None:
        """Constraint.draft_masks: the matcher advanced through the drafts, its mask after each recorded, then
        rolled back to where it was (vLLM's per-position grammar bitmask)."""
        m, g = self.matcher, self._grammars
        for j, t in enumerate(tokens):
            if not m.consume_token(int(t)) or m.is_error():
                m.rollback(j)
                raise GrammarError(f"the grammar refused its draft {t} after {self.tokens + j} tokens: {_why(m)}",
                                   "grammar_failed")
            words[j + 1] &= g.words(g.raw_mask(m))
        m.rollback(len(tokens))

    def accept_tokens(self, tokens) -> bool:
        """Constraint.accept_tokens: the first checked against the mask now, all consumed in one job (a verify
        call's tokens: each allowed by its position's mask, which the job checks again)."""
        tokens = [int(t) for t in tokens]
        if not tokens or not self.allows(tokens[0]):
            return not tokens
        ends = [i for i, t in enumerate(tokens) if t in self._grammars.eos]
        tokens = tokens[:ends[0]] if ends else tokens
        if tokens:
            self._job = self._grammars.steps.submit(self._advance, *tokens)
        return True

    def allows(self, token: int) -> bool:
        """Whether the mask now allows the token."""
        return bool((int(self._words.view(np.uint32)[token // 32]) >> (token % 32)) & 1)

    def _advance(self, *tokens: int) -> None:
        """On StepWork's thread: consume the tokens, compute the next mask (its CPU time within the budget: llguidance
        works in this thread, and the thread's own time does not count waits for a loaded machine's cores)."""
        m, g = self.matcher, self._grammars
        t0 = time.thread_time()
        for i, token in enumerate(tokens):
            if not m.consume_token(token) or m.is_error():
                self.tokens += i
                break
        else:
            raw = g.raw_mask(m)
            took = time.thread_time() - t0
            if took > g.budget.token_seconds * len(tokens):
                which = f"token {self.tokens + 1}" if len(tokens) == 1 else \
                    f"tokens {self.tokens + 1} to {self.tokens + len(tokens)}"
                raise GrammarError(f"the grammar took {took:.2f} s of CPU time for its {which}, past the limit of "
                                   f"{g.budget.token_seconds:g} s a token", "grammar_failed")
            if not m.is_error():
                self.tokens += len(tokens)
                self._words = g.words(raw)
                return
        raise GrammarError(f"the grammar failed after {self.tokens} tokens: {_why(m)}", "grammar_failed")
