"""What the completion and chat handlers share: submitting prompts, waiting with disconnect detection, SSE."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request

from conveyor.core.lora_request import LoRARequest
from conveyor.core.sampling_params import RequestOutputKind, SamplingParams
from conveyor.engine.engine_client import EngineInfo, Prepare, RequestStream, ServedEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.server.admission import AdmissionController
from conveyor.server.errors import APIError, bad_request, from_engine_error, from_value_error
from conveyor.server.limits import DEFAULT_MAX_SEQS_PER_REQUEST, check_stop
from conveyor.server.protocol import SamplingFields
from conveyor.server.reasoning import model_reasoning
from conveyor.structured.checker import GrammarChecker
from conveyor.structured.grammars import grammar_text

logger = logging.getLogger("conveyor.server")
T = TypeVar("T")


# vLLM's convention for a logprob JSON cannot hold: a token a grammar masked has logprob -inf (the sampler takes
# logprobs after the bitmask), which is not JSON; vLLM's OpenAI server answers max(logprob, -9999.0).
MIN_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    """``value`` as the answer carries it: -inf (and NaN, which no step should produce) as ``MIN_LOGPROB``."""
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


def sse(payload: dict) -> str:
    """One server-sent event. Strict JSON: a non-finite number raises instead of going out as ``-Infinity``."""
    return f"data: {json.dumps(payload, separators=(',', ':'), allow_nan=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """vLLM's rule: a request whose prompt plus explicit max_tokens exceeds the context is refused (400)."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: together they exceed this "
            f"model's maximum context length of {max_model_len} tokens; shorten the prompt or lower max_tokens"
        )


