"""Output kinds (``SamplingParams.output_kind``): a request's deltas add up to its cumulative output, the stop-string
hold-back never hands out text a later stop string cuts, and a stream that falls behind joins the deltas waiting
for it. The output processor is driven with the scheduler's own ``RequestUpdate``s through a real ``tokenizers``
tokenizer (no model)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from conveyor.core.outputs import RequestUpdate, TokenLogprobs
from conveyor.core.request import RequestStatus
from conveyor.core.sampling_params import RequestOutputKind, SamplingParams
from conveyor.engine.core_step import CoreStepOutput, child_requests
from conveyor.engine.engine_client import RequestFailedError, RequestStream
from conveyor.engine.output_processor import OutputProcessor
from conveyor.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from conveyor.tokenizer import load_tokenizer
from tests.helpers.checkpoints import write_word_tokenizer

DELTA, CUMULATIVE = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("word-tokenizer")
    write_word_tokenizer(path, 64)
    return load_tokenizer(str(path))


def run(tokenizer, params: SamplingParams, tokens: list[list[int]], finish_last: str | None = "length"):
    """Feed each child of the request its tokens, one per step (the last one finishing it, unless a stop string
    does first); returns every emitted output and what the scheduler was told to finish."""
    processor = OutputProcessor(tokenizer)
    children = child_requests("r", params)
    processor.add("r", None, [5, 6], children, 0.0)
    finished: list[tuple[list[str], RequestStatus]] = []
    outputs = []
    for step in range(max(len(t) for t in tokens)):
        updates = []
        for (child_id, _), ids in zip(children, tokens):
            if step < len(ids):
                last = step == len(ids) - 1
                updates.append(RequestUpdate(child_id, ids[step], TokenLogprobs(ids[step], -0.5 * step, []),
                                             finish_last if last else None))
        states = processor.settle(processor.process(CoreStepOutput(float(step), updates)),
                                  lambda ids, status: finished.append((ids, status)), float(step))
        outputs += processor.emit(states)
    assert not processor.parents  # a finished request is forgotten once emitted
    return outputs, finished


def joined(outputs: list[RequestOutput]) -> list[CompletionOutput]:
    total = outputs[0]
    for out in outputs[1:]:
        total = total.merged_with(out)
    return total.outputs


def test_deltas_add_up_to_the_cumulative_output(tokenizer):
    tokens = [[10, 11, 12, 13, 14], [20, 21, 22]]
    params = SamplingParams(n=2, seed=1, logprobs=0, max_tokens=5)
    cumulative, _ = run(tokenizer, params, tokens)
    deltas, _ = run(tokenizer, dataclasses.replace(params, output_kind=DELTA), tokens)
    assert all(out.delta for out in deltas) and not any(out.delta for out in cumulative)
    # each delta holds only the completions that changed in its step, with what is new
    assert [[(c.index, c.token_ids) for c in out.outputs] for out in deltas] == [
        [(0, [10]), (1, [20])], [(0, [11]), (1, [21])], [(0, [12]), (1, [22])], [(0, [13])], [(0, [14])]]
    final = cumulative[-1].outputs
    for whole, parts in zip(final, joined(deltas)):
        assert (parts.text, parts.token_ids, parts.logprobs, parts.finish_reason, parts.token_times) == \
               (whole.text, whole.token_ids, whole.logprobs, whole.finish_reason, whole.token_times)
        assert (parts.text_start, parts.token_start, parts.num_tokens) == (0, 0, len(whole.token_ids))
    assert [c.token_start for c in deltas[3].outputs] == [3] and deltas[3].outputs[0].text_start > 0
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("include_stop", [False, True])
def test_a_stream_never_gets_text_that_a_stop_string_later_cuts(tokenizer, include_stop):
    # "w12 w13" completes at w13; while "w12" waits alone it may be the start of the stop string
    params = SamplingParams(stop=["w12 w13", "zz"], include_stop_str_in_output=include_stop,
                            output_kind=DELTA, max_tokens=10)
    outputs, finished = run(tokenizer, params, [[10, 11, 12, 13, 14, 15]])
    handed = [c.text for out in outputs for c in out.outputs]
    final_text = "".join(handed)
    assert final_text == (" w10 w11 w12 w13" if include_stop else " w10 w11 ")  # after the prompt: a space
    assert finished == [(["r"], RequestStatus.FINISHED_STOPPED)]  # the scheduler is told: the stop string
    # every piece handed out is a prefix of the final text when joined in order: nothing was taken back
    so_far = ""
    for piece in handed:
        so_far += piece
        assert final_text.startswith(so_far)
    # held back while running: the stop buffer is len("w12 w13") - 1 characters, unless the stop is kept
    first = outputs[0].outputs[0]
    assert first.text == (" w10" if include_stop else "")
    assert outputs[-1].outputs[0].stop_reason == "w12 w13"


def test_a_late_reader_gets_the_deltas_joined_and_nothing_skipped():
    def delta(i: int, text: str, finish: str | None = None) -> RequestOutput:
        c = CompletionOutput(0, text, [i], finish, logprobs=[TokenLogprobs(i, -1.0, [])], token_start=i,
                             text_start=i * 2, token_times=[float(i)])
        return RequestOutput("r", None, [1], [c], RequestMetrics(0.0), finish is not None, delta=True)

    async def go():
        stream = RequestStream("r")
        for i, text in enumerate(["ab", "cd", "ef"]):
            stream.put(delta(i, text, "stop" if i == 2 else None))
        assert stream.num_generated_tokens == 3 and stream.ended == {0}
        (out,) = [o async for o in stream]
        c = out.outputs[0]
        assert (c.text, c.token_ids, c.token_times, c.finish_reason, c.text_start, c.token_start) == \
               ("abcdef", [0, 1, 2], [0.0, 1.0, 2.0], "stop", 0, 0)
        assert [e.token_id for e in c.logprobs] == [0, 1, 2] and out.finished

        cumulative = RequestStream("c")
        for n in (1, 2, 3):
            cumulative.put(RequestOutput("c", None, [1], [CompletionOutput(0, "x" * n, [7] * n)],
                                         RequestMetrics(0.0), n == 3))
        assert [len(o.outputs[0].token_ids) async for o in cumulative] == [3]  # the newest, whole

        failing = RequestStream("f")
        failing.put(delta(0, "ab"))
        failing.put(dataclasses.replace(delta(1, "cd", "abort"), error="boom"))
        with pytest.raises(RequestFailedError, match="boom"):
            [o async for o in failing]

    asyncio.run(go())


def test_listeners_see_whole_states_whatever_the_kind(tokenizer):
    seen = []
    processor = OutputProcessor(tokenizer,
                                listeners=[lambda out: seen.append((out.delta, list(out.outputs[0].token_ids)))])
    processor.add("r", None, [5], child_requests("r", SamplingParams(output_kind=DELTA)), 0.0)
    for step, token in enumerate([10, 11]):
        processor.emit(processor.settle(processor.process(CoreStepOutput(
            float(step), [RequestUpdate("r", token, None)])), lambda *_: None, float(step)))
    assert seen == [(False, [10]), (False, [10, 11])]
