"""Per-token staleness in vLLM's OpenAI server: the fields on each completion and chat choice.

The engine's outputs carry ``policy_epoch``, ``kv_cache_epoch`` and ``num_evictions`` on each
finished ``CompletionOutput`` (:mod:`.staleness`, which installs these hooks on an ``AsyncLLM``
with the ``weightsync`` backend); here they are copied onto the response choices, as extra
fields (vLLM's response models allow them), and, streamed, into each choice's final chunk.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from .staleness import FIELDS, _layout_error, _patch, _target, staleness_of


def _annotate(choice: Any, completion_output: Any) -> None:
    """Copy the fields onto a response choice (vLLM's response models allow extra fields)."""
    if hasattr(completion_output, FIELDS[0]):
        for name in FIELDS:
            setattr(choice, name, getattr(completion_output, name))


SSE_DATA, SSE_END = "data: ", "\n\n"
"""How vLLM's stream generators frame each chunk (one server-sent event)."""


def with_fields(event: str, finished: dict[int, dict[str, Any]]) -> str:
    """A streamed chunk with the fields added to each of its choices that ``finished`` has and
    that carries a ``finish_reason`` (those are popped from ``finished``); any other event (a
    token chunk, an error, the usage chunk, ``[DONE]``) is returned as it came."""
    if not (event.startswith(SSE_DATA) and event.endswith(SSE_END)):
        return event
    try:
        chunk = json.loads(event[len(SSE_DATA) : -len(SSE_END)])
    except ValueError:  # "[DONE]"
        return event
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    annotated = False
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict) and choice.get("finish_reason") is not None:
            fields = finished.pop(choice.get("index"), None)
            if fields is not None:
                choice.update(fields)
                annotated = True
    if not annotated:
        return event
    # Compact and unescaped, as pydantic's model_dump_json wrote it.
    return f"{SSE_DATA}{json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}{SSE_END}"


ChoiceOutputs = Callable[[Any, Any], Iterator[tuple[int, Any]]]
"""``(request, item of the result generator)`` to ``(choice index, CompletionOutput)`` pairs."""


def _completion_outputs(request: Any, item: Any) -> Iterator[tuple[int, Any]]:
    # Choices of several prompts are numbered on: prompt i's start at i * n.
    prompt_index, result = item
    for output in result.outputs:
        yield output.index + prompt_index * (request.n or 1), output


def _chat_outputs(request: Any, result: Any) -> Iterator[tuple[int, Any]]:
    for output in result.outputs:
        yield output.index, output


def _stream_generator(original: Callable[..., Any], outputs: ChoiceOutputs) -> Callable[..., Any]:
    """The stream generator, with each choice's final chunk carrying its fields. vLLM builds and
    serializes a chunk in one expression, so the fields go into the serialized event; they are
    read from the results the generator consumes (a final output holds the whole request's)."""
    signature = inspect.signature(original)

    async def wrapper(self: Any, *args: Any, **kwargs: Any) -> AsyncIterator[str]:
        bound = signature.bind(self, *args, **kwargs)
        request, results = bound.arguments["request"], bound.arguments["result_generator"]
        finished: dict[int, dict[str, Any]] = {}

        async def remembering() -> AsyncIterator[Any]:
            async for item in results:
                for index, output in outputs(request, item):
                    report = staleness_of(output) if output.finish_reason is not None else None
                    if report is not None:
                        finished[index] = report.as_dict()
                yield item

        bound.arguments["result_generator"] = remembering()
        async with contextlib.aclosing(original(*bound.args, **bound.kwargs)) as events:
            async for event in events:
                yield with_fields(event, finished) if finished else event

    return wrapper


def _patch_stream(owner: Any, name: str, outputs: ChoiceOutputs) -> None:
    if not inspect.isasyncgenfunction(_target(owner, name)):
        raise _layout_error(f"{owner.__qualname__}.{name} is no longer an async generator")
    make = functools.partial(_stream_generator, outputs=outputs)
    _patch(owner, name, make, ("request", "result_generator"))


def install_openai_hooks() -> None:
    """Patch the completion and chat responses, whole and streamed, to carry the fields."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponseChoice
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseChoice
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    for model in (CompletionResponseChoice, ChatCompletionResponseChoice):
        if model.model_config.get("extra") != "allow":
            raise _layout_error(f"{model.__name__} no longer allows extra fields")

    def completion_response(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, final_res_batch: Any, *args: Any, **kwargs: Any) -> Any:
            response = original(self, final_res_batch, *args, **kwargs)
            outputs = [output for result in final_res_batch for output in result.outputs]
            for choice, output in zip(response.choices, outputs, strict=True):
                _annotate(choice, output)
            return response

        return wrapper

    def chat_full_generator(original: Callable[..., Any]) -> Callable[..., Any]:
        async def wrapper(
            self: Any, request: Any, result_generator: AsyncIterator[Any], *args: Any, **kw: Any
        ) -> Any:
            final: list[Any] = []

            async def remembering() -> AsyncIterator[Any]:
                async for result in result_generator:
                    final[:] = [result]
                    yield result

            response = await original(self, request, remembering(), *args, **kw)
            if final and hasattr(response, "choices"):
                by_index = {output.index: output for output in final[0].outputs}
                for choice in response.choices:
                    if choice.index in by_index:
                        _annotate(choice, by_index[choice.index])
            return response

        return wrapper

    _patch(
        OpenAIServingCompletion,
        "request_output_to_completion_response",
        completion_response,
        ("final_res_batch",),
    )
    _patch(
        OpenAIServingChat,
        "chat_completion_full_generator",
        chat_full_generator,
        ("request", "result_generator"),
    )
    _patch_stream(OpenAIServingCompletion, "completion_stream_generator", _completion_outputs)
    _patch_stream(OpenAIServingChat, "chat_completion_stream_generator", _chat_outputs)