def token_usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def usage(outputs: list[RequestOutput], prompt_only: bool = False) -> dict:
    """Token counts; ``prompt_only``: an echo with max_tokens 0, whose one generated token is never shown."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    return token_usage(prompt, 0 if prompt_only else sum(o.num_generated_tokens for o in outputs))


class StreamUsage:
    """What a stream tells of its token counts (``stream_options``): ``include_usage``, a last chunk (no choices)
    with the request's usage, and ``"usage": null`` on the others, as OpenAI; ``continuous_usage_stats``
    (vLLM's), every chunk with the usage of its choice so far: its prompt's tokens, the tokens it generated.

    vLLM counts continuously only when ``include_usage`` is set too, and otherwise ignores the flag; here a
    client asking for usage on every chunk gets it either way."""

    def __init__(self, body: SamplingFields) -> None:
        self.final = body.include_usage
        self.continuous = body.continuous_usage

    def of_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """The ``usage`` entry of a chunk with a choice (nothing when none was asked for)."""
        if self.continuous:
            return {"usage": token_usage(prompt_tokens, completion_tokens)}
        return {"usage": None} if self.final else {}


class ServingContext:
    """The served model and its engine, as the handlers see them.

    ``max_seqs_per_request`` bounds prompts x n of one request (``--max-seqs-per-request``);
    ``max_token_chars`` is the most characters one token stands for (``limits.max_token_chars``; None: no bound
    is known, and prompts are not checked by their length in characters)."""

    def __init__(self, engine: ServedEngine, model_name: str, max_n: int = 128,
                 max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST, max_token_chars: int | None = None,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 grammar_checker: GrammarChecker | None = None) -> None:
        self.engine = engine
        self.grammar_checker = grammar_checker  # None: constraints are translated and validated, not compiled
        self.tool_call_parser = tool_call_parser  # None: picked from the chat template (server/tools.py)
        self.chat_template = engine.info.tokenizer.chat_template
        # How the model reasons (None: it does not); the parser's None: read from the template (server/reasoning.py)
        self.reasoning = model_reasoning(reasoning_parser, engine.info.tokenizer)
        self.model_name = model_name
        self.max_model_len = engine.info.max_model_len
        self.max_n = max_n
        self.max_seqs_per_request = max_seqs_per_request
        self.admission_cap = engine.info.max_seqs_per_request  # the queue bound's
        self.vocab_size = engine.info.model_info.vocab_size
        self.task = engine.info.model_info.task  # "generate", or a pooling model's "embed" / "score"
        self.max_token_chars = max_token_chars
        self.admission: AdmissionController | None = None  # SLO-aware admission (--service-class), when on
        self.lora: LoRARequest | None = None  # the LoRA adapter every request of this context runs with

    def for_adapter(self, name: str, lora: LoRARequest) -> ServingContext:
        """This context serving LoRA adapter ``lora`` as model ``name`` (server.lora_adapters)."""
        ctx = copy.copy(self)
        ctx.model_name, ctx.lora = name, lora
        return ctx

    async def tokenizer_call(self, fn: Callable[[EngineInfo], T]) -> T:
        """``fn(info)`` off the event loop with the server's tokenizer (``ServedEngine.tokenizer_call``); its
        errors as API errors (a ValueError is a 400)."""
        try:
            return await self.engine.tokenizer_call(fn)
        except APIError:
            raise
        except Exception as exc:
            raise from_engine_error(exc) from exc

    def check_size(self, params: SamplingParams, num_prompts: int) -> None:
        """400 for a request bigger than this server serves: ``n`` over ``--max-n``, prompts x n over
        ``--max-seqs-per-request``, or more sequences than the queue bound could ever admit (a 503 would send a
        retrying client round forever). ``param`` names ``n``, unless n is 1 and the prompt batch alone is too big."""
        if params.n > self.max_n:
            raise bad_request(f"n must be <= {self.max_n} on this server (--max-n), got {params.n}", "n")
        num_seqs, param = params.n * num_prompts, "prompt" if params.n == 1 else "n"
        if num_seqs > self.max_seqs_per_request:
            raise bad_request(
                f"prompts x n is {num_prompts} x {params.n} = {num_seqs} sequences, more than the "
                f"{self.max_seqs_per_request} one request may ask for on this server (--max-seqs-per-request)", param)
        cap = self.admission_cap
        if cap is not None and num_seqs > cap:
            raise bad_request(
                f"n x prompts is {num_seqs}, more than this server can ever admit at once ({cap}: "
                f"--max-num-seqs plus --max-num-queued-reqs)", param)

    def check_prompt_chars(self, num_chars: int, param: str, what: str) -> None:
        """400 for a text prompt that cannot fit in the context whatever its tokens, before it is tokenized.

        The rule: no token stands for more than ``max_token_chars`` characters, so a text of more than
        ``max_model_len * max_token_chars`` characters needs more than ``max_model_len`` tokens, more than the
        context holds. (A prompt under that length may still be too long; the token count decides then.)"""
        if self.max_token_chars is None:
            return
        limit = self.max_model_len * self.max_token_chars
        if num_chars > limit:
            raise bad_request(
                f"{what} has {num_chars} characters: more than {limit} ({self.max_model_len} tokens of context x "
                f"{self.max_token_chars}, the most characters one token of this model stands for), so it cannot "
                "fit in this model's context; shorten it", param)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           "model", "model_not_found")

    def sampling_params(self, body: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The checks every generation endpoint makes after its own, and the request's ``SamplingParams``
        (APIError 400 when bad): a stream's outputs are deltas (``RequestStream``), any other's cumulative."""
        if body.refused is not None:
            raise bad_request(body.refused.message, body.refused.name)
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options can only be set when stream is true", "stream_options")
        try:
            params = body.sampling_params(max_tokens, logprobs)
            check_stop(params.stop, params.stop_token_ids)
            params.check_vocabulary(self.vocab_size)
        except ValueError as exc:
            raise from_value_error(exc) from exc
        if body.stream:
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        return params

    async def check_constraint(self, params: SamplingParams, field: str | None = None) -> None:
        """400 for a structured-output constraint that cannot be enforced (an unsupported JSON schema keyword, a
        regex look-ahead, a grammar that does not parse, one that matches no text, one past llguidance's limits or
        the check's time bound: ``structured.checker``), before the request reaches the engine; ``field``: the
        request field that asked for it, which the error names. Off the loop: the check waits for its worker."""
        spec = params.structured_outputs
        if spec is None:
            return
        try:
            if self.grammar_checker is not None:
                await self.grammar_checker.check_async(spec)
            else:
                await asyncio.to_thread(grammar_text, spec)
        except ValueError as exc:
            if field is None:
                raise from_value_error(exc) from exc
            raise bad_request(f"{field}: {str(exc).split(': ', 1)[-1]}", field) from exc

    async def submit(self, request_id: str, prompts: list[Prepare], params: SamplingParams | list[SamplingParams],
                     raw: Request | None = None, service_tier: str | None = None) -> list[RequestStream]:
        """Queue one engine request per prompt (ids ``{request_id}-{i}``; ``params`` one for all, or one per prompt),
        all at once; all or nothing. Each
        ``Prepare`` has run (off the event loop: a worker thread, or the engine thread in process) when this
        returns. A client that disconnects meanwhile (``raw``) ends it at once: the prompts already queued are
        aborted, the others never are (APIError 499), so an abandoned batch does not go on growing while the rest
        of it is submitted. With SLO-aware admission the prompts are prepared first and the request admitted in
        ``service_tier``'s class at its priority, or refused (429) before anything is queued."""
        each = params if isinstance(params, list) else [params] * len(prompts)
        if self.lora is not None:
            each = [dataclasses.replace(p, lora=self.lora) for p in each]
        if self.admission is not None:
            prompts, each = await self.admission.admit_prompts(request_id, prompts, each, service_tier,
                                                               self.tokenizer_call, self.max_model_len)
        try:
            return await self._submit(request_id, prompts, each, raw)
        except BaseException:
            if self.admission is not None:
                self.admission.release(request_id, len(prompts))
            raise

    async def _submit(self, request_id: str, prompts: list[Prepare], each: list[SamplingParams],
                      raw: Request | None) -> list[RequestStream]:
        arrival = time.monotonic()
        adds = [asyncio.ensure_future(self.engine.add_request(f"{request_id}-{i}", prepare, p, arrival))
                for i, (prepare, p) in enumerate(zip(prompts, each))]
        gone = asyncio.ensure_future(_wait_disconnect(raw)) if raw is not None else None
        failure: BaseException | None = None
        try:
            pending = set(adds)
            while pending and failure is None:
                done, pending = await asyncio.wait(pending | {gone} - {None}, return_when=asyncio.FIRST_COMPLETED)
                if gone in done:
                    failure = APIError(499, "client disconnected", code="client_closed_request")
                    logger.info("client disconnected while its request was submitted: aborted %s", request_id)
                    break
                pending.discard(gone)
                failure = next((t.exception() for t in done if t.exception() is not None), None)
        except BaseException as exc:  # the handler itself was cancelled
            failure = exc
        finally:
            if gone is not None:
                gone.cancel()
        if failure is None:
            return [add.result() for add in adds]
        for add in adds:
            add.cancel()  # an add that was under way aborts its request itself (EngineClient._open_stream)
        finished = await asyncio.gather(*adds, return_exceptions=True)
        self.abort([s for s in finished if isinstance(s, RequestStream)])
        if isinstance(failure, Exception) and not isinstance(failure, APIError):
            raise from_engine_error(failure) from failure
        raise failure

    def abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    async def wait_final(self, streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
        """The final output of every stream; a client that disconnects first aborts them all."""

        async def last(stream: RequestStream) -> RequestOutput:
            out = None
            async for out in stream:
                pass
            return out

        return await self.unless_disconnected(asyncio.gather(*(last(s) for s in streams)), streams, raw)

    async def unless_disconnected(self, work: Awaitable[T], streams: list[RequestStream], raw: Request) -> T:
        """``work``'s result (it reads ``streams`` to their end); a client that disconnects first aborts the
        streams (499, which nobody reads), and a failure of ``work`` aborts whatever of them still runs."""
        results = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not results.done():
                # A cancelled gather ends holding a CancelledError that asyncio would log, with a traceback,
                # as "never retrieved": retrieve it.
                results.add_done_callback(lambda f: f.cancelled() or f.exception())
                results.cancel()
                self.abort(streams)
        if not results.done():  # nobody will read this answer; it only ends the handler cleanly
            logger.info("client disconnected before the answer: aborted %s", streams[0].request_id.rsplit("-", 1)[0])
            raise APIError(499, "client disconnected", code="client_closed_request")
        try:
            return results.result()
        except APIError:
            self.abort(streams)
            raise
        except Exception as exc:
            self.abort(streams)  # one prompt of a batch failed: the answer is an error, so stop the others
            raise from_engine_error(exc) from exc


def sse_events(events: AsyncIterator[dict], ctx: ServingContext, streams: list[RequestStream]) -> AsyncIterator[str]:
    """``events`` as server-sent events, ended by ``data: [DONE]`` (OpenAI's streams); see ``guarded_stream``."""

    async def frames() -> AsyncIterator[str]:
        async with contextlib.aclosing(events):
            async for event in events:
                yield sse(event)

    return guarded_stream(frames(), ctx, streams, lambda error: sse(error.body()), SSE_DONE)


async def guarded_stream(frames: AsyncIterator[str], ctx: ServingContext, streams: list[RequestStream],
                         error_frame: Callable[[APIError], str], end: str | None = None) -> AsyncIterator[str]:
    """A response body of ``frames`` (each protocol's: SSE events, NDJSON lines), then ``end``. The headers are
    sent by then, so an error is reported in-band, as ``error_frame`` writes it (as vLLM does). Whatever happens,
    the request's unfinished streams are aborted: a no-op for finished ones, and it frees the blocks of a client
    that went away."""
    try:
        async with contextlib.aclosing(frames):
            async for frame in frames:
                yield frame
    except Exception as exc:
        error = exc if isinstance(exc, APIError) else from_engine_error(exc)
        yield error_frame(error)
    finally:
        ctx.abort(streams)
    if end is not None:
        yield end


async def _wait_disconnect(raw: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come; one stream is iterated directly."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    inbox: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                inbox.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            inbox.put_nowait((i, exc))
        inbox.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, item = await inbox.get()
            if item is None:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
