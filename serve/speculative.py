"""Speculative decoding on the host: vLLM's `--speculative-config`, the n-gram proposer and greedy acceptance.

A decoding sequence whose last tokens occurred before in its prompt or output (an n-gram of prompt_lookup_min to
prompt_lookup_max tokens; the longest that matches, at its latest earlier occurrence) gets the tokens that followed
that occurrence as drafts, up to num_speculative_tokens (vLLM's `ngram` method, prompt lookup decoding). The
scheduler runs the drafts in a verify call (export/_verify.py); the body returns the target's greedy token after
each position, and the sequence emits the drafts those confirm (the longest matching prefix) and then the target's
own next token: exactly the tokens greedy decoding gives, up to k + 1 of them for one call.

Acceptance is the body's: in an artifact with a sampler, its verify entries process each position's logits as the
sampler does and rejection-sample (kernels/rejection_sampler.py), so sampled rows, penalties, logit bias and seeds
draft too, and each keeps its distribution exactly; rows under a grammar draft where each position gets its own
mask (`draft_limit`); without a sampler only plain greedy rows draft.
A sequence whose drafts are seldom accepted decodes one token a step as before (SpecState.may_draft): after a verify
call that accepts none of its drafts it backs off, drafting again only after a pause that grows with each such call
in a row (adaptive drafting, as SGLang's and llama.cpp's servers adapt theirs), and it stops for good once few of
its drafts were accepted. And a step runs only the drafts that pay for their verify rows at its batch
(CallPlanner.drafts_that_pay: each sequence's acceptance so far against what its k + 1 positions cost beside
a decode row's one): in a batch, a step where few sequences have drafts decodes as it would without.

Drafts come from a `Proposer`: the scheduler picks the step's drafting sequences and the most drafts each may take,
then asks the proposer once for all of them (`NgramProposer` here; serve/draft_model.py runs a second artifact,
serve/mtp_proposer.py the artifact's MTP head).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from tlaloc_jax import artifact as af

# The methods vLLM names that this runtime does not run yet, each refused by name.
NOT_BUILT = {"eagle": "EAGLE heads", "eagle3": "EAGLE-3 heads", "medusa": "Medusa heads",
             "mlp_speculator": "MLP speculators", "suffix": "suffix decoding"}
# The artifact's MTP head, DeepSeek-V3's or Qwen3-Next's (serve/mtp_proposer.py): vLLM's names for it.
MTP_METHODS = ("deepseek_mtp", "qwen3_next_mtp", "mtp")
FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
          "disable_by_batch_size")
# vLLM's n-gram window when neither bound is given.
DEFAULT_LOOKUP = 5
# A sequence stops drafting once, after at least MIN_DRAFTS drafts, fewer than MIN_ACCEPTANCE of them were accepted:
# each verify row costs k + 1 positions, which a decode row spends on one.
MIN_DRAFTS = 16
MIN_ACCEPTANCE = 0.25
# After a verify call that accepts nothing a sequence decodes BACKOFF_TOKENS tokens before it drafts again,
# BACKOFF_GROWTH times more after each further such call in a row: a sequence that never accepts runs a verify
# call after its 1st, 9th and 41st tokens, then none before its 169th (a verify call costs more than the decode
# step it replaces).
BACKOFF_TOKENS = 8
BACKOFF_GROWTH = 4
# The acceptance a sequence is expected to have before it drafts: PRIOR_ACCEPTED of PRIOR_DRAFTED (SpecState).
PRIOR_ACCEPTED = 1
PRIOR_DRAFTED = 2


class SpeculativeConfigError(ValueError):
    """A speculative config the runtime cannot serve; the message names the field and the way out."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative config: method "ngram", k drafted tokens a step from n-grams of lookup_min to lookup_max
    tokens; method "mtp", k drafts a step from the artifact's MTP head (serve/mtp_proposer.py); or method
    "draft_model", k greedy tokens a step from the draft artifact in directory `model` (serve/draft_model.py).
    disable_by_batch_size: no sequence drafts in a step while at least that many run (vLLM's; None: always on)."""

    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    method: str = "ngram"
    model: str | None = None
    disable_by_batch_size: int | None = None


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """vLLM's --speculative-config (a JSON text or a dict; None: off) -> SpeculativeConfig; unknown fields and
    methods, and methods not built yet, are refused by name."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(f"--speculative-config is not JSON ({e}); give e.g. "
                                         '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\'')
    if not isinstance(value, dict):
        raise SpeculativeConfigError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise SpeculativeConfigError(f"speculative_config fields {', '.join(unknown)} are not known here; this runtime "
                                     f"reads {', '.join(FIELDS)}")
    method = value.get("method")
    if method is None and value.get("model") is not None:
        method = "draft_model"          # vLLM infers the method from the model it is given
    if method in NOT_BUILT:
        raise SpeculativeConfigError(f"speculative_config method {method!r}: {NOT_BUILT[method]} are not built yet; "
                                     "use method 'ngram' (prompt lookup), 'draft_model' or 'deepseek_mtp'")
    if method not in ("ngram", "draft_model", *MTP_METHODS):
        raise SpeculativeConfigError(f"speculative_config method {method!r} is not known; use method 'ngram', "
                                     "'draft_model' or 'deepseek_mtp'")
    if method != "draft_model" and value.get("model") is not None:
        raise SpeculativeConfigError(f"speculative_config model: method {method!r} takes no draft model; leave model "
                                     "out")

    def count(name: str, default: int | None) -> int:
        v = value.get(name, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SpeculativeConfigError(f"speculative_config {name} must be a positive integer, got {v!r}")
        return v

    k = count("num_speculative_tokens", None)
    off = {"disable_by_batch_size": count("disable_by_batch_size", None)} if "disable_by_batch_size" in value else {}
    if method in MTP_METHODS:
        unused = sorted(set(value) & {"prompt_lookup_min", "prompt_lookup_max"})
        if unused:
            raise SpeculativeConfigError(f"speculative_config {', '.join(unused)}: method {method!r} drafts with the "
                                         "model's MTP head, not n-grams; leave them out")
        return SpeculativeConfig(k, method="mtp", **off)
    if method == "draft_model":
        model = value.get("model")
        if not isinstance(model, str) or not model:
            raise SpeculativeConfigError(f"speculative_config model: method 'draft_model' needs the draft artifact's "
                                         f"directory (python -m tlaloc_jax.export's output), got {model!r}")
        lookup = sorted(set(value) & {"prompt_lookup_min", "prompt_lookup_max"})
        if lookup:
            raise SpeculativeConfigError(f"speculative_config {', '.join(lookup)}: method 'draft_model' does not look "
                                         "up n-grams; leave them out")
        return SpeculativeConfig(k, method="draft_model", model=model, **off)
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    lo, hi = (DEFAULT_LOOKUP, DEFAULT_LOOKUP) if lo is None and hi is None else (lo if lo is not None else hi,
                                                                                 hi if hi is not None else lo)
    lo = count("prompt_lookup_min", lo)
    hi = count("prompt_lookup_max", hi)
    if lo > hi:
        raise SpeculativeConfigError(f"speculative_config prompt_lookup_min {lo} is larger than prompt_lookup_max "
                                     f"{hi}")
    return SpeculativeConfig(k, lo, hi, **off)


def verify_tokens(m: af.Manifest) -> int:
    """The drafted tokens a row of the artifact's verify entries holds (0: it has none)."""
    return max((e.tokens_per_seq - 1 for e in m.entries if e.kind == af.EntryKind.VERIFY), default=0)


def check_fits(config: SpeculativeConfig | None, m: af.Manifest) -> None:
    """Refuse a config the artifact's verify entries cannot run, naming the export option that makes them."""
    if config is None:
        return
    k = verify_tokens(m)
    if not k:
        raise SpeculativeConfigError("speculative decoding needs verify entries, which this artifact lacks: export it "
                                     f"with --speculative-tokens {config.num_speculative_tokens} "
                                     "(export_checkpoint(speculative_tokens=...))")
    if config.num_speculative_tokens > k:
        raise SpeculativeConfigError(f"speculative_config num_speculative_tokens {config.num_speculative_tokens} is "
                                     f"more than this artifact's verify entries hold ({k}, --speculative-tokens); ask "
                                     f"for at most {k}")
    if config.method == "mtp" and not any(e.kind == af.EntryKind.MTP for e in m.entries):
        raise SpeculativeConfigError("speculative_config method 'mtp' drafts with the checkpoint's MTP head, which "
                                     "this artifact lacks: re-export it with --speculative-tokens from a checkpoint "
                                     "that has its MTP weights (DeepSeek-V3's num_nextn_predict_layers and "
                                     "model.layers.<num_hidden_layers>.* tensors, Qwen3-Next's mtp.* tensors), or "
                                     "use method 'ngram'")


def masks_per_position(entries: Sequence[af.Entry]) -> bool:
    """Whether every verify entry takes a TOKEN_MASK per position ([B, T, W]; one staged with a mask a row takes
    [B, W], and its rows under a grammar do not draft)."""
    return bool(entries) and all(af.Role.TOKEN_MASK in (sig.role for sig in e.inputs)
                                 and len(e.inputs[e.input_index(af.Role.TOKEN_MASK)].shape) == 3 for e in entries)


def draft_limit(s, sampled: bool, masks: bool = False) -> int:
    """The most drafts a decoding sequence's verify row may hold and stay exact (0: none; -1: no limit). sampled:
    the verify entries take the sampler's inputs (else only plain greedy rows, whose token is the argmax, draft);
    masks: they take a TOKEN_MASK per position (masks_per_position).

    A grammar's mask changes with every drafted token: a sequence under one drafts only where each position gets
    its own mask (the grammar's after the drafts before it, outputs.draft_masks), and only once the grammar has
    its next mask (Constraint.ready); its drafts are cut at the first one the grammar refuses (allowed_drafts).
    Before min_tokens the stop ids are masked, so the drafts stop short of the position where the mask lifts.
    Penalties and bias are exact per position (the history holds the drafts)."""
    sp = s.sampling
    if not (sampled or sp.plain) or (s.constraint is not None and not (masks and s.constraint.ready())):
        return 0
    if s.stop and len(s.generated) < sp.min_tokens:
        return sp.min_tokens - len(s.generated) - 1
    return -1


def allowed_drafts(s, drafts: tuple[int, ...]) -> tuple[int, ...]:
    """The drafts cut before the first one the sequence's constraint refuses (vLLM's validate_tokens)."""
    return drafts if s.constraint is None or not drafts else drafts[:s.constraint.drafts_allowed(drafts)]


def propose_ngram(tokens: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest n-gram (lookup_min <= n <= lookup_max)
    ending `tokens`; [] when none occurs before."""
    L = len(tokens)
    for n in range(min(lookup_max, L - 1), lookup_min - 1, -1):
        tail = list(tokens[L - n:])
        for start in range(L - n - 1, -1, -1):
            if tokens[start] == tail[0] and list(tokens[start:start + n]) == tail:
                return list(tokens[start + n:start + n + k])
    return []


class Proposer(Protocol):
    """What drafts for the scheduler (sequences are core.request.Request, not imported: it imports this module).
    propose(rows): rows are a step's drafting sequences, each with the most drafts
    it may take (k >= 1); -> each row's drafts, at most its k (maybe none), in the rows' order, all asked at once so
    that a model-backed proposer runs them as one batch. release(s): the sequence finished or was preempted, drop
    what is kept for it (a draft model's pages)."""

    def propose(self, rows: Sequence[tuple[Any, int]]) -> list[list[int]]: ...

    def release(self, s: Any) -> None: ...


class NgramProposer:
    """vLLM's `ngram` method: each row's drafts by prompt lookup in its own tokens (propose_ngram)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, rows: Sequence[tuple[Any, int]]) -> list[list[int]]:
        cfg = self.config
        return [propose_ngram(s.tokens, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max) for s, k in rows]

    def release(self, s: Any) -> None:
        pass


@dataclass
class SpecState:
    """A sequence's speculation so far: drafts proposed and accepted, and its back-off."""

    drafted: int = 0
    accepted: int = 0
    misses: int = 0          # verify calls in a row that accepted none of its drafts
    resume: int = 0          # the generated-token count from which it drafts again

    def verified(self, drafted: int, accepted: int, generated: int) -> None:
        """A verify call of `drafted` drafts accepted `accepted`; the sequence has `generated` tokens after it."""
        self.drafted += drafted
        self.accepted += accepted
        if accepted:
            self.misses = 0
        elif drafted:
            self.resume = generated + BACKOFF_TOKENS * BACKOFF_GROWTH ** self.misses
            self.misses += 1

    def pause(self, generated: int) -> None:
        """Its drafts did not pay this step (CallPlanner.drafts_that_pay): it proposes again after BACKOFF_TOKENS
        tokens, when the batch may have changed."""
        self.resume = max(self.resume, generated + BACKOFF_TOKENS)

    def expected_accepted(self, drafts: int) -> float:
        """How many of `drafts` drafts a verify call should accept: its acceptance so far, from a prior of one in two
        (a sequence that has not drafted yet is tried)."""
        return drafts * (self.accepted + PRIOR_ACCEPTED) / (self.drafted + PRIOR_DRAFTED)

    def may_draft(self, generated: int) -> bool:
        """Whether a sequence with `generated` tokens drafts: not while it backs off, nor once few were accepted."""
        if generated < self.resume:
            return False
        return self.drafted < MIN_DRAFTS or self.accepted >= MIN_ACCEPTANCE * self.drafted
