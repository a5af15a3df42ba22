"""Engine-side structured output: one llguidance matcher per sequence, and the token masks it allows.

Owns: turning a ``StructuredOutputSpec`` into an llguidance grammar, compiling it OFF the engine loop
(one compile thread; the loop polls ``is_ready``), caching compiled grammars by spec (a new sequence
gets a deep copy of the cached pristine matcher), the per-sequence matcher state (advance on each
sampled token, fork for n > 1), and the allowed-token bitmask the worker applies to the logits.

Bitmask layout (the contract of ``ScheduledSeq.allowed_token_bitmask``): int32 words, word i bit j is
token 32*i+j, bit set = allowed, ``ceil(vocab_size / 32)`` words where ``vocab_size`` is the MODEL's
vocabulary (the logits width). Ids the tokenizer does not have (a model vocabulary padded past the
tokenizer's) are never allowed.

End of output: llguidance's mask allows the EOS token(s) exactly when the grammar may end; once the
grammar cannot take anything else (``is_finished``) only EOS is allowed, so the scheduler may either
sample it or finish the sequence right away.

Threading: the compile thread only builds matchers (and the grammar cache); every matcher a sequence
owns is touched by the engine thread only, after ``is_ready`` returned True.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

import llguidance
from llguidance import LLExecutor, LLMatcher, LLTokenizer
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from config.structured_output import CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, StructuredOutputSpec

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (distinct specs); a tool schema or a client's fixed schema repeats.
GRAMMAR_CACHE_SIZE = 64

# JSON compile defaults: no free whitespace between tokens. A small model under a mask that allows
# arbitrary whitespace can emit newlines until max_tokens and never close the object; ", " and ": "
# are what models write naturally. A schema may override these with its own "x-guidance" key.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputError(ValueError):
    """A spec that does not compile (bad schema, regex, grammar, choice list)."""


def grammar_of(spec: StructuredOutputSpec) -> str:
    """The llguidance grammar text (a JSON string) for ``spec``; raises ``StructuredOutputError``.

    Does not check that the grammar compiles: ``validate_spec`` or the matcher does that.
    """
    try:
        if spec.kind == JSON_SCHEMA:
            schema = json.loads(spec.value)
            if not isinstance(schema, (dict, bool)):
                raise StructuredOutputError("a JSON schema must be an object or a boolean")
            if isinstance(schema, bool):
                # true = any JSON value, false = nothing; llguidance wants an object.
                schema = {} if schema else {"not": {}}
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if spec.kind == JSON_OBJECT:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        if spec.kind == REGEX:
            # \d means [0-9] (as in vLLM's backends), not every Unicode digit: llguidance's regexes
            # follow Rust's Unicode classes, under which a small model happily writes "🯸🯸🯸".
            return LLMatcher.grammar_from_lark("start: /" + llguidance.regex_to_lark(spec.value, "d") + "/")
        if spec.kind == CHOICE:
            choices = json.loads(spec.value)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise StructuredOutputError("a choice list must be a non-empty list of strings")
            return llguidance.grammar_from("choice", choices)
        if spec.kind == GRAMMAR:
            # Lark (llguidance's dialect) or GBNF; grammar_from tells them apart.
            return llguidance.grammar_from("grammar", spec.value)
    except StructuredOutputError:
        raise
    except ValueError as exc:  # json.JSONDecodeError is a ValueError, as are llguidance's argument errors
        raise StructuredOutputError(str(exc)) from exc
    raise StructuredOutputError(f"unknown structured output kind {spec.kind!r}")


def validate_spec(spec: StructuredOutputSpec, tokenizer: LLTokenizer | None = None) -> None:
    """Compile ``spec`` once to check it; raises ``StructuredOutputError`` with the compiler's message.

    Used by the API server (without a tokenizer: the grammar checks do not need one) so that a bad
    schema is a 400 before the request is accepted rather than an error after a 200.
    """
    grammar = grammar_of(spec)
    message = LLMatcher.validate_grammar(grammar, tokenizer)
    if message:
        raise StructuredOutputError(message.strip())


@dataclass
class _SeqState:
    spec: StructuredOutputSpec
    future: Future | None  # the compile job until is_ready collects it
    matcher: LLMatcher | None = None
    error: str | None = None


class StructuredOutputManager:
    """Grammar matchers of the running structured-output sequences, keyed by sequence id.

    Build with ``StructuredOutputManager.for_model(model_path, vocab_size)`` in the engine process
    (loads the tokenizer in the compile thread, so construction returns at once) or from an
    ``LLTokenizer`` you already have.
    """

    def __init__(self, tokenizer: LLTokenizer | Future, vocab_size: int, *, tokenizer_vocab_size: int | None = None,
                 mask_threads: int = 1) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.mask_words = (vocab_size + 31) // 32
        self._compile_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        if isinstance(tokenizer, Future):
            self._tokenizer_future: Future = tokenizer
        else:
            self._tokenizer_future = Future()
            self._tokenizer_future.set_result(tokenizer)
        self._tokenizer_vocab_size = tokenizer_vocab_size
        self._valid_words: np.ndarray | None = None  # mask of ids the tokenizer has; built with the tokenizer
        self._grammar_cache: OrderedDict[StructuredOutputSpec, LLMatcher] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._seqs: dict[str, _SeqState] = {}
        # By default masks are computed in the engine thread (mask_threads=1): the engine shares the
        # host's cores with the worker's forward. More threads: llguidance's executor splits a batch.
        if mask_threads < 1:
            raise ValueError(f"mask_threads must be at least 1, got {mask_threads}")
        self._executor = LLExecutor(num_threads=mask_threads) if mask_threads > 1 else None

    @classmethod
    def for_model(cls, model_path: str, vocab_size: int, *, mask_threads: int = 1) -> "StructuredOutputManager":
        """A manager for the model at ``model_path`` whose logits are ``vocab_size`` wide.

        The tokenizer (GGUF vocabulary or tokenizer.json) is loaded and converted for llguidance in
        the compile thread: the first grammar compiles after it, nothing blocks the caller.
        """
        tokenizer_future: Future = Future()
        manager = cls(tokenizer_future, vocab_size, mask_threads=mask_threads)

        def load() -> None:
            try:
                tokenizer, size = load_ll_tokenizer(model_path, vocab_size)
            except Exception as exc:  # reported per request through error(); the engine keeps serving text
                logger.exception("structured output: cannot build the llguidance tokenizer for %s", model_path)
                tokenizer_future.set_exception(exc)
                return
            manager._tokenizer_vocab_size = size
            tokenizer_future.set_result(tokenizer)

        manager._compile_pool.submit(load)
        return manager

    # -- lifecycle of one sequence

    def add(self, seq_id: str, spec: StructuredOutputSpec) -> None:
        """Start compiling ``spec`` for ``seq_id`` in the compile thread; returns at once."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has a structured output state")
        self._seqs[seq_id] = _SeqState(spec=spec, future=self._compile_pool.submit(self._fresh_matcher, spec))

    def is_ready(self, seq_id: str) -> bool:
        """True once the grammar of ``seq_id`` compiled or failed (see ``error``)."""
        state = self._state(seq_id)
        if state.future is None:
            return True
        if not state.future.done():
            return False
        future, state.future = state.future, None
        try:
            state.matcher = future.result()
        except StructuredOutputError as exc:
            state.error = str(exc)
        except Exception as exc:  # an unexpected compiler failure fails this request only
            logger.exception("structured output: compiling %s for %s failed", state.spec.kind, seq_id)
            state.error = f"structured output grammar failed to compile: {exc}"
        return True

    def wait_ready(self, seq_id: str, timeout: float) -> bool:
        """Block up to ``timeout`` s for ``seq_id``'s compile (tests, benchmarks; the engine loop polls)."""
        state = self._state(seq_id)
        if state.future is not None:
            wait([state.future], timeout=timeout)
        return self.is_ready(seq_id)

    def error(self, seq_id: str) -> str | None:
        """The compile error of ``seq_id`` (None while compiling or when it compiled)."""
        state = self._state(seq_id)
        if state.error is None and state.matcher is not None and state.matcher.is_error():
            return state.matcher.get_error()
        return state.error

    def fork(self, parent_id: str, child_id: str) -> None:
        """``child_id`` continues from the parent's current grammar state (n > 1 choices)."""
        parent = self._state(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already has a structured output state")
        if parent.future is not None:
            # Not compiled yet, so the parent has consumed nothing: the child starts fresh (a cache hit).
            self.add(child_id, parent.spec)
            return
        matcher = parent.matcher.deep_copy() if parent.matcher is not None else None
        self._seqs[child_id] = _SeqState(spec=parent.spec, future=None, matcher=matcher, error=parent.error)

    def bitmask(self, seq_id: str) -> np.ndarray | None:
        """The allowed tokens of ``seq_id``'s next step (``mask_words`` int32 words).

        None when the sequence is not ready or failed (the scheduler must not schedule it then).
        """
        masks = self.fill_bitmasks([seq_id])
        return None if masks is None else masks[0]

    def fill_bitmasks(self, seq_ids: list[str], out: np.ndarray | None = None) -> np.ndarray | None:
        """Masks of several sequences at once, row i for ``seq_ids[i]`` (split over ``mask_threads``).

        ``out``: a C-contiguous int32 array [len(seq_ids), mask_words] to fill (allocated if None).
        None if any of the sequences is not ready or failed.
        """
        matchers = []
        for seq_id in seq_ids:
            state = self._state(seq_id)
            if state.matcher is None or state.future is not None or state.error is not None:
                return None
            matchers.append(state.matcher)
        if out is None:
            out = np.empty((len(seq_ids), self.mask_words), dtype=np.int32)
        elif out.shape != (len(seq_ids), self.mask_words) or out.dtype != np.int32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous int32 array of shape {(len(seq_ids), self.mask_words)}")
        if self._executor is None or len(matchers) == 1:
            # In the calling thread: handing masks to an executor thread adds a wake-up per call, which
            # on a busy host costs more than the masks (benchmarks/structured_output.py, 2 cores).
            for row, matcher in enumerate(matchers):
                fill_next_token_bitmask(matcher, out, row)
        else:
            fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], out)
        out &= self._valid_mask()
        return out

    def accept(self, seq_id: str, token_id: int) -> bool:
        """Advance ``seq_id`` by the sampled ``token_id``; False (and the state is an error) if not allowed."""
        state = self._state(seq_id)
        if state.matcher is None:
            return False
        return bool(state.matcher.consume_token(int(token_id)))

    def is_finished(self, seq_id: str) -> bool:
        """True when the grammar is complete and allows nothing but EOS (or EOS was accepted)."""
        state = self._state(seq_id)
        return state.matcher is not None and state.matcher.is_stopped() and not state.matcher.is_error()

    def remove(self, seq_id: str) -> None:
        """Forget ``seq_id`` (finished or aborted); a compile still queued for it is cancelled."""
        state = self._seqs.pop(seq_id, None)
        if state is not None and state.future is not None:
            state.future.cancel()

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def close(self) -> None:
        """Stop the compile thread (pending compiles are dropped)."""
        self._compile_pool.shutdown(wait=False, cancel_futures=True)

    # -- internals

    def _state(self, seq_id: str) -> _SeqState:
        state = self._seqs.get(seq_id)
        if state is None:
            raise KeyError(f"sequence {seq_id!r} has no structured output state")
        return state

    def _fresh_matcher(self, spec: StructuredOutputSpec) -> LLMatcher:
        # Runs in the compile thread.
        with self._cache_lock:
            template = self._grammar_cache.get(spec)
            if template is not None:
                self._grammar_cache.move_to_end(spec)
                return template.deep_copy()
        tokenizer: LLTokenizer = self._tokenizer_future.result()
        template = LLMatcher(tokenizer, grammar_of(spec), log_level=0)
        if template.is_error():
            raise StructuredOutputError(template.get_error().strip())
        with self._cache_lock:
            self._grammar_cache[spec] = template
            if len(self._grammar_cache) > GRAMMAR_CACHE_SIZE:
                self._grammar_cache.popitem(last=False)
        return template.deep_copy()

    def _valid_mask(self) -> np.ndarray:
        if self._valid_words is None:
            valid = np.zeros(self.mask_words * 32, dtype=np.uint8)
            size = self._tokenizer_vocab_size or self.vocab_size
            valid[:min(size, self.vocab_size)] = 1
            self._valid_words = np.packbits(valid, bitorder="little").view(np.int32).copy()
        return self._valid_words


def load_ll_tokenizer(model_path: str, vocab_size: int) -> tuple[LLTokenizer, int]:
    """The llguidance tokenizer of the model at ``model_path`` and the tokenizer's own vocabulary size.

    Built from our ``tokenizers.Tokenizer`` (serialised to JSON), so no transformers/torch is needed;
    EOS is the model's eos ids (the chat end-of-turn token for instruct models).
    """
    from engine.tokenizer import load_tokenizer  # the tokenizer module pulls jinja2/gguf: load on demand

    tokenizer = load_tokenizer(model_path)
    return ll_tokenizer_from(tokenizer.backend, tokenizer.eos_token_ids, vocab_size), tokenizer.vocab_size


def ll_tokenizer_from(backend: object, eos_token_ids: tuple[int, ...], vocab_size: int) -> LLTokenizer:
    """An ``LLTokenizer`` over a ``tokenizers.Tokenizer`` with ``vocab_size`` ids (>= the tokenizer's)."""
    return LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
